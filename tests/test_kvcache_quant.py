"""Quantised KV: int8 / fp8 round trips with per-token-head scales, byte accounting, the accuracy evaluation on
the embedded model (its reference equals labkit.evaluate.perplexity), and the latency probe."""

import pytest
import torch

from labkit.evaluate import perplexity, relative_error
from labkit.kvcache import PagedKVCache, kv_format
from labkit.kvcache.quant import dequantize_kv, quantize_kv
from labkit.kvcache.quant_eval import attention_latency, kv_format_accuracy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("name", "bound"), [("int8", 1e-2), ("fp8", 4e-2), ("bf16", 1e-2), ("fp32", 0.0)])
def test_round_trip_error(name, bound):
    fmt = kv_format(name)
    x = torch.randn(37, 3, 64, generator=torch.Generator().manual_seed(1)) * 5
    q, scale = quantize_kv(x, fmt)
    assert q.dtype == fmt.storage_dtype and q.shape == x.shape
    if fmt.quantised:
        assert scale.dtype == torch.float32 and scale.shape == (37, 3)
        assert q.float().abs().amax() <= (127 if name == "int8" else 448)
    else:
        assert scale is None
    assert relative_error(dequantize_kv(q, scale, torch.float32), x) <= bound


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_scales_are_per_token_and_head(name):
    fmt = kv_format(name)
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(2))
    x[:, 1] *= 1e-3  # a head a thousand times smaller keeps its own precision
    x[2] = 0.0  # an all-zero token comes back as zeros, not NaN
    y = dequantize_kv(*quantize_kv(x, fmt), torch.float32)
    assert torch.equal(y[2], torch.zeros_like(y[2]))
    assert relative_error(y[:, 1], x[:, 1]) <= (1e-2 if name == "int8" else 4e-2)


def test_bytes_per_token_counts_scales():
    assert kv_format("fp32").bytes_per_token(8, 2, 64) == 2 * 8 * 2 * 64 * 4
    assert kv_format("int8").bytes_per_token(8, 2, 64) == 2 * 8 * 2 * (64 + 4)
    assert kv_format(torch.float8_e4m3fn).bytes_per_token(32, 8, 128) == 2 * 32 * 8 * (128 + 4)
    assert PagedKVCache(8, 2, 64, 4, 16, kv_dtype="int8").bytes_per_block == 16 * 2 * 8 * 2 * 68
    with pytest.raises(ValueError, match="kv_dtype='int4' is not a KV-cache format; allowed"):
        kv_format("int4")


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantised_cache_reads_back_dequantised(name):
    g = torch.Generator().manual_seed(4)
    cache = PagedKVCache(2, 2, 16, num_blocks=5, block_size=4, kv_dtype=name)
    cache.allocate("a", list(range(9)))
    k, v = torch.randn(2, 9, 2, 16, generator=g)
    cache.write(1, torch.tensor(cache.slots("a", 0, 9)), k, v)
    k2, v2 = cache.gather("a", 1)
    assert relative_error(k2, k) <= 4e-2 and relative_error(v2, v) <= 4e-2
    assert torch.equal(k2, dequantize_kv(*quantize_kv(k, cache.fmt), torch.float32))


def test_accuracy_evaluation_on_the_embedded_model():
    from labkit.data import split_tokens
    from labkit.models import load_model

    model, tok = load_model()
    ids = split_tokens("heldout", tok, max_tokens=3 * 96 + 1)
    res = kv_format_accuracy(model, ids, ("fp32", "int8", "fp8"), seq_len=96, batch_size=2, block_size=16)
    want = perplexity(model, ids, seq_len=96)
    assert res["reference"]["ppl"] == pytest.approx(want, rel=1e-5)
    assert res["reference"]["logit_rel_err"] == 0.0 and res["reference"]["scored_tokens"] == 3 * 96
    assert res["fp32"]["logit_rel_err"] == 0.0
    assert res["int8"]["logit_rel_err"] <= 2e-2 and res["int8"]["top1_agree"] >= 0.95
    assert abs(res["int8"]["ppl"] / want - 1) <= 0.01
    assert res["fp8"]["logit_rel_err"] <= 1e-1
    assert res["int8"]["bytes_per_token"] < res["reference"]["bytes_per_token"] / 3
    with pytest.raises(ValueError, match="fewer than one window"):
        kv_format_accuracy(model, ids[:10], seq_len=96)


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_attention_latency_runs(name):
    timing, nbytes = attention_latency(name, num_seqs=2, context_len=40, num_heads=4, num_kv_heads=2, head_dim=16,
                                       block_size=8, dtype=torch.float32, iters=2)
    assert len(timing.samples_s) == 2 and nbytes == 2 * 40 * kv_format(name).bytes_per_token(1, 2, 16)


def test_spread_windows_cover_the_stream():
    import math

    from labkit.models import load_model

    model, _ = load_model()
    ids = torch.randint(0, 8000, (10 * 32 + 1,), generator=torch.Generator().manual_seed(5))
    first = kv_format_accuracy(model, ids, (), seq_len=32, max_windows=2, batch_size=2)
    spread = kv_format_accuracy(model, ids, (), seq_len=32, max_windows=2, batch_size=2, spread=True)
    assert first["reference"]["ppl"] == pytest.approx(perplexity(model, ids[:65], seq_len=32), rel=1e-5)
    # two of ten windows evenly spread: windows 0 and 5
    w0, w5 = perplexity(model, ids[0:33], seq_len=32), perplexity(model, ids[160:193], seq_len=32)
    assert spread["reference"]["ppl"] == pytest.approx(math.sqrt(w0 * w5), rel=1e-5)
    assert spread["reference"]["scored_tokens"] == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_cuda_cache_stores_what_the_cpu_computes(name):
    """fp8 is native on the GPU and emulated by torch's software cast on the CPU: the bytes must agree."""
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(2, 11, 2, 128, generator=g)
    caches = {}
    for device in ("cpu", "cuda"):
        c = PagedKVCache(1, 2, 128, num_blocks=4, block_size=4, kv_dtype=name, device=device)
        c.allocate("a", list(range(11)))
        c.write(0, torch.tensor(c.slots("a", 0, 11)), k.to(device), v.to(device))
        c.fork("a", "b")
        c.append_slots("b", [1])  # copy on write of the partial block, on the device
        caches[device] = c
    for sid in ("a", "b"):
        kc, vc = caches["cpu"].gather(sid, 0)
        kg, vg = caches["cuda"].gather(sid, 0)
        n = 11
        assert torch.equal(kc[:n], kg[:n].cpu()) and torch.equal(vc[:n], vg[:n].cpu())
