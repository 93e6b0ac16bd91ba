"""Paged decode attention (single pass and split-context) against ``paged_attention_ref``."""

import pytest
import torch
import triton
import triton.language as tl

from labkit.evaluate import relative_error
from labkit.kernels.paged_attention import auto_num_splits, paged_attention, paged_attention_ref
from labkit.kernels.quantized_matmul.ptx import kv_as_16bit

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA


def _case(num_seqs, heads, kv_heads, head_dim, block_size, lens, num_blocks, dtype, seed, device=DEVICE):
    """Random q and caches, and block tables that scatter each sequence over shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one spare column of garbage entries
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    return [t.to(dtype).to(device) for t in (q, k, v)] + [tables.int().to(device), ctx]


def _quantised_kv(k, v, kv_dtype):
    """``k``, ``v`` and the ``paged_attention`` scale arguments: as given (``kv_dtype`` None) or quantised."""
    if not kv_dtype:
        return k, v, {}
    from labkit.kvcache.quant import kv_format, quantize_kv

    (k, ks), (v, vs) = quantize_kv(k, kv_format(kv_dtype)), quantize_kv(v, kv_format(kv_dtype))
    return k, v, dict(k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,lens", [
    (4, 2, 64, 16, [1, 37, 300]),   # GQA, a one-token context, partial last blocks
    (6, 6, 48, 8, [129, 5]),        # MHA, head_dim not a power of two
])
def test_paged_attention(dtype, num_splits, heads, kv_heads, head_dim, block_size, lens):
    q, k, v, tables, ctx = _case(len(lens), heads, kv_heads, head_dim, block_size, lens, 80, dtype,
                                 seed=len(lens))
    out = torch.full_like(q, float("nan"))
    out.copy_(paged_attention(q, k, v, tables, ctx, num_splits=num_splits))
    ref = paged_attention_ref(q.double(), k.double(), v.double(), tables, ctx)
    assert relative_error(out, ref) < TOL[dtype]


def test_split_context_merges_exactly():
    q, k, v, tables, ctx = _case(2, 4, 1, 32, 16, [500, 260], 80, torch.float32, seed=3)
    one = paged_attention(q, k, v, tables, ctx, num_splits=1)
    split = paged_attention(q, k, v, tables, ctx, num_splits=4)
    assert relative_error(split, one) < 1e-6
    assert relative_error(split, paged_attention_ref(q, k, v, tables, ctx, scale=None)) < 1e-5


@pytest.mark.parametrize("num_splits", [5, 16])
def test_ranges_follow_each_context_not_the_table_width(num_splits):
    """A CUDA-graph step's tables are max_model_len wide: each sequence's ranges are cut from its own length
    (some of the 16 ranges hold no token; a one-token context has one non-empty range)."""
    lens = [1, 37, 300]
    q, k, v, _, ctx = _case(3, 4, 2, 32, 8, lens, 200, torch.float32, seed=6)
    g = torch.Generator().manual_seed(7)
    tables = torch.randperm(200, generator=g)[:3 * 64].view(3, 64).int().to(DEVICE)  # 512 slots per row
    out = paged_attention(q, k, v, tables, ctx, num_splits=num_splits)
    assert relative_error(out, paged_attention_ref(q.double(), k.double(), v.double(), tables, ctx)) < 1e-5


def test_scale_and_auto_splits():
    q, k, v, tables, ctx = _case(2, 2, 2, 16, 16, [40, 17], 10, torch.float32, seed=4)
    out = paged_attention(q, k, v, tables, ctx, scale=0.3)
    assert relative_error(out, paged_attention_ref(q, k, v, tables, ctx, scale=0.3)) < 1e-5
    assert auto_num_splits(32, 8, 4096, torch.device("cpu")) == 1       # plenty of programs already
    assert auto_num_splits(1, 8, 65536, torch.device("cpu")) == 2       # one sequence: split its context
    assert auto_num_splits(1, 1, 600, torch.device("cpu")) == 16        # short contexts split too
    assert auto_num_splits(1, 1, 100, torch.device("cpu")) == 6         # ranges of >= 16 tokens
    assert auto_num_splits(1, 1, 31, torch.device("cpu")) == 1
    assert auto_num_splits(1, 1, 100, torch.device("cpu"), min_split_tokens=64) == 1  # the policy before 16
    with pytest.raises(ValueError, match="min_split_tokens=0"):
        auto_num_splits(1, 1, 100, torch.device("cpu"), min_split_tokens=0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_quantised_cache_is_dequantised_in_registers(kv_dtype, num_splits):
    """int8/fp8 caches in labkit.kvcache.quant's format (one float32 scale per token and KV head)."""
    from labkit.kvcache.quant import dequantize_kv, kv_format, quantize_kv

    q, k, v, tables, ctx = _case(3, 4, 2, 64, 16, [1, 77, 150], 40, torch.float32, seed=8)
    (kq, ks), (vq, vs) = quantize_kv(k, kv_format(kv_dtype)), quantize_kv(v, kv_format(kv_dtype))
    out = paged_attention(q, kq, vq, tables, ctx, num_splits=num_splits, k_scale=ks, v_scale=vs)
    ref = paged_attention_ref(q.double(), dequantize_kv(kq, ks, torch.float64),
                              dequantize_kv(vq, vs, torch.float64), tables, ctx)
    assert relative_error(out, ref) < 1e-5
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention(q, kq, vq, tables, ctx)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_cache_with_16_bit_queries(kv_dtype):
    """16-bit queries multiply 8-bit K/V as float16 Tensor Core operands: int8 read through its bits (1024 + x +
    128 as a float16, minus 1152; on CUDA the PRMT/LOP3/HSUB2 sequence, here the same steps in Triton operations),
    every int8 value from -127 to 127 exact. The reference dequantises in float64."""
    from labkit.kvcache.quant import dequantize_kv

    q, k, v, tables, ctx = _case(3, 4, 2, 64, 16, [1, 77, 150], 40, torch.float32, seed=9)
    k[0, 0, 0, :] = torch.linspace(-4, 4, 64)  # a row whose int8 codes run -127 .. 127
    kq, vq, scales = _quantised_kv(k, v, kv_dtype)
    ref = paged_attention_ref(q.double(), dequantize_kv(kq, scales["k_scale"], torch.float64),
                              dequantize_kv(vq, scales["v_scale"], torch.float64), tables, ctx)
    for splits in (1, 2):
        out = paged_attention(q.half(), kq, vq, tables, ctx, num_splits=splits, **scales)
        assert out.dtype == torch.float16
        assert relative_error(out, ref) < 2e-3, splits


@triton.jit
def _int8_to_f16(src, dst, PTX: tl.constexpr):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(dst + offs, kv_as_16bit(tl.load(src + offs), tl.float16, PTX))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_int8_bytes_read_as_float16_exactly(device):
    """``kv_as_16bit``'s int8 -> float16 bit steps (inline PTX on CUDA, Triton operations under the interpreter) give
    every one of the 256 codes exactly, in place (4 bytes a word: the PRMT byte order)."""
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).roll(37).to(device)
    out = torch.empty(256, dtype=torch.float16, device=device)
    _int8_to_f16[(1,)](codes, out, PTX=device == "cuda")
    assert torch.equal(out, codes.half())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, None])
def test_quantised_cache_gpu(kv_dtype, dtype, num_splits):
    """The compiled int8 (inline PTX) and fp8 paths at the engine's head shape against the dequantised
    reference."""
    from labkit.kvcache.quant import dequantize_kv

    lens = [1, 100, 4096, 2000, 17]
    q, k, v, tables, ctx = _case(5, 32, 8, 128, 16, lens, 1400, torch.float32, seed=16, device="cuda")
    k, v, scales = _quantised_kv(k, v, kv_dtype)
    ref = paged_attention_ref(q.double(), dequantize_kv(k, scales["k_scale"], torch.float64),
                              dequantize_kv(v, scales["v_scale"], torch.float64), tables, ctx)
    out = paged_attention(q.to(dtype), k, v, tables, ctx, num_splits=num_splits, **scales)
    assert relative_error(out, ref) < TOL[dtype]


def test_bad_inputs():
    q, k, v, tables, ctx = _case(2, 4, 2, 16, 16, [40, 17], 10, torch.float32, seed=5)
    with pytest.raises(ValueError, match="block_tables has dtype int64"):
        paged_attention(q, k, v, tables.long(), ctx)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention(q[:, :3], k, v, tables, ctx)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_attention(q, k, v, tables[:1], ctx)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(q, k, v, tables, ctx, num_splits=0)
    with pytest.raises(ValueError, match="pdl='wait' is unknown; allowed"):
        paged_attention(q, k, v, tables, ctx, pdl="wait")
    with pytest.raises(ValueError, match="pdl='overlap' is unknown; allowed"):  # never a dependent launch itself
        paged_attention(q, k, v, tables, ctx, pdl="overlap")


def test_block_tables_and_context_lens_are_checked_on_the_host():
    """Out-of-range indices used to read out of bounds (a crash or garbage); now a clear error before the launch,
    unless ``check=False`` (the engine, which checked the step; a captured graph never checks)."""
    q, k, v, tables, ctx = _case(2, 4, 2, 16, 16, [40, 17], 10, torch.float32, seed=5)  # tables 4 blocks wide
    with pytest.raises(ValueError, match=r"context_lens\[1\]=65 must be in 1 \.\. 64"):
        paged_attention(q, k, v, tables, torch.tensor([40, 65], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"context_lens\[0\]=0 must be in 1 \.\. 64"):
        paged_attention(q, k, v, tables, torch.tensor([0, 17], dtype=torch.int32, device=DEVICE))
    for bad in (10, -1):
        t = tables.clone()
        t[1, 1] = bad  # the second block of a 17-token context: read
        with pytest.raises(ValueError, match=rf"block_tables\[1\] holds block id {bad}; allowed: 0 \.\. 9"):
            paged_attention(q, k, v, t, ctx)
    t = tables.clone()
    t[1, 3] = 99  # past the context: never read, so allowed (padding columns)
    ref = paged_attention(q, k, v, tables, ctx)
    assert torch.equal(paged_attention(q, k, v, t, ctx), ref)
    assert torch.equal(paged_attention(q, k, v, tables, ctx, check=False), ref)


def test_releasing_the_next_launch_changes_nothing():
    """``pdl="release"`` (on sm_90: the split kernel releases the next launch as it starts, the merge kernel is a
    programmatic dependent launch that waits for the partials): the same bits as a plain call, split or not."""
    q, k, v, tables, ctx = _case(2, 4, 2, 16, 16, [40, 17], 10, torch.float32, seed=6)
    for splits in (1, 3):
        plain = paged_attention(q, k, v, tables, ctx, num_splits=splits)
        assert torch.equal(paged_attention(q, k, v, tables, ctx, num_splits=splits, pdl="release"), plain)


def test_short_ranges_get_one_tile_each():
    """Ranges of at most 64 tokens take the smallest tile that holds one (not the autotuner's pick); longer ones
    are left to the autotuner."""
    from labkit.kernels.paged_attention import short_range_tile

    assert short_range_tile(528, 33) == dict(BLOCK_N=16, num_warps=4, num_stages=1)  # notebook 04's engine step
    assert short_range_tile(2064, 33)["BLOCK_N"] == 64
    assert short_range_tile(100, 6)["BLOCK_N"] == 32
    assert short_range_tile(40, 8)["BLOCK_N"] == 16
    assert short_range_tile(8192, 64) is None and short_range_tile(4096, 3) is None


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_ranges_of_one_tile(kv_dtype):
    """Where every range of the table fits one tile, the split kernel reads the block table without waiting for
    the context length (``ONE_TILE``): the reference's output and the single-pass kernel's, empty ranges and
    one-token contexts included."""
    import labkit.kernels.paged_attention as pa

    q, k, v, tables, ctx = _case(3, 6, 2, 16, 8, [1, 33, 70], 30, torch.float32, seed=15)  # an 80-token table
    k, v, scales = _quantised_kv(k, v, kv_dtype)
    one = paged_attention(q, k, v, tables, ctx, num_splits=1, **scales)
    for splits in (3, 5, 16):
        assert pa._one_tile(True, 80, splits, pa.CPU_BLOCK_N)
        out = paged_attention(q, k, v, tables, ctx, num_splits=splits, **scales)
        assert relative_error(out, one) < 1e-6, splits
        if not kv_dtype:
            assert relative_error(out, paged_attention_ref(q.double(), k.double(), v.double(), tables, ctx)) < 1e-5
    assert not pa._one_tile(True, 80, 2, pa.CPU_BLOCK_N)  # 40-token ranges: two tiles each
    assert not pa._one_tile(False, 80, 1, pa.CPU_BLOCK_N)  # one pass: no ranges


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bfloat16 refusal")
def test_bf16_is_refused_on_the_cpu():
    q, k, v, tables, ctx = _case(2, 4, 2, 16, 16, [40, 17], 10, torch.float32, seed=5)
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, None])
def test_paged_attention_gpu(dtype, num_splits):
    lens = [1, 100, 4096, 2000, 17]
    q, k, v, tables, ctx = _case(5, 32, 8, 128, 16, lens, 1400, dtype, seed=6, device="cuda")
    out = paged_attention(q, k, v, tables, ctx, num_splits=num_splits)
    ref = paged_attention_ref(q, k, v, tables, ctx)
    assert relative_error(out, ref) < TOL[dtype]


@pytest.mark.gpu
def test_split_attention_replays_in_a_cuda_graph():
    """Many ranges at once on the GPU, with the merge kernel a dependent launch (``pdl="release"``) or not: graph
    replays give the eager call's bits."""
    lens = [1, 100, 4096, 2000, 17, 513]
    q, k, v, tables, ctx = _case(6, 32, 8, 128, 16, lens, 1600, torch.bfloat16, seed=13, device="cuda")
    for pdl in ("", "release"):
        eager = paged_attention(q, k, v, tables, ctx, num_splits=33, pdl=pdl)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_attention(q, k, v, tables, ctx, num_splits=33, pdl=pdl)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), pdl


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [513, 2049])
def test_short_range_tiles_on_the_gpu(ctx):
    """A decode step's shape at batch 1 (a table as wide as the context): ranges of at most 64 tokens take
    ``short_range_tile`` (16- and 64-token tiles here): the reference's output."""
    from labkit.kernels.paged_attention import auto_num_splits, short_range_tile

    width = -(-ctx // 16)
    q, k, v, _, lens = _case(1, 32, 8, 128, 16, [ctx], width + 3, torch.bfloat16, seed=14, device="cuda")
    tables = torch.arange(width, device="cuda", dtype=torch.int32)[None]
    splits = auto_num_splits(1, 8, width * 16, q.device)
    assert short_range_tile(width * 16, splits) is not None
    out = paged_attention(q, k, v, tables, lens)
    assert relative_error(out, paged_attention_ref(q, k, v, tables, lens)) < TOL[torch.bfloat16]
