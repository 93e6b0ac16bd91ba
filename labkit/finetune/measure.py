"""Measured memory: peak bytes allocated while a function runs, on the GPU and on the CPU, and live tensor bytes.

On CUDA the caching allocator keeps the counters (``torch.cuda.max_memory_allocated``). The CPU allocator keeps
none, but when the profiler runs with ``profile_memory=True`` every allocation and free through c10's CPU
allocator is reported with the running total of bytes allocated since profiling began (the profiler's
``Allocation`` events, ``total_allocated``). Its maximum is the CPU analogue of ``max_memory_allocated`` over the
region: it sees the intermediates inside operators (attention workspaces, optimizer temporaries) that a
saved-tensor hook or a scan of live tensors would miss, and nothing outside torch (Python objects, the
interpreter). Blocks allocated before the region and freed inside it are not subtracted (the profiler does not
know their size), so a measured region should free only what it allocated: e.g. a training step that starts
with ``grad = None`` and ends with ``zero_grad(set_to_none=True)``.

Both paths return the peak *above the bytes live at the start*; add ``live_tensor_bytes`` of the tensors alive
at the start (parameters, optimizer state, the batch) to get the absolute peak. Counting it this way on the GPU
too keeps other models that a notebook still holds out of the number.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass
class PeakMemory:
    """Peak bytes allocated above the start of a region, and how they were measured."""

    peak_above_start: int
    method: str
    result: object = None


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (Kineto prints two 'USDT ... profiler_start/stop' lines from C++ on every
    profiled region, which would flood a notebook); Python exceptions still propagate."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak(fn: Callable[[], object]) -> PeakMemory:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    peak = 0
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            peak = max(peak, node.extra_fields.total_allocated)
    return PeakMemory(int(peak), "torch.profiler CPU allocator events (max total_allocated)", result)


def _cuda_peak(fn: Callable[[], object], device: torch.device) -> PeakMemory:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    return PeakMemory(int(peak), "torch.cuda.max_memory_allocated - memory_allocated at start", result)


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> PeakMemory:
    """Run ``fn()`` once and return the peak bytes allocated above the start (and ``fn``'s result)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return _cuda_peak(fn, dev)
    if dev.type == "cpu":
        return _cpu_peak(fn)
    raise ValueError(f"device={str(device)!r}: peak memory is measured on 'cpu' or 'cuda', not {dev.type!r}")


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors(state)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "absmax"):  # a bitsandbytes QuantState: absmax, code, nested state2, offset
        for name in ("absmax", "code", "offset", "state2"):
            v = getattr(obj, name, None)
            if v is not None:
                yield from _tensors(v)


def live_tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages held by tensors, modules (parameters, buffers, quantisation states,
    ``.grad``) and optimizers (their state), each storage counted once however many views share it."""
    seen: dict[tuple, int] = {}
    for obj in objs:
        for t in _tensors(obj):
            extra = [t.grad] if t.grad is not None else []
            qs = getattr(t, "quant_state", None)
            if qs is not None:
                extra += list(_tensors(qs))
            for u in [t, *extra]:
                s = u.untyped_storage()
                seen[(u.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())
