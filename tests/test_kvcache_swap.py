"""SwapSpace: blocks copied to CPU memory and back are bit-identical, for every KV format; while swapped out a
sequence's block table names swap-space blocks, and its computed count and prefix hashes stay."""

import pytest
import torch

from labkit.kvcache import CacheFullError, PagedKVCache, SeqBlocks
from labkit.kvcache.swap import SwapSpace


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8"])
def test_swap_roundtrip_is_exact(kv_dtype):
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(2, 2, 8, num_blocks=6, block_size=3, kv_dtype=kv_dtype, enable_prefix_caching=True)
    a = SeqBlocks(list(range(7)), "a")
    cache.allocate(a)
    slots = torch.tensor(cache.slots(a, 0, 7))
    for layer in range(2):
        cache.write(layer, slots, torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g))
    cache.mark_computed(a, 7)
    before = [cache.gather(a, layer) for layer in range(2)]
    hashes = list(a.block_hashes)
    swap = SwapSpace(cache, num_blocks=4)
    swap.swap_out(cache, a)
    assert cache.allocator.num_free == 6 and swap.allocator.num_free == 1 and len(a.block_table) == 3
    assert a.num_computed == 7 and a.block_hashes == hashes
    other = SeqBlocks(list(range(100, 109)), "other")
    cache.allocate(other)  # the freed blocks are reused meanwhile
    cache.write(0, torch.tensor(cache.slots(other, 0, 9)), torch.randn(9, 2, 8), torch.randn(9, 2, 8))
    cache.free(other)
    swap.swap_in(cache, a)
    for layer in range(2):
        for x, y in zip(cache.gather(a, layer), before[layer], strict=True):
            assert torch.equal(x, y)
    assert swap.allocator.num_free == 4 and a.num_computed == 7
    assert cache.allocate(SeqBlocks(list(range(7)), "b")) == 6  # its full blocks are findable again
    with pytest.raises(CacheFullError):
        SwapSpace(cache, num_blocks=2).swap_out(cache, a)


def test_discard_drops_swapped_blocks():
    cache = PagedKVCache(1, 1, 4, num_blocks=4, block_size=2)
    a = SeqBlocks([1, 2, 3], "a")
    cache.allocate(a)
    swap = SwapSpace(cache, num_blocks=3)
    swap.swap_out(cache, a)
    swap.discard(a)  # an aborted or failed request: its swapped blocks come back to the swap space
    assert swap.allocator.num_free == 3 and not a.block_table and a.num_computed == 0
    with pytest.raises(ValueError, match="sequence 'a' holds no swapped-out blocks"):
        swap.discard(a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_swap_roundtrip_on_cuda(kv_dtype):
    cache = PagedKVCache(1, 2, 64, num_blocks=4, block_size=8, kv_dtype=kv_dtype, device="cuda")
    a = SeqBlocks(list(range(13)), "a")
    cache.allocate(a)
    k, v = torch.randn(2, 13, 2, 64, device="cuda")
    cache.write(0, torch.tensor(cache.slots(a, 0, 13), device="cuda"), k, v)
    cache.mark_computed(a, 13)
    before = cache.gather(a, 0)
    swap = SwapSpace(cache, num_blocks=4)
    assert swap.pools[0][0].is_pinned()
    swap.swap_out(cache, a)
    x = SeqBlocks(list(range(32)), "x")
    cache.allocate(x)  # every block reused meanwhile
    cache.write(0, torch.tensor(cache.slots(x, 0, 32), device="cuda"), *torch.randn(2, 32, 2, 64, device="cuda"))
    cache.free(x)
    swap.swap_in(cache, a)
    for x, y in zip(cache.gather(a, 0), before, strict=True):
        assert torch.equal(x, y)
