"""Helpers shared by the kernels: arrival counters that persist between launches."""

import torch

from labkit.kernels.common import arrival_counters


def test_arrival_counters_are_zeroed_grown_and_kept_per_owner():
    """One zeroed int32 buffer per (owner, device), reused while it is large enough, replaced by a larger zeroed
    one when a call needs more (the old one kept alive: a captured CUDA graph may still point at it), and never
    shared between owners."""
    cpu = torch.device("cpu")
    first = arrival_counters("test_owner", 10, cpu)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    first[3] = 7  # as a launch cut short would leave it: the same buffer comes back, not a fresh one
    assert arrival_counters("test_owner", first.numel(), cpu) is first
    grown = arrival_counters("test_owner", first.numel() + 1, cpu)
    assert grown is not first and grown.numel() > first.numel() and not grown.any()
    assert arrival_counters("test_other_owner", 10, cpu) is not grown


def test_kernel_workspace_holds_its_fill_when_made_or_grown():
    """A workspace made full of ``fill`` (the TAGGED GEMV reduction's empty words are -1), grown to another
    buffer of ``fill``; the counters of an owner are not its other workspaces."""
    from labkit.kernels.common import kernel_workspace

    cpu = torch.device("cpu")
    first = kernel_workspace("test_fill", 300, cpu, fill=-1)
    assert first.numel() >= 300 and (first == -1).all()
    grown = kernel_workspace("test_fill", first.numel() + 1, cpu, fill=-1)
    assert grown is not first and (grown == -1).all()
    assert arrival_counters("test_fill", 10, cpu) is not grown
