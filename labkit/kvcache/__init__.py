"""KV-cache management: the contiguous baseline, the paged cache, prefix sharing, quantised KV and swap space.
Scheduling and preemption live in ``labkit.engine``; this package holds the memory they manage and keeps no
sequences: a sequence (``engine.Sequence``, or ``SeqBlocks`` here) owns its tokens, blocks and computed count.

* ``ContiguousKVCache`` (contiguous.py): one ``max_len`` slab per sequence, the naive baseline
* ``BlockAllocator`` (block_allocator.py): block ids, LRU free queue, reference counts, prefix-hash registry
* ``BlockManager`` (block_manager.py): blocks for sequences (``KVSequence``), prefix caching, copy on write
* ``PagedKVCache`` (paged.py): the block manager with per-layer pools; ``allocate_pools=False`` keeps the
  bookkeeping without tensors (the request-mix simulation)
* prefix.py: chained block hashes for prefix caching; quant.py: int8 / fp8 KV with per-token-head scales
* ``SwapSpace`` (swap.py): CPU memory for the blocks of sequences preempted by swap
* attention.py: the torch reference of paged attention (prefill chunks and decode) and the decode dispatch to
  the Triton kernel on CUDA; ``dequantised_blocks`` for int8/fp8 caches
* metrics.py: what a cache holds vs reserves (``KVCacheStats``)

    from labkit.kvcache import PagedKVCache, SeqBlocks
    cache = PagedKVCache.for_model(model, num_blocks=256, block_size=16)
    seq = SeqBlocks(prompt_ids)
    cache.allocate(seq)                             # its blocks; returns the tokens found in the prefix cache
"""

from labkit.kvcache.attention import (
    decode_attention,
    dequantised_blocks,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError
from labkit.kvcache.block_manager import BlockManager, KVSequence, SeqBlocks
from labkit.kvcache.contiguous import ContiguousKVCache
from labkit.kvcache.metrics import KVCacheStats
from labkit.kvcache.paged import PagedKVCache
from labkit.kvcache.prefix import block_hashes, hash_block
from labkit.kvcache.quant import KV_FORMATS, KVFormat, dequantize_kv, kv_format, quantize_kv
from labkit.kvcache.swap import SwapSpace

__all__ = ["BlockAllocator", "BlockManager", "CacheFullError", "ContiguousKVCache", "KVCacheStats", "KVSequence",
           "PagedKVCache", "SeqBlocks",
           "SwapSpace", "KV_FORMATS", "KVFormat", "kv_format", "quantize_kv", "dequantize_kv", "block_hashes",
           "hash_block", "decode_attention", "paged_decode_attention_ref", "paged_prefill_attention_ref",
           "dequantised_blocks"]
