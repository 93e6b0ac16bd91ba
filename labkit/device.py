"""Where things run: the default device, the Triton interpreter switch, and host-to-device copies that do not make
the host wait for the device."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def has_cuda() -> bool:
    """True when a CUDA device is usable by torch."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device labkit uses when none is given: the current CUDA device, else the CPU."""
    return torch.device("cuda") if has_cuda() else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Turn ``None``, ``"auto"`` or a device string into a ``torch.device``, with a clear error.

    Asking for CUDA where none is present raises a ``ValueError`` naming the argument.
    """
    if device is None or device == "auto":
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'auto'") from e
    if dev.type == "cuda" and not has_cuda():
        raise ValueError(f"device={device!r} asks for CUDA but no CUDA device is present; use 'cpu' or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: labkit runs on 'cpu' or 'cuda', not {dev.type!r}")
    return dev


def host_to_device(data: torch.Tensor | np.ndarray, device: torch.device,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``data`` (a host tensor or a numpy array) on ``device`` (into ``out``, a device tensor of its shape, if given)
    without the host waiting for the device's queued work. On CUDA the data are staged in pinned memory and copied with
    ``non_blocking=True``: a copy from pageable memory may synchronise with the stream first (CUDA's API
    synchronisation rules; a plain ``torch.tensor(..., device='cuda')`` always does), which would stall the host
    behind the GPU. torch's pinned allocator keeps the staging block until the copy is done. On the CPU: ``data``
    itself (a numpy array's memory shared), or copied into ``out``."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type == "cuda":
        t = t.pin_memory()
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)


def native_bf16(device: str | torch.device) -> bool:
    """Whether ``device`` multiplies bf16 natively: CUDA, or a CPU with AVX-512 BF16 or AMX. Elsewhere torch's CPU
    bf16 matmul falls back to a slow path (on an AVX2-only EPYC, 1000 ms against fp32's 8 ms for a
    256 x 512 x 2048 product), so CPU runs there should compute in fp32."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return True
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def quiet_profiler_logs() -> None:
    """Hide the ``USDT: ... profiler_start`` / ``profiler_stop`` lines torch's profiler (Kineto) prints to stderr on
    every profile: ``KINETO_LOG_LEVEL=6`` unless the user set a level (Kineto reads it when profiling starts)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def configure_triton_for_host() -> None:
    """Route Triton through its interpreter when there is no GPU.

    Triton reads ``TRITON_INTERPRET`` when it is imported, so this is a no-op (with a warning) if triton is
    already imported without it on a CPU-only host.
    """
    if has_cuda() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        print("labkit: triton was imported before labkit on a CPU-only host; set TRITON_INTERPRET=1 "
              "before importing triton to run labkit's kernels", file=sys.stderr)
    os.environ["TRITON_INTERPRET"] = "1"


@contextmanager
def environ(**updates: str | None) -> Iterator[None]:
    """Set (a string) or unset (``None``) environment variables for the block, restoring every one afterwards.

    Child processes started inside the block (spawned ranks, notebook kernels) inherit the updated values.
    """
    before = {k: os.environ.get(k) for k in updates}
    try:
        for k, v in updates.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
