"""Swap space: CPU memory that holds the blocks of preempted sequences until they come back.

Swapping copies a sequence's blocks (every layer; scales too) to CPU memory and frees them on the device (its
``block_table`` then names swap-space blocks); swapping in copies them into fresh device blocks, so it continues with
exactly the bytes it had, for PCIe traffic both ways instead of recomputation. Shared blocks come back private.
"""

from __future__ import annotations

import torch

from labkit.kvcache.block_allocator import BlockAllocator
from labkit.kvcache.paged import KVSequence, PagedKVCache, raw


class SwapSpace:
    """CPU memory for blocks swapped out of a ``PagedKVCache``: pools of the same block shape (pinned when the
    cache is on CUDA, so copies are asynchronous-capable DMA) with their own allocator."""

    def __init__(self, cache: PagedKVCache, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        pin = cache.device.type == "cuda"
        self.pools = [[torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in pools]
                      for pools in (cache.k_caches, cache.v_caches, cache.k_scales, cache.v_scales)]
        self.blocks_out = 0  # blocks copied device -> CPU so far
        self.blocks_in = 0

    def can_swap_out(self, seq: KVSequence) -> bool:
        return len(seq.block_table) <= self.allocator.num_free

    def _copy(self, cache: PagedKVCache, src: list[int], dst: list[int], out: bool) -> None:
        """Blocks ``src`` to ``dst``, device -> CPU (``out``) or back, every pool."""
        s = torch.tensor(src, device=cache.device if out else "cpu")
        d = torch.tensor(dst, device="cpu" if out else cache.device)
        for cpu_pools, dev_pools in zip(self.pools, (cache.k_caches, cache.v_caches, cache.k_scales,
                                                     cache.v_scales), strict=True):
            for cpu, dev in zip(cpu_pools, dev_pools, strict=True):
                if out:
                    raw(cpu)[d] = raw(dev)[s].cpu()
                else:
                    raw(dev)[d] = raw(cpu)[s].to(cache.device)

    def swap_out(self, cache: PagedKVCache, seq: KVSequence) -> None:
        """Copy ``seq``'s blocks to CPU memory and release them in the cache; its ``block_table`` then names blocks
        of the swap space (``CacheFullError`` if too few are free)."""
        cpu_blocks = self.allocator.allocate(len(seq.block_table))
        self._copy(cache, seq.block_table, cpu_blocks, out=True)
        for b in reversed(seq.block_table):
            cache.allocator.free(b)
        seq.block_table = cpu_blocks
        self.blocks_out += len(cpu_blocks)

    def discard(self, seq: KVSequence) -> None:
        """Drop a swapped-out sequence's blocks without copying them back (it was aborted or failed): it then holds
        no blocks and nothing computed."""
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} holds no swapped-out blocks")
        for b in seq.block_table:
            self.allocator.free(b)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def swap_in(self, cache: PagedKVCache, seq: KVSequence) -> None:
        """Copy a swapped-out ``seq`` back into fresh blocks of the cache (``CacheFullError`` if too few are free);
        its full computed blocks are findable by the prefix cache again."""
        dev_blocks = cache.allocator.allocate(len(seq.block_table))
        self._copy(cache, seq.block_table, dev_blocks, out=False)
        for b in seq.block_table:
            self.allocator.free(b)
        seq.block_table = dev_blocks
        self.blocks_in += len(dev_blocks)
        for b, h in zip(dev_blocks, seq.block_hashes):
            cache.allocator.register_hash(b, h)
