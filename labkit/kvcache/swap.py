"""Swap space: CPU memory that holds the blocks of preempted sequences until they come back.

Swapping copies a sequence's blocks (every layer; scales too for int8/fp8) to CPU memory and frees them on the
device; swapping in copies them into fresh blocks, so the sequence continues with exactly the bytes it had. The
price is traffic over PCIe both ways instead of recomputation. Shared blocks are copied like private ones: after
swap-in a sequence owns private copies (correct, if less frugal than its old sharing).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from labkit.kvcache.block_allocator import BlockAllocator
from labkit.kvcache.paged import PagedKVCache, SeqBlocks, raw


class SwapSpace:
    """CPU memory for blocks swapped out of a ``PagedKVCache``: pools of the same block shape (pinned when the
    cache is on CUDA, so copies are asynchronous-capable DMA) with their own allocator."""

    def __init__(self, cache: PagedKVCache, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        pin = cache.device.type == "cuda"
        self.pools = [[torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in pools]
                      for pools in (cache.k_caches, cache.v_caches, cache.k_scales, cache.v_scales)]
        self.seqs: dict[Hashable, SeqBlocks] = {}
        self.blocks_out = 0  # blocks copied device -> CPU so far
        self.blocks_in = 0

    def can_swap_out(self, cache: PagedKVCache, seq_id: Hashable) -> bool:
        return len(cache.seq(seq_id).block_table) <= self.allocator.num_free

    def swap_out(self, cache: PagedKVCache, seq_id: Hashable) -> None:
        """Copy a sequence's blocks to CPU memory and release them in the cache."""
        seq = cache.seq(seq_id)
        cpu_blocks = self.allocator.allocate(len(seq.block_table))
        src = torch.tensor(seq.block_table, device=cache.device)
        dst = torch.tensor(cpu_blocks)
        for cpu_pools, dev_pools in zip(self.pools, (cache.k_caches, cache.v_caches, cache.k_scales,
                                                     cache.v_scales), strict=True):
            for cpu, dev in zip(cpu_pools, dev_pools, strict=True):
                raw(cpu)[dst] = raw(dev)[src].cpu()
        self.seqs[seq_id] = SeqBlocks(cpu_blocks, list(seq.token_ids), seq.num_computed)
        self.blocks_out += len(cpu_blocks)
        cache.free(seq_id)

    def discard(self, seq_id: Hashable) -> None:
        """Drop a swapped-out sequence's blocks without copying them back (it was aborted or failed)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"seq_id={seq_id!r} is not swapped out")
        for b in seq.block_table:
            self.allocator.free(b)

    def blocks_to_swap_in(self, seq_id: Hashable) -> int:
        return len(self.seqs[seq_id].block_table)

    def swap_in(self, cache: PagedKVCache, seq_id: Hashable) -> None:
        """Copy a swapped sequence back into fresh blocks of the cache (``CacheFullError`` if too few are
        free)."""
        seq = self.seqs[seq_id]
        if seq_id in cache.seqs:
            raise ValueError(f"seq_id={seq_id!r} is already in the cache")
        dev_blocks = cache.allocator.allocate(len(seq.block_table))
        src = torch.tensor(seq.block_table)
        dst = torch.tensor(dev_blocks, device=cache.device)
        for cpu_pools, dev_pools in zip(self.pools, (cache.k_caches, cache.v_caches, cache.k_scales,
                                                     cache.v_scales), strict=True):
            for cpu, dev in zip(cpu_pools, dev_pools, strict=True):
                raw(dev)[dst] = raw(cpu)[src].to(cache.device)
        del self.seqs[seq_id]
        for b in seq.block_table:
            self.allocator.free(b)
        self.blocks_in += len(dev_blocks)
        cache.seqs[seq_id] = SeqBlocks(dev_blocks, seq.token_ids, 0)
        cache.mark_computed(seq_id, seq.num_computed)  # re-registers its full blocks with the prefix cache
