"""KV-cache management: the contiguous baseline, the paged cache, prefix sharing, quantised KV and preemption.

* ``ContiguousKVCache`` (contiguous.py): one ``max_len`` slab per sequence, the naive baseline
* ``BlockAllocator`` (block_allocator.py): block ids, free queue, reference counts, prefix-hash registry
* ``PagedKVCache`` (paged.py): per-layer block pools, block tables, slot mappings, fork with copy on write
* prefix.py: chained block hashes for prefix caching; quant.py: int8 / fp8 KV with per-token-head scales
* ``PagedModelRunner`` (model.py): an HF Llama's modules run over a flat token batch on the paged cache
* preemption.py: a greedy generation loop over many requests that preempts by recompute or swap
* simulate.py: request mixes and the memory-budget simulation; metrics.py: what a cache holds vs reserves
"""

from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError
from labkit.kvcache.contiguous import ContiguousKVCache
from labkit.kvcache.metrics import KVCacheStats
from labkit.kvcache.paged import PagedKVCache
from labkit.kvcache.quant import KV_FORMATS, kv_format

__all__ = ["BlockAllocator", "CacheFullError", "ContiguousKVCache", "KVCacheStats", "PagedKVCache",
           "KV_FORMATS", "kv_format"]
