"""W8A16 and W4A16 matmuls against dequantise-then-matmul references: the split-K GEMVs, the GEMMs, the formats
they read and the tuning tables' rules. (The stationary GEMVs and what they take in:
test_kernels_quantized_matmul_stationary.py.)"""

from dataclasses import replace

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.quantized_matmul import (
    HOPPER,
    INTERPRETER,
    SplitKTile,
    StationaryTile,
    dequantize_int4,
    pack_int4,
    splitk,
    stationary_plan,
    tuning_for,
    w4a16_matmul,
    w4a16_matmul_ref,
    w8a16_matmul,
    w8a16_matmul_ref,
)
from labkit.kernels.quantized_matmul import matmul as qmm

# the weights are exactly representable; what remains is the activations' dtype and accumulation order
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA


def _int8(n, k, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q, s = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.01 + 1e-3
    return q.to(device), s.to(device)


def _int4(n, k, group, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    packed = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zeros = torch.rand(n, k // group, generator=g) * 15
    return packed.to(device), scales.to(device), zeros.to(device)


def _x(shape, dtype, seed, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_shape", [(1, 192), (37, 192), (2, 3, 192)])  # GEMV, GEMM, leading dims
def test_w8a16(dtype, x_shape):
    q, s = _int8(100, 192, seed=1)
    x = _x(x_shape, dtype, seed=2)
    out = w8a16_matmul(x, q, s)
    assert out.shape == (*x_shape[:-1], 100) and out.dtype == dtype
    assert relative_error(out, w8a16_matmul_ref(x.double(), q, s)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("group", [64, 32, 6])  # power-of-two fast path and an arbitrary even group
def test_w4a16(dtype, rows, group):
    packed, scales, zeros = _int4(100, 192, group, seed=3)
    x = _x((rows, 192), dtype, seed=4)
    out = w4a16_matmul(x, packed, scales, zeros, group)
    assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, group)) < TOL[dtype]


@pytest.mark.parametrize("group,k,rows", [(16, 96, 3), (128, 384, 5), (256, 512, 17)])
def test_w4a16_grouped_gemm(group, k, rows):
    """The GEMM for power-of-two groups: steps narrower than a group (128, 256 with the interpreter's 32-wide
    step: several steps share one scale), as wide as one (16), row counts that leave partial tiles."""
    packed, scales, zeros = _int4(50, k, group, seed=7)
    x = _x((rows, k), torch.float32, seed=8)
    out = w4a16_matmul(x, packed, scales, zeros, group)
    assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, group)) < 1e-5


# GEMV tiles and split-K on the interpreter: (block_n, block_k, split_k); 3 splits of an odd number of steps
# leaves the last split short, 16 splits of a short K leaves some empty, a step wider than K masks most of itself;
# load_stages is a no-op here
GEMV_TILES = [(16, 64, 1), (8, 32, 3), (32, 16, 16), (4, 256, 1)]


@pytest.mark.parametrize("tile", GEMV_TILES)
# K not a multiple of any step in the second; the third is even for two tiles (no masks: `_even`)
@pytest.mark.parametrize("n, k", [(100, 192), (37, 100), (96, 192)])
def test_w8a16_gemv_split_k(tile, n, k):
    bn, bk, split = tile
    tuning = replace(INTERPRETER, w8_splitk=SplitKTile(bn, bk, split, load_stages=3))
    q, s = _int8(n, k, seed=20)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)  # both ends of the range decode exactly
    x = _x((1, k), torch.float32, seed=21)
    out = w8a16_matmul(x, q, s, tuning=tuning)
    assert relative_error(out, w8a16_matmul_ref(x.double(), q, s)) < 1e-5
    assert torch.equal(w8a16_matmul(x, q, s, tuning=tuning), out)  # partials added in a fixed order: same bits
    _, counters = splitk._split_buffers(out.device, n)
    assert not counters.any()  # every row block's last split reset its counter for the next launch


@pytest.mark.parametrize("tile", GEMV_TILES)
@pytest.mark.parametrize("group", [8, 32, 64])
@pytest.mark.parametrize("n, k", [(37, 320), (32, 256)])  # uneven splits; even for some tiles (no masks)
@pytest.mark.parametrize("prefetch", [False, True])  # loads a step ahead (where even)
def test_w4a16_gemv_split_k(tile, group, n, k, prefetch):
    bn, bk, split = tile  # block_k is raised to the group where smaller
    tuning = replace(INTERPRETER, w4_splitk=SplitKTile(bn, bk, split, prefetch=prefetch))
    packed, scales, zeros = _int4(n, k, group, seed=22)  # 320 / 64 = 5 groups: uneven splits
    packed[0, 0] = 0xF0  # q = 0 and 15 in one byte
    x = _x((1, k), torch.float32, seed=23)
    out = w4a16_matmul(x, packed, scales, zeros, group, tuning=tuning)
    assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, group)) < 1e-5
    _, counters = splitk._split_buffers(out.device, n)
    assert not counters.any()


def test_w4a16_gemv_bf16_and_unaligned_words():
    packed, scales, zeros = _int4(37, 256, 128, seed=24)
    x = _x((1, 256), torch.bfloat16, seed=25)  # the GEMV has no tl.dot: bfloat16 runs on the interpreter too
    ref = w4a16_matmul_ref(x.double(), packed, scales, zeros, 128)
    assert relative_error(w4a16_matmul(x, packed, scales, zeros, 128), ref) < 1e-2
    shifted = torch.empty(packed.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(packed.shape)
    shifted.copy_(packed)  # rows not on a 4-byte boundary: no int32 view, the any-group kernel instead
    assert relative_error(w4a16_matmul(x, shifted, scales, zeros, 128), ref) < 1e-2


@pytest.mark.parametrize("k", [102, 192])
def test_w8a16_gemv_unaligned_words(k):
    """K not a multiple of 4, or rows not on a 4-byte boundary: each word is assembled from byte loads."""
    q, s = _int8(37, k, seed=26)
    x = _x((1, k), torch.float32, seed=27)
    ref = w8a16_matmul_ref(x.double(), q, s)
    shifted = torch.empty(q.numel() + 1, dtype=torch.int8, device=DEVICE)[1:].view(q.shape)
    shifted.copy_(q)
    for w in (q, shifted):
        assert relative_error(w8a16_matmul(x, w, s), ref) < 1e-5


def test_even_needs_whole_steps_real_rows_and_words():
    meta = {"N": 4096, "K": 4096, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4}
    assert splitk._even(meta) and splitk._even(dict(meta, WORDS_ALIGNED=True))
    assert not splitk._even(dict(meta, N=4100)) and not splitk._even(dict(meta, SPLIT_K=32))
    assert not splitk._even(dict(meta, WORDS_ALIGNED=False))


def test_gemv_prune_splits_only_small_grids():
    cand = splitk.SPLITK_CANDIDATES

    def kept(configs, n, k, group=None):
        return [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"])
                for c in splitk.prune_splitk(configs, n, k, group, sms=132)]

    w8, w4 = splitk._gemv_configs(cand.w8_tiles), splitk._gemv_configs(cand.w4_tiles)
    assert {s for *_, s in kept(w8, 128256, 4096)} == {1}  # the LM head fills the GPU unsplit
    for n, k in [(14336, 4096), (4096, 14336), (4096, 4096)]:
        cfgs = kept(w8, n, k)
        assert any(s > 1 for *_, s in cfgs) and len(cfgs) <= 48  # 8 tiles x 3 splits x 2 load pipelines
        assert all(-(-n // bn) * s <= cand.max_ctas_per_sm * 132 and -(-k // s) >= 2 * bk
                   for bn, bk, s in cfgs if s > 1)
    cfgs = kept(w4, 14336, 4096, group=128)
    assert cfgs and all(bk >= 128 for _, bk, _ in cfgs) and any(s > 1 for *_, s in cfgs)
    assert all(bk >= 512 for _, bk, _ in kept(w4, 4096, 4096, group=512))


def test_stationary_plan_picks_the_measured_row_steps():
    """On 132 SMs the rule -- the most row blocks per program that leave >= ``split_warps_per_sm`` (22) warps per
    SM for slices of K, >= ``warps_per_sm`` (11) for whole-K programs -- gives row steps that timed best or within
    2% of it on the H200 at the 8B decode shapes, each GEMV after a kernel that writes its activations
    (records/gemv_study_step_e38a902.json; split qkv s2 9.27 us against s4 9.14, o whole-K s2 7.79 best)."""
    rule = HOPPER.w4_stationary
    split_only = replace(rule, whole_k=None)
    split = {(6144, 4096): 2, (4096, 4096): 1, (28672, 4096): 8, (4096, 14336): 4, (14336, 4096): 4}
    whole = {(6144, 4096): 4, (4096, 4096): 2}  # whole-K programs where K <= 4096, N <= 8192 (5885d9a, 7b7213b)
    for (n, k), steps in split.items():
        assert stationary_plan(n, k, 128, split_only, 132).row_steps == steps
        plan = stationary_plan(n, k, 128, rule, 132)
        assert plan.row_steps == whole.get((n, k), steps) and plan.block_k == (k if (n, k) in whole else 512)
        assert plan.split_p2 == (1 if (n, k) in whole else splitk.next_pow2(k // 512))
        # with the RMSNorm in the prologue: always the split tile (a whole-K program holds the statistic too)
        normed = stationary_plan(n, k, 128, rule, 132, norm=True)
        assert normed.block_k == 512 and normed.row_steps == steps
    assert "PAIR_WORDS" not in stationary_plan(4096, 4096, 4, HOPPER.w8_stationary, 132).meta(8)
    assert stationary_plan(4100, 4096, 128, split_only, 132) is None  # no whole row blocks
    with pytest.raises(ValueError, match="row_steps=3"):
        stationary_plan(4096, 4096, 128, replace(split_only, split=StationaryTile(16, 512, 2, row_steps=3)), 132)
    with pytest.raises(ValueError, match="block_k=384"):
        stationary_plan(4096, 4096, 128, replace(split_only, split=StationaryTile(16, 384, 2)), 132)


def test_int4_words_are_paired_where_groups_hold_two():
    """Word pairs (two words' products in one float16 lane pair) in every int4 stationary GEMV whose groups hold
    two words or more (records/gemv_study_pairs_f65fe09.json); groups of 8 weights are one word."""
    x = _x((1, 256), torch.float16, seed=30)
    for group, paired in ((8, False), (16, True), (128, True)):
        packed = _int4(64, 256, group, seed=31)[0]
        plan = qmm._plan4(x, 64, 256, group, packed, HOPPER)
        assert plan.pair_words == paired and plan.meta(4)["PAIR_WORDS"] == paired


def test_the_device_picks_the_table():
    assert tuning_for(torch.device("cuda")) is HOPPER and tuning_for(torch.device("cpu")) is INTERPRETER
    assert HOPPER.w8_splitk is None and HOPPER.gemm is None  # autotuned on CUDA
    x = _x((1, 64), torch.float32, seed=32)
    with pytest.raises(TypeError, match="tuning must be a QuantTuning"):
        w8a16_matmul(x, *_int8(16, 64, seed=33), tuning={"BLOCK_N": 16})
    if DEVICE == "cpu":  # the interpreter has no autotuner
        with pytest.raises(ValueError, match="autotuner needs CUDA"):
            w8a16_matmul(x, *_int8(16, 64, seed=33), tuning=HOPPER)


def test_w4a16_reads_the_quantisers_format():
    """The kernel reads what ``labkit.quant``'s int4 quantiser writes."""
    from labkit.quant.weight_only import quantize_int4

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    packed, scales, zeros = (t.to(DEVICE) for t in quantize_int4(w, 64))
    x = _x((1, 128), torch.float32, seed=6)
    deq = dequantize_int4(packed, scales, zeros, 64)
    assert relative_error(w4a16_matmul(x, packed, scales, zeros, 64), x @ deq.T) < 1e-5


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bfloat16 refusal")
def test_bf16_gemv_runs_on_cpu_but_gemm_is_refused():
    q, s = _int8(40, 64, seed=7)
    x = _x((1, 64), torch.bfloat16, seed=8)
    assert relative_error(w8a16_matmul(x, q, s), w8a16_matmul_ref(x.double(), q, s)) < 1e-2  # no tl.dot
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        w8a16_matmul(_x((3, 64), torch.bfloat16, seed=9), q, s)


def test_bad_inputs():
    q, s = _int8(40, 64, seed=10)
    packed, scales, zeros = _int4(40, 64, 32, seed=11)
    x = _x((2, 64), torch.float32, seed=12)
    with pytest.raises(ValueError, match="K=64"):
        w8a16_matmul(_x((2, 63), torch.float32, seed=13), q, s)
    with pytest.raises(ValueError, match="qweight has dtype uint8"):
        w8a16_matmul(x, q.view(torch.uint8), s)
    with pytest.raises(ValueError, match="scale"):
        w8a16_matmul(x, q, s[:-1])
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, packed, scales, zeros, 48)
    with pytest.raises(ValueError, match="zeros"):
        w4a16_matmul(x, packed, scales, zeros[:, :1], 32)
    with pytest.raises(ValueError, match="split_k=17"):
        w8a16_matmul(x[:1], q, s, tuning=replace(INTERPRETER, w8_splitk=SplitKTile(split_k=17)))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("n", [1000, 4096])  # 4096: whole tiles, the GEMVs' unmasked (EVEN) path
def test_quantized_matmul_gpu_bf16(rows, n):
    q, s = _int8(n, 4096, seed=14)
    packed, scales, zeros = _int4(n, 4096, 128, seed=15)
    x = _x((rows, 4096), torch.bfloat16, seed=16)
    out8 = w8a16_matmul(x, q, s.bfloat16())
    assert relative_error(out8, w8a16_matmul_ref(x.double(), q, s.bfloat16())) < 2e-2
    args = (packed, scales.bfloat16(), zeros.bfloat16(), 128)
    assert relative_error(w4a16_matmul(x, *args), w4a16_matmul_ref(x.double(), *args)) < 2e-2


@pytest.mark.gpu
def test_split_k_gemv_replays_in_a_cuda_graph():
    """Split-K forced (fixed tiles of 4 splits instead of the autotuner's pick; no stationary GEMV for int4): the
    last split reduces, counters reset, and the whole thing captures and replays in a CUDA graph with new
    activations."""
    tuning = replace(HOPPER, w8_splitk=SplitKTile(128, 64, 4, load_stages=3),
                     w4_splitk=SplitKTile(128, 128, 4, load_stages=3),
                     w4_stationary=replace(HOPPER.w4_stationary, whole_k=None))  # 1000 rows: no split tile fits
    n, k = 1000, 4096
    q, s = _int8(n, k, seed=30)
    packed, scales, zeros = _int4(n, k, 128, seed=31)
    w8_args, w4_args = (q, s.bfloat16()), (packed, scales.bfloat16(), zeros.bfloat16(), 128)
    x = _x((1, k), torch.bfloat16, seed=32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: the workspace is made here
        w8a16_matmul(x, *w8_args, tuning=tuning), w4a16_matmul(x, *w4_args, tuning=tuning)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out8, out4 = w8a16_matmul(x, *w8_args, tuning=tuning), w4a16_matmul(x, *w4_args, tuning=tuning)
    for seed in (33, 34):
        x.copy_(_x((1, k), torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out8, w8a16_matmul_ref(x.double(), *w8_args)) < 2e-2
        assert relative_error(out4, w4a16_matmul_ref(x.double(), *w4_args)) < 2e-2
    assert not splitk._split_buffers(x.device, n)[1].any()
