"""RMSNorm (+ residual), silu_and_mul, RoPE and softmax against their torch references on irregular shapes."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.rms_norm import rms_norm, rms_norm_ref
from labkit.kernels.rope import apply_rope, apply_rope_and_cache, apply_rope_ref
from labkit.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from labkit.kernels.softmax import MAX_FUSED_COLS, softmax, softmax_ref

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 257)])
def test_rms_norm(dtype, shape):
    x, w = _randn(*shape, dtype=dtype, seed=1), _randn(shape[-1], dtype=dtype, seed=2)
    out = rms_norm(x, w, eps=1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert relative_error(out, rms_norm_ref(x.double(), w.double(), 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype):
    x, r = _randn(37, 100, dtype=dtype, seed=3), _randn(37, 100, dtype=dtype, seed=4)
    w = _randn(100, dtype=dtype, seed=5)
    out, res_out = rms_norm(x, w, eps=1e-6, residual=r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, residual=r)  # same dtype: the sum is rounded the same way
    # exact on the GPU; Triton's interpreter truncates float32 -> bfloat16 instead of rounding to nearest
    if dtype == torch.bfloat16:
        assert relative_error(res_out, ref_res) < 1e-2
    else:
        assert torch.equal(res_out, ref_res)
    assert relative_error(out, ref_out) < TOL[dtype]
    assert torch.equal(x, _randn(37, 100, dtype=dtype, seed=3))  # inputs untouched


@pytest.mark.parametrize("rows_per_program", [2, 4])
def test_rms_norm_several_rows_per_program(rows_per_program):
    # 37 rows: the last program is part-empty
    x, r = _randn(37, 100, dtype=torch.float16, seed=20), _randn(37, 100, dtype=torch.float16, seed=21)
    w = _randn(100, dtype=torch.float16, seed=22)
    out = rms_norm(x, w, 1e-5, rows_per_program=rows_per_program)
    assert relative_error(out, rms_norm_ref(x.double(), w.double(), 1e-5)) < 1e-2
    out, res_out = rms_norm(x, w, 1e-5, residual=r, rows_per_program=rows_per_program)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, residual=r)
    assert torch.equal(res_out, ref_res) and relative_error(out, ref_out) < 1e-2
    with pytest.raises(ValueError, match="rows_per_program=3"):
        rms_norm(x, w, 1e-5, rows_per_program=3)


def test_rms_norm_prune_keeps_registers_bounded():
    import labkit.kernels.rms_norm as rn

    for block in (128, 4096, 8192, 65536):
        kept = rn._prune(rn._CONFIGS, {}, BLOCK=block)
        assert kept and all(c.kwargs["ROWS"] * block // (32 * c.num_warps) <= max(64, block // 512) for c in kept)
    assert {(c.kwargs["ROWS"], c.num_warps) for c in rn._prune(rn._CONFIGS, {}, BLOCK=4096)} >= {(1, 8), (2, 8)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1024, 4099])  # the autotuned path (rows per program), a ragged last program
def test_rms_norm_tuned_path_gpu(rows):
    x, r = _randn(rows, 4096, dtype=torch.bfloat16, seed=23), _randn(rows, 4096, dtype=torch.bfloat16, seed=24)
    w = _randn(4096, dtype=torch.bfloat16, seed=25)
    assert relative_error(rms_norm(x, w, 1e-5), rms_norm_ref(x.double(), w.double(), 1e-5)) < 1e-2
    out, res_out = rms_norm(x, w, 1e-5, residual=r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, residual=r)
    assert torch.equal(res_out, ref_res) and relative_error(out, ref_out) < 1e-2


def test_rms_norm_matches_hf_bitwise_in_float32():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(100, eps=1e-5).to(DEVICE)
    norm.weight.data = _randn(100, seed=6)
    x = _randn(2, 7, 100, seed=7)
    with torch.no_grad():
        assert relative_error(rms_norm(x, norm.weight, 1e-5), norm(x)) < 1e-6


def test_rms_norm_strided_input():
    x = _randn(20, 130, seed=8)[:, :100]  # row stride 130, not contiguous
    w = _randn(100, seed=9)
    assert relative_error(rms_norm(x, w), rms_norm_ref(x, w)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 200), (2, 3, 2 * 1100)])
def test_silu_and_mul(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=10, scale=3.0)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert relative_error(out, silu_and_mul_ref(x.double())) < TOL[dtype]


def test_silu_and_mul_two_inputs_matches_hf_mlp_activation():
    gate, up = _randn(3, 11, 96, seed=18, scale=3.0), _randn(3, 11, 96, seed=19)
    hf = torch.nn.SiLU()(gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    assert relative_error(silu_and_mul(gate, up), hf) < 1e-6
    with pytest.raises(ValueError, match="same shape"):
        silu_and_mul(gate, up[..., :95])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_out_of_place_and_inplace(dtype):
    tokens, hq, hk, d = 29, 6, 3, 48
    q, k = _randn(tokens, hq, d, dtype=dtype, seed=11), _randn(tokens, hk, d, dtype=dtype, seed=12)
    ang = _randn(tokens, d // 2, seed=13, scale=4.0)
    cos, sin = ang.cos(), ang.sin()
    rq, rk = apply_rope_ref(q.double(), k.double(), cos.double(), sin.double())
    q_out, k_out = apply_rope(q, k, cos, sin)
    assert relative_error(q_out, rq) < TOL[dtype] and relative_error(k_out, rk) < TOL[dtype]
    q2, k2 = q.clone(), k.clone()
    q3, k3 = apply_rope(q2, k2, cos, sin, inplace=True)
    assert q3 is q2 and k3 is k2
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)


def test_rope_matches_hf_on_hf_layout():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s, hq, hk, d = 2, 13, 4, 2, 32
    q, k = _randn(b, s, hq, d, seed=14), _randn(b, s, hk, d, seed=15)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    freqs = torch.arange(s, device=DEVICE).float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1).expand(b, s, d)  # Hugging Face's [B, S, head_dim] tables
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), emb.cos(), emb.sin())
    q_out, k_out = apply_rope(q, k, emb.cos(), emb.sin())
    assert relative_error(q_out, ref_q.transpose(1, 2)) < 1e-6
    assert relative_error(k_out, ref_k.transpose(1, 2)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 100, MAX_FUSED_COLS + 1000])
def test_softmax(dtype, cols):
    rows = 37 if cols < MAX_FUSED_COLS else 3
    x = _randn(rows, cols, dtype=dtype, seed=16, scale=5.0)
    x[0, : cols // 2] = -float("inf")  # a masked half-row must still sum to one
    out = softmax(x)
    assert relative_error(out, softmax_ref(x.double())) < TOL[dtype]


def test_softmax_is_safe_for_large_logits():
    x = _randn(5, 300, seed=17) * 1e4  # exp overflows without subtracting the max
    out = softmax(x)
    assert torch.isfinite(out).all()
    assert relative_error(out, softmax_ref(x.double())) < 1e-5


def test_bad_inputs_name_the_argument():
    x = _randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, _randn(7))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, _randn(8), residual=_randn(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype int64"):
        softmax(torch.ones(3, 4, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(_randn(3, 7))
    with pytest.raises(ValueError, match="cos"):
        apply_rope(_randn(5, 2, 8), _randn(5, 1, 8), _randn(5, 3), _randn(5, 4))
    with pytest.raises(ValueError, match="inplace"):
        q = _randn(8, 5, 2, 16).transpose(0, 1)  # [5, 8, 2, 16] with tokens not collapsible
        apply_rope(q, _randn(5, 8, 1, 16), _randn(5, 8, 8), _randn(5, 8, 8), inplace=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_and_cache_write_in_one_launch(dtype):
    """Against apply_rope_ref and an indexed write: q and k rotated, the rotated k and v land at their slots
    (scattered across blocks, in any order), every other slot is untouched, and a slot of -1 is skipped."""
    g = torch.Generator().manual_seed(5)
    t, hq, hk, d, blocks, bs = 7, 6, 2, 24, 5, 4
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(DEVICE) for h in (hq, hk, hk))
    ang = torch.randn(t, d // 2, generator=g)
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    kc = torch.full((blocks, bs, hk, d), 7.0, dtype=dtype, device=DEVICE)
    vc = kc.clone()
    slots = torch.tensor([13, 2, 19, 0, 8, -1, 5], device=DEVICE)
    q_rot, k_rot = apply_rope_and_cache(q, k, v, cos, sin, kc, vc, slots)
    q_ref, k_ref = apply_rope_ref(q, k, cos, sin)
    assert relative_error(q_rot, q_ref) < TOL[dtype] and relative_error(k_rot, k_ref) < TOL[dtype]
    written = slots >= 0
    flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
    assert torch.equal(flat_k[slots[written]], k_rot[written]) and torch.equal(flat_v[slots[written]], v[written])
    rest = torch.ones(blocks * bs, dtype=torch.bool, device=DEVICE)
    rest[slots[written]] = False
    assert (flat_k[rest] == 7).all() and (flat_v[rest] == 7).all()
    with pytest.raises(ValueError, match="k_cache"):
        apply_rope_and_cache(q, k, v, cos, sin, kc[:, :, :1], vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        apply_rope_and_cache(q, k, v, cos, sin, kc, vc, slots[:3])


@pytest.mark.gpu
def test_graph_bench_replays_the_captured_calls():
    """The RMSNorm autotuner's timing: one warm call, ``per`` calls captured, the graph replayed once to warm up
    and ``reps`` times timed -- every one of them runs ``fn`` (counted here), and the quantiles come back in the
    order asked for."""
    from labkit.kernels.common import graph_bench

    t = torch.zeros(1, device="cuda")
    ms = graph_bench(lambda: t.add_(1), quantiles=(0.2, 0.5, 0.8), per=3, reps=5)
    assert t.item() == 1 + 3 * (1 + 5)
    assert 0 < ms[0] <= ms[1] <= ms[2]


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_every_tuned_config_gpu(residual):
    """Each autotuner candidate on a ragged row count, launched directly."""
    import labkit.kernels.rms_norm as rn

    rows = 4099
    x, r = _randn(rows, 4096, dtype=torch.bfloat16, seed=26), _randn(rows, 4096, dtype=torch.bfloat16, seed=27)
    w = _randn(4096, dtype=torch.bfloat16, seed=28)
    ref_out, ref_res = rn.rms_norm_ref(x, w, 1e-5, residual=r) if residual else (rn.rms_norm_ref(x, w, 1e-5), None)
    for c in rn._CONFIGS:
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        rn._rms_norm_kernel[rn._grid(rows)(c.kwargs)](
            x, r, w, out, res_out, rows, 4096, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0), 1e-5,
            8192, HAS_RESIDUAL=residual, BLOCK=4096, **c.kwargs, num_warps=c.num_warps)
        assert relative_error(out, ref_out) < 1e-2, c
        if residual:
            assert torch.equal(res_out, ref_res), c
