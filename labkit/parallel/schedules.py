"""Pipeline schedules on ``send``/``recv``: GPipe and 1F1B, their bubble, and torch.distributed.pipelining.

With ``p`` stages and ``m`` equal micro-batches of time ``t`` per stage, a forward pass takes ``(m + p - 1) t``
of which each stage computes ``m t``: the idle share (the *bubble*) is ``(p - 1) / (m + p - 1)`` (Huang et al.
2019, GPipe). For training both schedules below have the same bubble; they differ in memory. GPipe runs all
forwards, then all backwards, so a stage holds the activations of all ``m`` micro-batches; 1F1B (Narayanan et al.
2019, PipeDream-Flush) starts backwards as soon as the last stage can, so stage ``s`` holds at most ``p - s``.
Inference has no backward; its schedule is GPipe's forward half, decoded step after step.

Every function runs on every rank of the pipeline (``stage.group``, default the world; stage = rank in it) with
the same arguments. Each compute region (a micro-batch's forward ``"F"`` or backward ``"B"``) runs as
``region(kind, micro_batch, fn)``: by default just ``fn()``; a measurement passes its own to time the regions and
meter the activations held (``labkit.bench.schedules``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.parallel.pipeline import LlamaStage, isend, micro_batches, recv, wait_all

SCHEDULES = ("gpipe", "1f1b")
"""Pipeline-parallel schedules."""


Region = Callable[[str, int, Callable[[], object]], object]
"""``region(kind, micro_batch, fn)``: runs ``fn`` (a forward 'F' or backward 'B' of one micro-batch), returns its
value."""


def _run(kind: str, mb: int, fn: Callable[[], object]) -> object:
    return fn()


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """GPipe's idle share ``(p - 1) / (m + p - 1)`` for equal stages and free communication."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages={num_stages} and num_microbatches={num_microbatches} must be >= 1")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


@torch.no_grad()
def gpipe_forward(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int,
                  region: Region = _run) -> torch.Tensor | None:
    """Forward-only GPipe over micro-batches of ``input_ids`` ``[batch, seq]`` (the same on every rank). Returns the
    logits ``[batch, seq, vocab]`` on the last stage, else None."""
    device, dtype, mbs = micro_batches(stage, input_ids, num_microbatches)
    rank, hidden = stage.stage_index, stage.config.hidden_size
    pending, outs = [], []
    for j, mb in enumerate(mbs):
        x = mb if stage.is_first else recv((*mb.shape, hidden), dtype, stage.peer(rank - 1), device)
        y = region("F", j, lambda x=x: stage(x))
        if stage.is_last:
            outs.append(y)
        else:
            isend(y, stage.peer(rank + 1), pending)
    wait_all(pending)
    return torch.cat(outs) if stage.is_last else None


def pipeline_train_step(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int, schedule: str = "1f1b",
                        region: Region = _run) -> torch.Tensor | None:
    """One training step's forward and backward of a next-token loss, micro-batched, under ``schedule``.

    Gradients accumulate in the stage's parameters (the mean loss over the batch, as the unsharded model would
    compute it). Returns the loss on the last stage, else None.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; allowed: {SCHEDULES}")
    device, dtype, mbs = micro_batches(stage, input_ids, num_microbatches)
    rank, p, m, hidden = stage.stage_index, stage.num_stages, num_microbatches, stage.config.hidden_size
    pending, saved, losses = [], {}, []

    def forward(j: int) -> None:
        mb = mbs[j]
        x = mb[:, :-1] if stage.is_first else \
            recv((mb.shape[0], mb.shape[1] - 1, hidden), dtype, stage.peer(rank - 1), device).requires_grad_()
        y = region("F", j, lambda: _stage_out(stage, x, mb, m))
        if not stage.is_last:
            isend(y, stage.peer(rank + 1), pending)
        saved[j] = (x, y)

    def backward(j: int) -> None:
        x, y = saved.pop(j)
        if stage.is_last:
            losses.append(y.detach())
            region("B", j, y.backward)
        else:
            g = recv(y.shape, y.dtype, stage.peer(rank + 1), device)
            region("B", j, lambda: y.backward(g))
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
    wait_all(pending)
    return torch.stack(losses).sum() if stage.is_last else None


def _stage_out(stage: LlamaStage, x: torch.Tensor, mb: torch.Tensor, m: int) -> torch.Tensor:
    """The stage's output; on the last stage, this micro-batch's share of the mean next-token loss."""
    y = stage(x)
    if not stage.is_last:
        return y
    return F.cross_entropy(y.reshape(-1, y.shape[-1]), mb[:, 1:].reshape(-1)) / m


# --- the same through torch.distributed.pipelining ------------------------------------------------------------
def torch_pipelining_forward(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int):
    """Forward-only ``ScheduleGPipe`` of ``torch.distributed.pipelining`` over the same stage module. Returns the
    logits on the last stage, else None; every rank passes the same ``input_ids``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    device = next(stage.parameters()).device
    pipe_stage = PipelineStage(stage, stage.stage_index, stage.num_stages, device, group=stage.group)
    sched = ScheduleGPipe(pipe_stage, n_microbatches=num_microbatches)  # no loss_fn: forward only
    ids = input_ids.to(device)
    with torch.no_grad():
        out = sched.step(ids) if stage.is_first else sched.step()
    return out if stage.is_last else None
