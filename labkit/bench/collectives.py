"""Collectives measured: counted (``CountingCollectives``), skipped (``SkippedCollectives``: the same compute without
the communication, to time how much of a step is communication), lent to a model from outside (``use_collectives``),
and timed (latency, bandwidth, alpha-beta fit, overlap).

The tensor-parallel layers hold a ``labkit.parallel.comm.Collectives`` (``layer.comm``); ``use_collectives(model,
c)`` swaps every one of them for ``c`` for a block and puts the originals back, so a measurement wraps the product
instead of switching it.

Measured quantities follow nccl-tests (``doc/PERFORMANCE.md``): ``algbw = bytes / time`` and the bus bandwidth
``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather (bytes = the
gathered output) and 1 for send/recv, so that busbw is comparable with the link's peak whatever ``n`` is.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.comm import Collectives

OPS = ("all_reduce", "all_gather", "send_recv")


class CountingCollectives(Collectives):
    """Collectives that tally their calls and input bytes per op (``calls``, ``bytes``) as they run."""

    def __init__(self, group=None):
        super().__init__(group)
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def _tally(self, op: str, t: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += t.numel() * t.element_size()

    def all_reduce(self, t: torch.Tensor, group=None) -> torch.Tensor:
        self._tally("all_reduce", t)
        return super().all_reduce(t, group)

    def all_gather(self, t: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
        self._tally("all_gather", t)
        return super().all_gather(t, dim, group)


class SkippedCollectives(Collectives):
    """No communication: all-reduce keeps the local partial sum, all-gather repeats the local shard. The results
    are wrong and the compute is the same: only for timing a step with and without its communication."""

    def all_reduce(self, t: torch.Tensor, group=None) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
        return torch.cat([t.contiguous()] * dist.get_world_size(self.group if self.group is not None else group),
                         dim=dim)


@contextmanager
def use_collectives(model: nn.Module, collectives: Collectives) -> Iterator[Collectives]:
    """Inside, every tensor-parallel layer of ``model`` (a module with a ``comm``) issues its collectives through
    ``collectives``; the layers' own come back after."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "comm", None), Collectives)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel layer (no module holds a Collectives)")
    before = [m.comm for m in layers]
    for m in layers:
        m.comm = collectives
    try:
        yield collectives
    finally:
        for m, c in zip(layers, before):
            m.comm = c


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor of ``op`` on ``n`` ranks."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is unknown; allowed: {OPS}")
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "send_recv": 1.0}[op]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective(op: str, nbytes: int, device: torch.device, group=None) -> Callable[[], None]:
    """A closure doing one ``op`` of ``nbytes`` (the all-gather output / the message) on fresh random data."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = max(1, nbytes // 4)
    if op == "all_reduce":
        buf = torch.randn(numel, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        shard = torch.randn(max(1, numel // n), device=device)
        if device.type == "cuda":
            out = torch.empty(n * shard.numel(), device=device)
            return lambda: dist.all_gather_into_tensor(out, shard, group=group)
        outs = [torch.empty_like(shard) for _ in range(n)]
        return lambda: dist.all_gather(outs, shard, group=group)
    if op == "send_recv":  # ring: send to the next rank, receive from the previous one, at the same time
        src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
        peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        nxt, prv = peer((rank + 1) % n), peer((rank - 1) % n)

        def ring() -> None:
            for w in (dist.isend(src, nxt, group=group), dist.irecv(dst, prv, group=group)):
                w.wait()
        return ring
    raise ValueError(f"op={op!r} is unknown; allowed: {OPS}")


def time_collective(op: str, nbytes: int, device: torch.device, iters: int = 10, repeats: int = 3,
                    warmup: int = 2, group=None) -> float:
    """Seconds per ``op`` of ``nbytes``: ``iters`` back-to-back calls timed together (as nccl-tests does), the
    median of ``repeats`` such loops, then the maximum over ranks (a collective is as slow as its slowest rank).
    Every rank must call this with the same arguments."""
    fn = _collective(op, nbytes, device, group)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / iters)
    t = torch.tensor([sorted(samples)[len(samples) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def sweep(ops: tuple[str, ...], sizes: list[int], device: torch.device, iters: int = 10, repeats: int = 3,
          group=None, progress: bool = False) -> list[dict]:
    """Time every op at every message size; rows of ``op, bytes, seconds, algbw_gb_s, busbw_gb_s``."""
    from tqdm.auto import tqdm

    n = dist.get_world_size(group)
    rows = []
    for op in ops:
        for nbytes in tqdm(sizes, desc=op, disable=not progress):
            nbytes = _actual_bytes(op, nbytes, n)
            t = time_collective(op, nbytes, device, iters=iters, repeats=repeats, group=group)
            alg = nbytes / t / 1e9
            rows.append({"op": op, "bytes": nbytes, "seconds": t, "algbw_gb_s": alg,
                         "busbw_gb_s": alg * bus_factor(op, n), "world_size": n})
    return rows


def _actual_bytes(op: str, nbytes: int, n: int) -> int:
    """The bytes ``_collective`` really moves for a requested size (float32 elements, whole shards)."""
    numel = max(1, nbytes // 4)
    return 4 * (n * max(1, numel // n) if op == "all_gather" else numel)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``t = alpha + bytes / beta``; returns ``(alpha_s, beta_bytes_per_s)``.

    Least squares on the *relative* residual ``(alpha + bytes/beta - t) / t``, so that small messages (which fix
    alpha) weigh as much as large ones (which fix beta).
    """
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(f"need at least 2 (bytes, seconds) pairs of equal length, got {len(nbytes)} and "
                         f"{len(seconds)}")
    x = torch.tensor(nbytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    a = torch.stack([1.0 / t, x / t], dim=1)  # rows: [1/t, x/t] @ [alpha, 1/beta] ~ 1
    sol = torch.linalg.lstsq(a, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1)
    alpha, inv_beta = sol[0].item(), sol[1].item()
    if inv_beta <= 0:
        raise ValueError("the fit gave a non-positive 1/beta: time does not grow with size; sweep larger messages")
    return max(alpha, 0.0), 1.0 / inv_beta


def measure_overlap(nbytes: int, matmul_n: int, device: torch.device, iters: int = 5, group=None) -> dict:
    """Overlap of an all-reduce with independent computation (an ``n x n`` matmul), seconds per iteration.

    ``comm``: the all-reduce alone; ``compute``: the matmul alone; ``serial``: one then the other; ``overlapped``:
    the all-reduce started asynchronously (``async_op=True``), the matmul run, then ``wait()``. ``hidden_frac`` is
    the share of the shorter of the two that overlap hid: ``(serial - overlapped) / min(comm, compute)``.
    """
    buf = torch.randn(max(1, nbytes // 4), device=device)
    a, b = torch.randn(matmul_n, matmul_n, device=device), torch.randn(matmul_n, matmul_n, device=device)

    def comm() -> None:
        dist.all_reduce(buf, group=group)

    def compute() -> None:
        torch.mm(a, b)

    def serial() -> None:
        comm()
        compute()

    def overlapped() -> None:
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    out = {}
    for name, fn in (("comm", comm), ("compute", compute), ("serial", serial), ("overlapped", overlapped)):
        out[name] = _time_synced(fn, device, iters, group)
    out["hidden_frac"] = (out["serial"] - out["overlapped"]) / min(out["comm"], out["compute"])
    out.update(bytes=buf.numel() * 4, matmul_n=matmul_n)
    return out


def _time_synced(fn: Callable[[], None], device: torch.device, iters: int, group=None) -> float:
    """Median seconds of ``fn`` over ``iters`` calls, ranks started together, max over ranks."""
    fn()
    samples = []
    for _ in range(iters):
        _sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    t = torch.tensor([sorted(samples)[len(samples) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
