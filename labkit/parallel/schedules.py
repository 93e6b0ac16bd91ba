"""Pipeline schedules on ``send``/``recv``: GPipe and 1F1B, their bubble, and torch.distributed.pipelining.

With ``p`` stages and ``m`` equal micro-batches of time ``t`` per stage, a forward pass takes ``(m + p - 1) t``
of which each stage computes ``m t``: the idle share (the *bubble*) is ``(p - 1) / (m + p - 1)`` (Huang et al.
2019, GPipe). For training both schedules below have the same bubble; they differ in memory. GPipe runs all
forwards, then all backwards, so a stage holds the activations of all ``m`` micro-batches; 1F1B (Narayanan et al.
2019, PipeDream-Flush) starts backwards as soon as the last stage can, so stage ``s`` holds at most ``p - s``.
Inference has no backward; its schedule is GPipe's forward half, decoded step after step.

Every function runs on every rank of the pipeline (``stage.group``, default the world; stage = rank in it) with
the same arguments and returns a ``ScheduleStats``: compute events per micro-batch, busy and total time, the
measured bubble and the activation memory held (bytes of tensors autograd saved, via ``saved_tensors_hooks``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.parallel.pipeline import LlamaStage, isend, recv, wait_all

SCHEDULES = ("gpipe", "1f1b")
"""Pipeline-parallel schedules."""


@dataclass
class ScheduleStats:
    """What one rank saw during one schedule. ``events``: ``(kind, micro_batch, start_s, end_s)``, kind ``F`` or
    ``B``, times from the common start. ``bubble = 1 - busy_s / total_s``."""

    stage: int
    num_stages: int
    num_microbatches: int
    events: list = field(default_factory=list)
    total_s: float = 0.0
    peak_inflight: int = 0
    peak_activation_bytes: int = 0

    @property
    def busy_s(self) -> float:
        return sum(e - s for _, _, s, e in self.events)

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.total_s

    def to_dict(self) -> dict:
        return {"stage": self.stage, "num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                "events": self.events, "total_s": self.total_s, "busy_s": self.busy_s, "bubble": self.bubble,
                "peak_inflight": self.peak_inflight, "peak_activation_bytes": self.peak_activation_bytes}


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """GPipe's idle share ``(p - 1) / (m + p - 1)`` for equal stages and free communication."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages={num_stages} and num_microbatches={num_microbatches} must be >= 1")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class _Clock:
    """Times compute regions against a start shared by all ranks (a barrier), synchronising CUDA if present."""

    def __init__(self, stats: ScheduleStats, device: torch.device, group=None):
        self.stats, self.device, self.group = stats, device, group
        self._sync()
        dist.barrier(group=group)
        self.t0 = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def region(self, kind: str, mb: int, fn):
        start = time.perf_counter() - self.t0
        out = fn()
        self._sync()
        self.stats.events.append((kind, mb, start, time.perf_counter() - self.t0))
        return out

    def stop(self, pending: list) -> None:
        wait_all(pending)
        self._sync()
        dist.barrier(group=self.group)
        self.stats.total_s = time.perf_counter() - self.t0


def _setup(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int):
    if num_microbatches < 1 or input_ids.shape[0] % num_microbatches:
        raise ValueError(f"num_microbatches={num_microbatches} must divide batch size {input_ids.shape[0]}")
    device = next(stage.parameters()).device
    dtype = next(stage.layers.parameters()).dtype
    stats = ScheduleStats(stage.stage_index, stage.num_stages, num_microbatches)
    return device, dtype, stats, list(input_ids.to(device).chunk(num_microbatches))


@torch.no_grad()
def gpipe_forward(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int):
    """Forward-only GPipe over micro-batches of ``input_ids`` ``[batch, seq]`` (the same on every rank).

    Returns ``(logits [batch, seq, vocab] on the last stage else None, ScheduleStats)``.
    """
    device, dtype, stats, mbs = _setup(stage, input_ids, num_microbatches)
    rank, hidden = stage.stage_index, stage.config.hidden_size
    pending, outs = [], []
    clock = _Clock(stats, device, stage.group)
    for j, mb in enumerate(mbs):
        x = mb if stage.is_first else recv((*mb.shape, hidden), dtype, stage.peer(rank - 1), device)
        y = clock.region("F", j, lambda x=x: stage(x))
        if stage.is_last:
            outs.append(y)
        else:
            isend(y, stage.peer(rank + 1), pending)
    clock.stop(pending)
    stats.peak_inflight = 1
    return (torch.cat(outs) if stage.is_last else None), stats


class _ActivationMeter:
    """Bytes of non-parameter tensors autograd saves during a micro-batch's forward (unique storages)."""

    def __init__(self, stage: LlamaStage):
        self.params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        self.live, self.peak, self.per_mb = 0, 0, {}

    def forward(self, j: int, fn):
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        self.per_mb[j] = sum(seen.values())
        self.live += self.per_mb[j]
        self.peak = max(self.peak, self.live)
        return out

    def backward_done(self, j: int) -> None:
        self.live -= self.per_mb.pop(j)


def pipeline_train_step(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int, schedule: str = "1f1b"):
    """One training step's forward and backward of a next-token loss, micro-batched, under ``schedule``.

    Gradients accumulate in the stage's parameters (the mean loss over the batch, as the unsharded model would
    compute it). Returns ``(loss on the last stage else None, ScheduleStats)``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; allowed: {SCHEDULES}")
    device, dtype, stats, mbs = _setup(stage, input_ids, num_microbatches)
    rank, p, m, hidden = stage.stage_index, stage.num_stages, num_microbatches, stage.config.hidden_size
    pending, saved, losses = [], {}, []
    meter = _ActivationMeter(stage)
    clock = _Clock(stats, device, stage.group)

    def forward(j: int) -> None:
        mb = mbs[j]
        x = mb[:, :-1] if stage.is_first else \
            recv((mb.shape[0], mb.shape[1] - 1, hidden), dtype, stage.peer(rank - 1), device).requires_grad_()
        y = clock.region("F", j, lambda: meter.forward(j, lambda: _stage_out(stage, x, mb, m)))
        if not stage.is_last:
            isend(y, stage.peer(rank + 1), pending)
        saved[j] = (x, y)
        stats.peak_inflight = max(stats.peak_inflight, len(saved))

    def backward(j: int) -> None:
        x, y = saved.pop(j)
        if stage.is_last:
            losses.append(y.detach())
            clock.region("B", j, y.backward)
        else:
            g = recv(y.shape, y.dtype, stage.peer(rank + 1), device)
            clock.region("B", j, lambda: y.backward(g))
        meter.backward_done(j)
        if not stage.is_first:
            isend(x.grad, stage.peer(rank - 1), pending)

    warmup = m if schedule == "gpipe" else min(p - rank - 1, m)
    for j in range(warmup):
        forward(j)
    for j in range(warmup, m):  # 1F1B steady state: one forward, then the oldest backward
        forward(j)
        backward(j - warmup)
    for j in range(m - warmup, m):
        backward(j)
    clock.stop(pending)
    stats.peak_activation_bytes = meter.peak
    return (torch.stack(losses).sum() if stage.is_last else None), stats


def _stage_out(stage: LlamaStage, x: torch.Tensor, mb: torch.Tensor, m: int) -> torch.Tensor:
    """The stage's output; on the last stage, this micro-batch's share of the mean next-token loss."""
    y = stage(x)
    if not stage.is_last:
        return y
    return F.cross_entropy(y.reshape(-1, y.shape[-1]), mb[:, 1:].reshape(-1)) / m


# --- the same through torch.distributed.pipelining ------------------------------------------------------------
def torch_pipelining_forward(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int):
    """Forward-only ``ScheduleGPipe`` of ``torch.distributed.pipelining`` over the same stage module.

    Returns ``(logits on the last stage else None, seconds)``; every rank passes the same ``input_ids``.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    device = next(stage.parameters()).device
    pipe_stage = PipelineStage(stage, stage.stage_index, stage.num_stages, device, group=stage.group)
    sched = ScheduleGPipe(pipe_stage, n_microbatches=num_microbatches)  # no loss_fn: forward only
    ids = input_ids.to(device)
    dist.barrier(group=stage.group)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = sched.step(ids) if stage.is_first else sched.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=stage.group)
    return (out if stage.is_last else None), time.perf_counter() - t0
