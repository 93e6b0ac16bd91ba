"""The peer kernels a quantised layer can take (``labkit.quant.peers``): built from labkit's own codes and scales,
each computes the layer's product; the CPU runs torch's tinygemm and ``_int_mm`` kernels and labkit's fused FP8
path, and says clearly why a GPU-only peer cannot run."""

import pytest
import torch
from torch import nn

from labkit.evaluate import relative_error
from labkit.quant import Fp8Linear, Int4Linear, Int8Linear
from labkit.quant.peers import (
    LABKIT_PATHS,
    PEERS,
    PeerUnavailable,
    build_peer,
    engine_paths,
    layer_format,
    tinygemm_weights,
)


def _lin(n, k, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data.normal_(0, 0.02)
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(48, 256, 128), (96, 384, 64), (32, 256, 32)])
def test_tinygemm_holds_the_layers_int4_weights(dtype, n, k, group):
    """tinygemm's ``w = (q - 8) * scale + zero'`` with ``zero' = (8 - zero) * scale`` is labkit's ``(q - zero) *
    scale``: the product of the layer's own dequantised weights, within the activations' rounding."""
    layer = Int4Linear.from_linear(_lin(n, k), group)
    fn = build_peer("torch._weight_int4pack_mm (tinygemm)", layer)
    x = torch.randn(5, k).to(dtype)
    ref = x.double() @ layer.dequantize(torch.float64).T
    assert relative_error(fn(x), ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    packed, sz = tinygemm_weights(layer)
    assert sz.shape == (k // group, n, 2)


def test_tinygemm_refuses_shapes_it_cannot_pack():
    with pytest.raises(PeerUnavailable, match="tinygemm takes"):
        build_peer("torch._weight_int4pack_mm (tinygemm)", Int4Linear.from_linear(_lin(40, 200), 40))


@pytest.mark.parametrize("m", [3, 17, 40])
def test_int_mm_w8a8_on_the_layers_codes(m):
    """W8A8 through ``torch._int_mm`` on the layer's int8 codes (activations quantised per token; padded below 17
    rows): within int8's bound of the layer's product."""
    layer = Int8Linear.from_linear(_lin(56, 72))
    fn = build_peer("torch._int_mm W8A8 (cuBLAS)", layer)
    x = torch.randn(m, 72)
    out = fn(x)
    assert out.shape == (m, 56)
    assert relative_error(out, x.double() @ layer.dequantize(torch.float64).T) < 2e-2


def test_fused_fp8_is_the_layers_scaled_mm():
    layer = Fp8Linear.from_linear(_lin(48, 64), backend="emulated")
    fn = build_peer("Fp8Linear fused (Triton act quant + _scaled_mm)", layer)
    eager = build_peer(LABKIT_PATHS["fp8"], layer)
    x = torch.randn(7, 64)
    try:
        want = eager(x)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    assert torch.equal(fn(x), want)
    assert relative_error(fn(x), layer(x)) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_gpu_only_peers_say_why():
    for name, p in PEERS.items():
        if p.cuda_only:
            layer = {"int8": Int8Linear, "int4": Int4Linear}.get(p.fmt)
            layer = layer.from_linear(_lin(64, 256)) if layer else Fp8Linear.from_linear(_lin(64, 256), "emulated")
            with pytest.raises(PeerUnavailable, match="CUDA only"):
                build_peer(name, layer)


def test_registry_and_bad_input():
    assert engine_paths("int4")[0] == LABKIT_PATHS["int4"] and "torch._weight_int4pack_mm (tinygemm)" in \
        engine_paths("int4")
    assert all(PEERS[n].fmt == f for f in ("int8", "int4", "fp8") for n in engine_paths(f)[1:])
    assert layer_format(Int8Linear.from_linear(_lin(8, 16))) == "int8" and layer_format(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="unknown"):
        build_peer("marlin", Int8Linear.from_linear(_lin(8, 16)))
    with pytest.raises(ValueError, match="built from a Int4Linear"):
        build_peer("torch._weight_int4pack_mm (tinygemm)", Int8Linear.from_linear(_lin(8, 16)))
    with pytest.raises(ValueError, match="unknown"):
        engine_paths("nf4")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in PEERS])
def test_cuda_peers_compute_the_layers_product(name):
    """Every peer on the GPU (gemlite where installed), bf16 activations, at 1, 16 and 64 rows: the layer's
    product within its format's bound."""
    fmt = PEERS[name].fmt
    lin = _lin(512, 1024).cuda().bfloat16()
    layer = {"int8": lambda: Int8Linear.from_linear(lin), "int4": lambda: Int4Linear.from_linear(lin),
             "fp8": lambda: Fp8Linear.from_linear(lin)}[fmt]()
    try:
        fn = build_peer(name, layer)
    except PeerUnavailable as e:
        pytest.skip(str(e))
    for m in (1, 16, 64):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ layer.dequantize(torch.float64).T
        assert relative_error(fn(x), ref) < {"int8": 2e-2, "int4": 1e-1, "fp8": 1e-1}[fmt]
