"""KV-cache management: the contiguous baseline, the paged cache, prefix sharing, quantised KV and preemption.

* ``ContiguousKVCache`` (contiguous.py): one ``max_len`` slab per sequence, the naive baseline
* ``BlockAllocator`` (block_allocator.py): block ids, LRU free queue, reference counts, prefix-hash registry
* ``PagedKVCache`` (paged.py): per-layer block pools, block tables, slot mappings, fork with copy on write
* prefix.py: chained block hashes for prefix caching; quant.py: int8 / fp8 KV with per-token-head scales
* attention.py: attention over the paged cache (torch references; the Triton decode kernel on CUDA)
* ``PagedModelRunner``, ``StepBatch``, ``prepare_step`` (model.py): an HF Llama's modules run over a flat token
  batch on the paged cache, prefill chunks and decode alike
* ``Scheduler``, ``PagedGenerator`` (preemption.py): FCFS continuous batching that preempts by recompute or swap
  (``SwapSpace``, swap.py), and greedy generation on top of it
* simulate.py: request mixes and the memory-budget simulation; metrics.py: what a cache holds vs reserves;
  quant_eval.py: accuracy, memory and latency of the KV formats

model.py, preemption.py and quant_eval.py import the Triton kernels; import them from their modules.
"""

from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError
from labkit.kvcache.contiguous import ContiguousKVCache
from labkit.kvcache.metrics import KVCacheStats
from labkit.kvcache.paged import PagedKVCache
from labkit.kvcache.quant import KV_FORMATS, kv_format

__all__ = ["BlockAllocator", "CacheFullError", "ContiguousKVCache", "KVCacheStats", "PagedKVCache",
           "KV_FORMATS", "kv_format"]
