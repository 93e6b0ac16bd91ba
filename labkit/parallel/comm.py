"""The collectives the tensor-parallel layers issue, as an object they hold (``Collectives``), so a measurement can
count or replace them from outside (``labkit.bench.collectives``) without a switch inside the product.

``Collectives(group)``: ``group`` None runs each collective on the group the layer passes (its own); a group given
here runs them on that one instead (the same ranks with another communicator: two half-batches captured under two
communicators can then communicate concurrently).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Collectives:
    """``all_reduce`` and ``all_gather`` over torch.distributed, on ``group`` if given, else on the caller's."""

    def __init__(self, group=None):
        self.group = group

    def all_reduce(self, t: torch.Tensor, group=None) -> torch.Tensor:
        """Sum ``t`` over the group in place (and return it)."""
        dist.all_reduce(t, group=self.group if self.group is not None else group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (all ranks' shapes equal)."""
        group = self.group if self.group is not None else group
        n, t = dist.get_world_size(group), t.contiguous()
        if dist.get_backend(group) == "nccl":  # one flat buffer: NCCL's native all-gather
            out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t, group=group)
            parts = out.chunk(n, dim=0)
        else:
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=dim)
