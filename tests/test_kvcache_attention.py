"""Attention over the paged cache: the prefill/chunk reference against dense causal attention in float64,
decode dispatch, the dequantise-on-read view, and the Triton kernel."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.paged_attention import paged_attention_ref
from labkit.kvcache import PagedKVCache, SeqBlocks
from labkit.kvcache.attention import (
    decode_attention,
    dequantised_blocks,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from labkit.kvcache.quant import dequantize_kv, quantize_kv


def _filled_cache(lens, kv_heads, d, block_size, seed, kv_dtype="fp32", device="cpu"):
    """A cache whose sequences hold random K/V (also returned, contiguous, in float32 for the reference), and the
    sequences."""
    g = torch.Generator().manual_seed(seed)
    total = sum(-(-n // block_size) for n in lens)
    cache = PagedKVCache(1, kv_heads, d, num_blocks=total + 3, block_size=block_size, kv_dtype=kv_dtype,
                         device=device)
    if not cache.fmt.quantised:
        for t in cache.k_caches + cache.v_caches:
            t.fill_(float("nan"))
    cache.allocator.allocate(3)  # so sequences do not start at block 0
    kvs, seqs = [], [SeqBlocks([0] * n, sid) for sid, n in enumerate(lens)]
    for seq, n in zip(seqs, lens):
        cache.allocate(seq)
        k, v = torch.randn(2, n, kv_heads, d, generator=g)
        cache.write(0, torch.tensor(cache.slots(seq, 0, n)), k.to(device), v.to(device))
        kvs.append((k, v))
    return cache, kvs, seqs


def _dense_causal(q, k, v, n_new):
    """float64 attention of the last ``n_new`` positions of a sequence over its K/V ``[n, kv, d]``."""
    n, kv, d = k.shape
    group = q.shape[1] // kv
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) / d ** 0.5
    pos = torch.arange(n - n_new, n)
    s = s.masked_fill(torch.arange(n)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_prefill_chunks_over_cached_prefix_match_dense_causal(block_size):
    lens, new = [1, 9, 40, 17], [1, 9, 13, 5]  # sequence 2 and 3: a chunk after a cached prefix
    cache, kvs, seqs = _filled_cache(lens, 2, 20, block_size, seed=block_size)
    g = torch.Generator().manual_seed(100 + block_size)
    q = torch.randn(sum(new), 6, 20, generator=g)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    ids = list(range(len(lens)))
    out = paged_prefill_attention_ref(q, cache.k_caches[0], cache.v_caches[0], cache.block_tables(seqs), qsl,
                                      cache.context_lens(seqs))
    ref = torch.cat([_dense_causal(q[qsl[s]:qsl[s + 1]], *kvs[s], new[s]) for s in ids])
    assert relative_error(out, ref) <= 1e-5


def test_decode_is_the_one_query_case_of_prefill():
    lens = [5, 1, 23]
    cache, _, seqs = _filled_cache(lens, 1, 16, 4, seed=3)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(4))
    args = (cache.k_caches[0], cache.v_caches[0], cache.block_tables(seqs))
    a = decode_attention(q, *args, cache.context_lens(seqs), backend="torch")
    b = paged_prefill_attention_ref(q, *args, torch.arange(4, dtype=torch.int32), cache.context_lens(seqs))
    assert relative_error(a, b) <= 1e-6


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_dequantised_view_reads_what_was_quantised(kv_dtype):
    lens = [6, 19]
    cache, kvs, seqs = _filled_cache(lens, 2, 8, 4, seed=5, kv_dtype=kv_dtype)
    ids = [0, 1]
    k, v, tables = dequantised_blocks(cache, 0, cache.block_tables(seqs), torch.float32)
    assert k.shape[0] <= cache.num_blocks and tables.dtype == torch.int32
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(6))
    out = decode_attention(q, k, v, tables, cache.context_lens(seqs), backend="torch")
    # reference: quantise-dequantise the contiguous K/V the same way, attend densely
    ref = []
    for s in ids:
        kd, vd = (dequantize_kv(*quantize_kv(x, cache.fmt), torch.float32) for x in kvs[s])
        ref.append(_dense_causal(q[s:s + 1], kd, vd, 1))
    assert relative_error(out, torch.cat(ref)) <= 1e-5


def test_backend_arguments():
    cache, _, seqs = _filled_cache([3], 1, 4, 2, seed=7)
    args = (torch.randn(1, 1, 4), cache.k_caches[0], cache.v_caches[0], cache.block_tables(seqs),
            cache.context_lens(seqs))
    with pytest.raises(ValueError, match="backend='cuda' is unknown; allowed"):
        decode_attention(*args, backend="cuda")


def test_triton_kernel_matches_reference():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs it through Triton's interpreter
    cache, _, seqs = _filled_cache([1, 17, 40], 2, 32, 16, seed=8, device=device)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(9)).to(device)
    args = (q, cache.k_caches[0], cache.v_caches[0], cache.block_tables(seqs), cache.context_lens(seqs))
    out, ref = decode_attention(*args, backend="triton"), decode_attention(*args, backend="torch")
    assert relative_error(out, ref) <= 1e-5  # float32 (the kernel keeps fp32 dots exact)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_decode_with_scales_matches_dequantise_first(kv_dtype):
    cache, _, seqs = _filled_cache([7, 30], 2, 32, 8, seed=10, kv_dtype=kv_dtype)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(11))
    tables, lens = cache.block_tables(seqs), cache.context_lens(seqs)
    k, v, t = dequantised_blocks(cache, 0, tables, torch.float32)
    ref = decode_attention(q, k, v, t, lens, backend="torch")
    scales = {"k_scale": cache.k_scales[0], "v_scale": cache.v_scales[0]}
    out = decode_attention(q, cache.k_caches[0], cache.v_caches[0], tables, lens, backend="torch", **scales)
    assert relative_error(out, ref) <= 1e-6
    tri = decode_attention(q, cache.k_caches[0], cache.v_caches[0], tables, lens, backend="triton", **scales)
    assert relative_error(tri, ref) <= 1e-5
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        decode_attention(q, cache.k_caches[0], cache.v_caches[0], tables, lens, k_scale=scales["k_scale"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_reference_matches_the_kernels_loop_reference(dtype):
    g = torch.Generator().manual_seed(7)
    num_blocks, bs, kvh, d, heads = 23, 5, 3, 24, 6
    k = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    k[0], v[0] = float("nan"), float("nan")  # a block no sequence uses: never read
    q = torch.randn(4, heads, d, generator=g).to(dtype)
    ctx = torch.tensor([1, 13, 5, 22], dtype=torch.int32)
    tables = (torch.randperm(num_blocks - 1, generator=g)[:20] + 1).view(4, 5).int()
    tables[0, 1:] = 0  # padding entries past a sequence's blocks
    out = torch.full_like(q, float("nan"))
    out[:] = paged_decode_attention_ref(q, k, v, tables, ctx, 0.3)
    ref = paged_attention_ref(q, k, v, tables, ctx, scale=0.3)
    assert relative_error(out.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)
