"""The one-kernel per-row FP8 quantisation (``labkit.kernels.fp8_quant``) against its torch reference."""

import pytest
import torch

from labkit.kernels.fp8_quant import FP8_DTYPE, quantize_rows_fp8, quantize_rows_fp8_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 7), (3, 40), (5, 2500)])
def test_codes_and_scales_are_the_references(dtype, m, k):
    """The same scale and, code by code, the same e4m3 value as the torch reference (round to nearest even), on
    irregular shapes, with tiny values (subnormal codes) and an exact zero in the rows."""
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :3] = torch.tensor([1e-6, -3e-5, 0.0]).to(dtype)[: min(3, k)]
    q, s = quantize_rows_fp8(x)
    qr, sr = quantize_rows_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())


def test_rounding_across_a_power_of_two():
    """Values that round up into the next binade (127.9 -> 128) keep their magnitude: Triton's interpreter drops that
    carry when it converts to e4m3 itself; the kernel rounds first."""
    x = torch.tensor([[448.0, 127.9, -31.6, 7.97, 0.001953, 0.0]])
    q, _ = quantize_rows_fp8(x)
    assert q.float().tolist() == [[448.0, 128.0, -32.0, 8.0, 0.001953125, 0.0]]


def test_zero_rows_and_empty_inputs():
    q, s = quantize_rows_fp8(torch.zeros(2, 9))
    assert q.float().abs().sum() == 0 and torch.all(s == 1e-12)
    q, s = quantize_rows_fp8(torch.zeros(0, 9))
    assert q.shape == (0, 9) and s.shape == (0, 1)


def test_bad_input():
    with pytest.raises(ValueError, match="dimensions"):
        quantize_rows_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        quantize_rows_fp8(torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.gpu
def test_cuda_codes_are_the_references():
    x = torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16) * 5
    q, s = quantize_rows_fp8(x)
    qr, sr = quantize_rows_fp8_ref(x)
    assert torch.equal(s, sr) and torch.equal(q.float(), qr.float())
