"""W8A16 and W4A16 fused matmuls (GEMV and GEMM paths) against dequantise-then-matmul references."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.quantized_matmul import w4a16_matmul, w4a16_matmul_ref, w8a16_matmul, w8a16_matmul_ref
from labkit.quant.packing import pack_int4

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


def test_w4a16_reads_the_quantisers_format():
    from labkit.quant.packing import dequantize_int4

    packed, scales, zeros = _int4(48, 128, 128, seed=5)
    x = _x((1, 128), torch.float32, seed=6)
    w = dequantize_int4(packed, scales, zeros, 128)
    assert relative_error(w4a16_matmul(x, packed, scales, zeros, 128), x @ w.T) < 1e-5


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


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_quantized_matmul_gpu_bf16(rows):
    q, s = _int8(1000, 4096, seed=14)
    packed, scales, zeros = _int4(1000, 4096, 128, seed=15)
    x = _x((rows, 4096), torch.bfloat16, seed=16)
    out8 = w8a16_matmul(x, q, s.bfloat16())
    assert relative_error(out8, w8a16_matmul_ref(x.double(), q, s.bfloat16())) < 2e-2
    args = (packed, scales.bfloat16(), zeros.bfloat16(), 128)
    assert relative_error(w4a16_matmul(x, *args), w4a16_matmul_ref(x.double(), *args)) < 2e-2
