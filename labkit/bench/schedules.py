"""Pipeline schedules timed from outside: each compute region of ``labkit.parallel.schedules`` (a micro-batch's
forward or backward) timed against a start shared by all ranks, and the activation memory a stage holds metered.

``timed_schedule(run, stage, input_ids, m, ...)`` runs ``gpipe_forward`` or ``pipeline_train_step`` with a
``ScheduleTimer`` as its ``region`` and returns ``(its result, ScheduleStats)``: compute events per micro-batch,
busy and total time, the measured bubble, the peak of micro-batches in flight and of activation bytes held (bytes of
tensors autograd saved, via ``saved_tensors_hooks``). Every rank calls it with the same arguments.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.parallel.pipeline import LlamaStage
from labkit.parallel.schedules import pipeline_train_step


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


class ScheduleTimer:
    """A schedule's ``region``: times each region (CUDA synchronised) from ``start()``, a barrier of the stage's
    group; while training, meters the bytes of non-parameter tensors autograd saves in each forward (unique
    storages) until that micro-batch's backward."""

    def __init__(self, stage: LlamaStage, num_microbatches: int, training: bool):
        self.stats = ScheduleStats(stage.stage_index, stage.num_stages, num_microbatches)
        self.device = next(stage.parameters()).device
        self.group, self.training = stage.group, training
        self.params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        self.held: dict[int, int] = {}
        self.t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        dist.barrier(group=self.group)
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        self._sync()
        dist.barrier(group=self.group)
        self.stats.total_s = time.perf_counter() - self.t0

    def __call__(self, kind: str, mb: int, fn: Callable[[], object]) -> object:
        start = time.perf_counter() - self.t0
        out = self._forward(mb, fn) if kind == "F" and self.training else fn()
        self._sync()
        self.stats.events.append((kind, mb, start, time.perf_counter() - self.t0))
        if kind == "B":
            self.held.pop(mb, None)
        self.stats.peak_inflight = max(self.stats.peak_inflight, len(self.held) if self.training else 1)
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, sum(self.held.values()))
        return out

    def _forward(self, mb: int, fn: Callable[[], object]) -> object:
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        self.held[mb] = sum(seen.values())
        return out


def timed_schedule(run: Callable, stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int,
                   **kwargs) -> tuple[object, ScheduleStats]:
    """``run(stage, input_ids, num_microbatches, region=timer, **kwargs)`` (``gpipe_forward`` or
    ``pipeline_train_step``) timed region by region: ``(its result, ScheduleStats)``."""
    timer = ScheduleTimer(stage, num_microbatches, training=run is pipeline_train_step)
    timer.start()
    out = run(stage, input_ids, num_microbatches, region=timer, **kwargs)
    timer.stop()
    return out, timer.stats


def time_torch_pipelining(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int) -> tuple[object, float]:
    """``labkit.parallel.torch_pipelining_forward`` timed between two barriers: ``(its result, seconds)``."""
    from labkit.parallel.schedules import torch_pipelining_forward

    device = next(stage.parameters()).device
    dist.barrier(group=stage.group)
    t0 = time.perf_counter()
    out = torch_pipelining_forward(stage, input_ids, num_microbatches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=stage.group)
    return out, time.perf_counter() - t0
