import pytest
import torch

from labkit.experiments.parallelism.formats import Int8MMLinear, layer_shapes, measure


@pytest.mark.parametrize("m,k,n", [(3, 40, 24), (17, 72, 56), (33, 136, 8)])
def test_int_mm_path_matches_the_float_linear(m, k, n):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k)
    out = Int8MMLinear(lin)(x)
    ref = x.double() @ lin.weight.double().T
    assert out.shape == (m, n)
    assert ((out.double() - ref).norm() / ref.norm()) < 2e-2  # int8 weights and activations


def test_layer_shapes_of_the_8b():
    assert layer_shapes("llama-3-8b") == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_measure_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        measure()
