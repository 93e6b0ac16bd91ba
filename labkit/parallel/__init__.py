"""Tensor and pipeline parallelism on torch.distributed: launch, TP layers, DTensor plan, pipeline schedules,
communication measurement and cost models. Start with ``launch`` (runs a rank function on N processes)."""

from labkit.parallel.launch import RankError, launch

__all__ = ["RankError", "launch"]
