"""Quantised KV: int8 / fp8 round trips with per-token-head scales, byte accounting, the accuracy evaluation on
the embedded model (its reference equals labkit.evaluate.perplexity), and the latency probe."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kvcache import PagedKVCache, SeqBlocks, kv_format
from labkit.kvcache.quant import dequantize_kv, quantize_kv

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
    a = SeqBlocks(list(range(9)), "a")
    cache.allocate(a)
    k, v = torch.randn(2, 9, 2, 16, generator=g)
    cache.write(1, torch.tensor(cache.slots(a, 0, 9)), k, v)
    k2, v2 = cache.gather(a, 1)
    assert relative_error(k2, k) <= 4e-2 and relative_error(v2, v) <= 4e-2
    assert torch.equal(k2, dequantize_kv(*quantize_kv(k, cache.fmt), torch.float32))


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
        a = SeqBlocks(list(range(11)), "a")
        c.allocate(a)
        c.write(0, torch.tensor(c.slots(a, 0, 11)), k.to(device), v.to(device))
        c.mark_computed(a, 11)
        b = SeqBlocks(list(a.token_ids), "b")
        c.fork(a, b)
        b.token_ids.append(1)
        c.append_slots(b)  # copy on write of the partial block, on the device
        caches[device] = c, (a, b)
    for i in range(2):
        kc, vc = caches["cpu"][0].gather(caches["cpu"][1][i], 0)
        kg, vg = caches["cuda"][0].gather(caches["cuda"][1][i], 0)
        n = 11
        assert torch.equal(kc[:n], kg[:n].cpu()) and torch.equal(vc[:n], vg[:n].cpu())
