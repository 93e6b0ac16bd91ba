"""FlashAttention forward against the float64 torch reference: causal and not, GQA, masks, strided inputs."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.flash_attention import flash_attention, flash_attention_ref

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA


def _qkv(b, h, hk, s, t, d, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).to(device)
            for shape in ((b, h, s, d), (b, hk, t, d), (b, hk, t, d))]


def _check(q, k, v, tol, **kw):
    out = flash_attention(q, k, v, **kw)
    ref = flash_attention_ref(q.double(), k.double(), v.double(), **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = relative_error(out, ref)
    assert err < tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,h,hk,s,t,d,causal", [
    (2, 4, 2, 37, 37, 64, True),    # prefill, GQA, partial last tiles
    (1, 6, 2, 5, 70, 32, True),     # queries at the end of a longer context (bottom-right causal)
    (2, 2, 1, 19, 45, 48, False),   # head_dim not a power of two
    (3, 4, 4, 1, 53, 64, True),     # one decode query sees every key
    (1, 4, 2, 70, 90, 32, True),    # S * group > 128: one program per query head instead of per KV head
])
def test_flash_attention(dtype, b, h, hk, s, t, d, causal):
    _check(*_qkv(b, h, hk, s, t, d, dtype, seed=s * t + d), TOL[dtype], causal=causal)


def test_flash_attention_reads_hf_transposed_views():
    qkv = _qkv(2, 4, 2, 21, 21, 32, torch.float32, 1)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv)  # [B, S, H, D] memory
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, causal=True)
    assert out.transpose(1, 2).is_contiguous()  # [B, S, H, D] memory, as the output projection wants it
    assert relative_error(out, flash_attention_ref(q, k, v, causal=True)) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])  # query heads packed per KV head, and not
def test_flash_attention_boolean_mask(causal, kv_heads):
    q, k, v = _qkv(2, 4, kv_heads, 7, 29, 32, torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(2, 1, 7, 29, generator=g) > 0.3).to(DEVICE)
    mask[1, 0, 3, :] = False  # a query that may attend to nothing gets zeros
    _check(q, k, v, 1e-5, causal=causal, attn_mask=mask)
    out = flash_attention(q, k, v, causal=causal, attn_mask=mask)
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))


def test_flash_attention_scale():
    q, k, v = _qkv(1, 2, 2, 9, 9, 16, torch.float32, seed=4)
    _check(q, k, v, 1e-5, causal=True, scale=0.37)


def test_bad_inputs():
    q, k, v = _qkv(1, 4, 2, 8, 6, 16, torch.float32, seed=5)
    with pytest.raises(ValueError, match="causal"):
        flash_attention(q, k, v, causal=True)  # 8 queries, 6 keys
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(*_qkv(1, 4, 3, 4, 4, 16, torch.float32, seed=6))
    with pytest.raises(ValueError, match="attn_mask"):
        flash_attention(q, k, v, attn_mask=torch.ones(1, 1, 8, 5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="k has dtype"):
        flash_attention(q, k.half(), v)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bfloat16 refusal")
def test_bf16_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        flash_attention(*_qkv(1, 2, 2, 4, 4, 16, torch.bfloat16, seed=7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s,t,causal", [(333, 333, True), (1, 1000, True), (200, 517, False),
                                        (1024, 1024, True)])
def test_flash_attention_gpu(dtype, s, t, causal):
    q, k, v = _qkv(2, 8, 2, s, t, 128, dtype, seed=s + t, device="cuda")
    _check(q, k, v, TOL[dtype], causal=causal)
    if s == t or not causal:  # SDPA aligns causal masks top-left, so compare where both agree
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                enable_gqa=True)
        assert relative_error(flash_attention(q, k, v, causal=causal), sdpa) < 1e-2
