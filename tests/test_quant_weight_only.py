import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.evaluate import relative_error
from labkit.quant.packing import dequantize_int4, unpack_int4
from labkit.quant.weight_only import Int4Linear, Int8Linear, concat_linears, quantize_int4, quantize_int8

INT8_TOL, INT4_TOL = 2e-2, 1e-1  # DESIGN.md tolerance table


def _layer(n: int, k: int, bias: bool, seed: int) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin, torch.randn(3, 5, k)


@pytest.mark.parametrize("n,k,bias", [(37, 83, True), (1, 7, False), (130, 256, False)])
def test_int8_linear_within_tolerance(n, k, bias):
    lin, x = _layer(n, k, bias, seed=n)
    q = Int8Linear.from_linear(lin)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (n,)
    assert int(q.qweight.abs().max()) == 127  # absmax maps each row's largest weight onto the grid's end
    with torch.no_grad():
        assert relative_error(q(x), lin(x)) < INT8_TOL


@pytest.mark.parametrize("n,k,group,bias", [(37, 96, 32, True), (50, 256, 128, False), (3, 384, 128, True),
                                            (19, 24, 8, False)])
def test_int4_linear_within_tolerance(n, k, group, bias):
    lin, x = _layer(n, k, bias, seed=k)
    q = Int4Linear.from_linear(lin, group_size=group)
    assert q.packed.shape == (n, k // 2) and q.scales.shape == (n, k // group) == q.zeros.shape
    with torch.no_grad():
        assert relative_error(q(x), lin(x)) < INT4_TOL


def test_int4_codes_grid_and_exact_zero():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 64, generator=g)
    w[2, :16] = 0.7  # a constant group (all positive): the range still includes zero
    w[:, 5] = 0.0
    packed, scales, zeros = quantize_int4(w, group_size=16)
    codes = unpack_int4(packed)
    assert int(codes.max()) <= 15 and torch.equal(zeros, zeros.round())
    deq = dequantize_int4(packed, scales, zeros, 16)
    assert torch.all(deq[:, 5] == 0)  # integer zero-points represent 0 exactly
    # round to nearest: every weight within half a step of its dequantised value
    step = scales.repeat_interleave(16, dim=1)
    assert torch.all((deq - w).abs() <= 0.5 * step + 1e-6)


def test_int8_round_to_nearest_and_zero_row():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(5, 33, generator=g)
    w[1] = 0.0
    q, scale = quantize_int8(w)
    assert scale[1] == 1.0 and torch.all(q[1] == 0)
    assert torch.all((q.float() * scale[:, None] - w).abs() <= 0.5 * scale[:, None] + 1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_layers(dtype):
    lin, x = _layer(48, 128, True, seed=7)
    lin = lin.to(dtype)
    x = x.to(dtype)
    with torch.no_grad():
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        for q, tol in ((Int8Linear.from_linear(lin), INT8_TOL), (Int4Linear.from_linear(lin, 64), INT4_TOL)):
            out = q(x)
            assert out.dtype == dtype and q.bias.dtype == dtype
            assert relative_error(out, ref) < tol


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="group_size=96 does not divide in_features=256"):
        quantize_int4(torch.randn(4, 256), group_size=96)
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.randn(4, 256), group_size=3)
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_int8(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="backend"):
        Int8Linear.from_linear(nn.Linear(8, 8), backend="cuda")
    with pytest.raises(ValueError, match="scales and zeros"):
        Int4Linear(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 2), 16)


def test_triton_backend_matches_torch():
    # on the CPU the kernels run under the Triton interpreter: small fp32 shapes only
    lin, x = _layer(24, 64, False, seed=9)
    for q in (Int8Linear.from_linear(lin), Int4Linear.from_linear(lin, 32)):
        for xs in (x, x[0, :1]):  # many rows (GEMM kernel) and one row (GEMV kernel)
            with torch.no_grad():
                q.backend = "torch"
                ref = q(xs)
                q.backend = "triton"
                assert q.uses_kernels(xs.device)
                assert relative_error(q(xs), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64])
def test_cuda_layers_match_reference(m):
    torch.manual_seed(m)
    lin = nn.Linear(1024, 768, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = F.linear(x.float(), lin.weight.float())
        for q, tol in ((Int8Linear.from_linear(lin), INT8_TOL), (Int4Linear.from_linear(lin), INT4_TOL)):
            out = q(x)
            assert out.dtype == torch.bfloat16 and relative_error(out, ref) < tol
            q.backend = "torch"
            assert relative_error(out, q(x)) < 1e-2  # fused kernel vs dequantise-then-matmul


def _layers(kind: str, rows, k: int = 64, seed: int = 40):
    g = torch.Generator().manual_seed(seed)
    plain = [nn.Linear(k, n, bias=False) for n in rows]
    for lin in plain:
        lin.weight.data = torch.randn(lin.weight.shape, generator=g)
    if kind == "plain":
        return plain
    if kind == "int8":
        return [Int8Linear.from_linear(lin) for lin in plain]
    return [Int4Linear.from_linear(lin, group_size=16) for lin in plain]


@pytest.mark.parametrize("kind", ["plain", "int8", "int4"])
def test_concat_linears_one_matmul_same_values_no_copy(kind):
    layers = _layers(kind, [48, 16, 16])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(41))
    before = [lin(x) for lin in layers]
    merged = concat_linears(layers)
    assert type(merged) is type(layers[0]) and merged.out_features == 80
    assert relative_error(merged(x), torch.cat(before, -1)) < 1e-6
    for lin, ref in zip(layers, before):
        assert torch.equal(lin(x), ref)  # each layer still computes what it did, from its slice of the merged one
    name = {"plain": "weight", "int8": "qweight", "int4": "packed"}[kind]
    base = getattr(merged, name).untyped_storage().data_ptr()
    assert all(getattr(lin, name).untyped_storage().data_ptr() == base for lin in layers)


def test_concat_linears_refuses_what_cannot_merge():
    mixed = _layers("int8", [8]) + _layers("int4", [8])
    assert concat_linears(mixed) is None
    assert concat_linears(_layers("int4", [8]) + [Int4Linear.from_linear(nn.Linear(64, 8, bias=False), 32)]) is None
    biased = _layers("plain", [8, 8])
    biased[1].bias = nn.Parameter(torch.zeros(8))
    weight = biased[0].weight
    assert concat_linears(biased) is None and biased[0].weight is weight  # nothing changed
    assert concat_linears(_layers("plain", [8]) + [nn.Linear(32, 8, bias=False)]) is None
