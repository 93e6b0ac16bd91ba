import pytest
import torch
from torch import nn

from labkit.evaluate import relative_error
from labkit.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_fp8, quantize_fp8_rows

# e4m3 keeps 3 mantissa bits: ~2-3% RMS relative error per operand, both operands rounded.
FP8_TOL = 5e-2


@pytest.mark.parametrize("n,k,bias", [(48, 64, True), (37, 83, False), (256, 768, False)])
def test_fp8_linear_emulated_within_tolerance(n, k, bias):
    torch.manual_seed(n)
    lin = nn.Linear(k, n, bias=bias)
    x = torch.randn(2, 9, k)
    q = Fp8Linear.from_linear(lin, backend="emulated")
    assert q.weight.dtype == FP8_DTYPE and q.weight_scale.shape == (n,)
    with torch.no_grad():
        assert relative_error(q(x), lin(x)) < FP8_TOL


def test_scales_map_each_row_onto_the_e4m3_range():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 32, generator=g) * torch.logspace(-3, 3, 10)[:, None]
    q, scale = quantize_fp8(w)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((10,), FP8_MAX))
    assert relative_error(q.float() * scale[:, None], w) < 5e-2
    xq, xs = quantize_fp8_rows(w)
    assert xs.shape == (10, 1) and torch.equal(xq, q)


def test_scaled_mm_path_agrees_with_emulation():
    """torch's CPU _scaled_mm runs the exact call the CUDA path makes (row-wise scales, column-major W^T)."""
    torch.manual_seed(2)
    lin = nn.Linear(64, 48, bias=True)
    x = torch.randn(5, 64)
    emu = Fp8Linear.from_linear(lin, backend="emulated")
    try:
        mm = Fp8Linear.from_linear(lin, backend="scaled_mm")
        got = mm(x)
    except (RuntimeError, NotImplementedError) as e:  # a torch build without the CPU kernel
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    with torch.no_grad():
        assert got.dtype == torch.float32
        assert relative_error(got, emu(x)) < 1e-2  # _scaled_mm rounds its output to bf16


def test_bad_input():
    with pytest.raises(ValueError, match="backend"):
        Fp8Linear.from_linear(nn.Linear(16, 16), backend="fp8")
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_linear(nn.Linear(20, 16), backend="scaled_mm")
    with pytest.raises(ValueError, match="weight must be"):
        Fp8Linear(torch.zeros(4, 4), torch.ones(4))


@pytest.mark.gpu
def test_cuda_scaled_mm_matches_emulation():
    torch.manual_seed(3)
    lin = nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16)
    q = Fp8Linear.from_linear(lin)
    with torch.no_grad():
        got = q(x)
        q.backend = "emulated"
        assert relative_error(got, q(x)) < 1e-2
        assert relative_error(got, lin(x)) < FP8_TOL


def test_fused_backend_is_the_eager_one_in_one_kernel():
    """The fused backend (labkit's Triton row quantisation, then _scaled_mm) gives the eager scaled_mm backend's
    output: the same codes and scales go into the same GEMM."""
    torch.manual_seed(4)
    lin = nn.Linear(64, 48, bias=True)
    x = torch.randn(2, 5, 64)
    try:
        eager = Fp8Linear.from_linear(lin, backend="scaled_mm")(x)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    fused = Fp8Linear.from_linear(lin, backend="fused")(x)
    assert fused.shape == (2, 5, 48) and torch.equal(fused, eager)
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_linear(nn.Linear(20, 16), backend="fused")


def test_fp8_layers_merge_into_one():
    """q/k/v (or gate/up) FP8 layers merge like int8/int4 ones: one layer over the stacked codes and scales, the
    inputs re-pointed at its rows."""
    from labkit.quant import concat_linears

    torch.manual_seed(5)
    parts = [Fp8Linear.from_linear(nn.Linear(32, n, bias=False), backend="emulated") for n in (16, 8, 8)]
    merged = concat_linears(parts)
    x = torch.randn(3, 32)
    assert isinstance(merged, Fp8Linear) and merged.out_features == 32
    assert torch.equal(merged(x), torch.cat([p(x) for p in parts], -1))
    assert parts[1].weight.data_ptr() == merged.weight[16:].data_ptr()
