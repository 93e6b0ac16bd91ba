"""Checks and helpers shared by the Triton kernels: argument validation with clear errors, launch sizes.

Every public kernel wrapper validates its tensors here first, so a wrong dtype, shape or device fails in
Python with a message that names the argument and the allowed values, instead of inside Triton (or silently).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU-only host)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelCall:
    """One op that ran: ``op`` (a paged forward's 'norm', 'rope', 'attention', 'activation', 'projection',
    'qkv_projection'; a quantised matmul's 'matmul' launch), the ``kernel`` that ran it ('torch' for the reference
    expression, else the kernel's name: for 'matmul' its launcher, ``w4_gemv_xs``, ``w8_gemv_xs``,
    ``splitk_gemv``, ``any_group_gemv``, ``quantized_gemm``, or a peer's path), what the kernel took in besides its
    own work (``fused``: 'norm', 'residual', 'swiglu', 'rope', 'cache'), its launch mode (``pdl``), the stationary
    GEMV's ``plan`` (a ``StationaryPlan``) and the ``rows`` multiplied, where known."""

    op: str
    kernel: str
    fused: tuple[str, ...] = ()
    pdl: str = ""
    plan: object = None
    rows: int | None = None


class KernelLog(list):
    """The ``KernelCall`` of every op it is handed to, in order (a list): the public record of which kernel ran.
    Pass one to ``ModelRunner(kernel_log=...)`` (or ``ModelInput.build(..., kernel_log=...)``) to see which kernel
    each op of an eager step ran (a replayed CUDA graph runs what its capture ran and records nothing), to a
    quantised matmul's ``log=`` to see its launch, or to a layer's ``KernelChoice.log`` to see the path its rows
    took."""

    def record(self, op: str, kernel: str, fused=(), pdl: str = "", plan=None, rows: int | None = None) -> None:
        self.append(KernelCall(op, kernel, tuple(sorted(fused)), pdl, plan, rows))

    def kernels(self, op: str | None = None) -> list[str]:
        """The kernels that ran ``op`` (every op: None), in order."""
        return [c.kernel for c in self if op is None or c.op == op]


def interpreting() -> bool:
    """True when Triton runs through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, dtypes: tuple[torch.dtype, ...] | None = None,
                 dim: int | tuple[int, ...] | None = None, device: torch.device | None = None) -> None:
    """Raise naming ``name`` unless ``t`` is a tensor of an allowed dtype, rank and device.

    Tensors must live on CUDA, or on the CPU when Triton's interpreter is on.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {_name(t.dtype)}; allowed: {', '.join(_name(d) for d in dtypes)}")
    if dim is not None:
        dims = (dim,) if isinstance(dim, int) else dim
        if t.dim() not in dims:
            raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, "
                             f"got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}; "
                         "put them on one device")
    if t.device.type == "cuda":
        return
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; labkit's kernels run on 'cuda' "
                         "(or 'cpu' under Triton's interpreter)")
    if not interpreting():
        raise ValueError(f"{name} is on the CPU but TRITON_INTERPRET is not set; import labkit before "
                         "triton on a CPU-only host, or move the tensors to 'cuda'")


def refuse_bf16_dot_on_cpu(name: str, t: torch.Tensor) -> None:
    """Triton's CPU interpreter returns garbage (no error) for ``tl.dot`` on bfloat16: refuse instead."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu":
        raise ValueError(f"{name} is bfloat16 on the CPU: this kernel uses tl.dot, which Triton's "
                         "interpreter computes wrongly in bfloat16; use float16 or float32 on the CPU, "
                         "bfloat16 on CUDA")


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")


def rows_view(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as ``[rows, cols]`` with a contiguous last dimension, without copying when the layout allows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])  # a copy: the leading dims are not collapsible


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


PDL_MODES = ("", "release", "overlap")  # programmatic dependent launch: none, release the next launch, and overlap


def check_pdl(pdl: str, allowed: tuple[str, ...] = PDL_MODES) -> None:
    """Refuse a ``pdl`` launch mode outside ``allowed``."""
    if pdl not in allowed:
        raise ValueError(f"pdl={pdl!r} is unknown; allowed: {allowed}")


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can take part in programmatic dependent launch (CUDA, sm_90 and later; the
    interpreter cannot)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch(pdl: str, device: torch.device) -> dict:
    """A kernel's launch options for a checked ``pdl`` mode: ``PDL`` (its constexpr: release the launch after it as
    it starts, and wait for the kernel ahead where it is launched as a dependent) and, for ``"overlap"``,
    ``launch_pdl`` (launched as a programmatic dependent launch). Plain wherever ``pdl_supported`` is not."""
    if not pdl or not pdl_supported(device):
        return {"PDL": False}
    return {"PDL": True, **({"launch_pdl": True} if pdl == "overlap" else {})}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 4 for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def cold_l2_bench(fn, quantiles=(0.5, 0.2, 0.8), reps: int = 25) -> list[float]:
    """Milliseconds of ``fn()`` at ``quantiles`` with the L2 cache holding *clean* lines of another buffer before
    each call, as Triton's autotuner expects from its ``do_bench`` argument.

    ``triton.testing.do_bench`` empties the cache by writing zeros over 256 MB, which leaves it full of dirty
    lines: a kernel timed after that also pays their write-back, about as many bytes as it reads, which distorts
    memory-bound kernels of a few microseconds (the GEMVs) and their ranking. ``quantiles`` come back in the
    order given (the autotuner asks for ``(0.5, 0.2, 0.8)``). Reading 256 MB instead (a sum)
    evicts the kernel's data just as well and leaves nothing to write back -- as in a decode step, where the
    weights of one layer are not in cache when its GEMV starts. A sleep on the device before the start event
    keeps the host's launch overhead (tens of microseconds for a Triton launch from Python) out of the time."""
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.ones(64 << 20, dtype=torch.float32, device=dev)  # the caching allocator hands back the same block
    fn()
    torch.cuda.synchronize(dev)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        buf.sum()  # the cache now holds the end of buf, unmodified
        torch.cuda._sleep(400_000)  # ~0.2 ms on the device: the launch below is queued before `start` runs
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(dev)
    times = torch.tensor([s.elapsed_time(e) for s, e in events])
    return torch.quantile(times, torch.tensor(quantiles, dtype=times.dtype)).tolist()


def graph_replay_ms(fn, per: int = 4, reps: int = 10) -> list[float]:
    """Milliseconds per call of ``fn``, one sample per replay: ``fn`` called once (compiles, autotunes), then
    captured ``per`` times back to back in a CUDA graph, replayed once to warm up and ``reps`` times timed. Call it
    outside any capture."""
    fn()
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        for _ in range(per):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / per for s, e in events]


def graph_bench(fn, quantiles=(0.5, 0.2, 0.8), per: int = 4, reps: int = 10) -> list[float]:
    """``graph_replay_ms`` at ``quantiles``: how a captured model step runs a kernel, and how notebook 03 times
    them. An autotuner ``do_bench``: Triton's own times single launches after writing 256 MB (dirty lines in L2),
    which ranks memory-bound kernels within a few percent of each other differently
    (research/records/h200/rmsnorm_study_4618224.json). Call it outside any capture, as autotuning is."""
    times = torch.tensor(graph_replay_ms(fn, per, reps))
    return torch.quantile(times, torch.tensor(quantiles, dtype=times.dtype)).tolist()


def should_check(check: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether a kernel checks its index arguments on the host: ``check`` when given; by default (``None``) unless a
    CUDA graph is being captured, where a host copy is impossible (the caller checked the step before)."""
    if check is not None:
        return bool(check)
    on_cuda = any(t.is_cuda for t in tensors)
    return not (on_cuda and torch.cuda.is_current_stream_capturing())


def check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int,
                       query_start_loc: torch.Tensor | None = None, num_tokens: int | None = None) -> None:
    """Host check of a paged batch's index data, one copy of each (once per call, not per layer of the kernel):
    each ``context_lens[i]`` in ``1 .. max_blocks * block_size`` (the table's capacity), each block id a sequence
    reads (the first ``ceil(context_lens[i] / block_size)`` of its row) in ``0 .. num_blocks - 1``, and, for a
    prefill batch, ``query_start_loc`` non-decreasing from 0 to at most ``num_tokens`` with every sequence's query
    count within its context. A ``ValueError`` names the sequence and the value: the kernels index memory with
    these and do not check them on the device (an out-of-range one is a crash or garbage)."""
    tables, ctx = block_tables.tolist(), context_lens.tolist()
    cap = block_tables.shape[1] * block_size
    for i, (row, n) in enumerate(zip(tables, ctx)):
        if not 1 <= n <= cap:
            raise ValueError(f"context_lens[{i}]={n} must be in 1 .. {cap} (block_tables holds {len(row)} blocks "
                             f"of {block_size} tokens per sequence)")
        used = row[:-(-n // block_size)]
        bad = next((b for b in used if not 0 <= b < num_blocks), None)
        if bad is not None:
            raise ValueError(f"block_tables[{i}] holds block id {bad}; allowed: 0 .. {num_blocks - 1} (the pool's "
                             f"blocks)")
    if query_start_loc is None:
        return
    starts = query_start_loc.tolist()
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > num_tokens:
        raise ValueError(f"query_start_loc={starts} must rise from 0 to at most num_tokens={num_tokens}")
    for i, n in enumerate(ctx):
        if starts[i + 1] - starts[i] > n:
            raise ValueError(f"sequence {i} has {starts[i + 1] - starts[i]} query rows but context_lens[{i}]={n}; "
                             "a context holds at least its queries")
