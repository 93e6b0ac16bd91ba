import pytest
import torch
from torch import nn

from labkit.evaluate import relative_error
from labkit.quant.bnb import bnb_int8_linear, bnb_nf4_linear, bnb_tensors

pytest.importorskip("bitsandbytes")
INT8_TOL, INT4_TOL = 2e-2, 1e-1


def _layer(n, k, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=True)
    nn.init.normal_(lin.weight, std=k**-0.5)  # NF4's levels are normal quantiles; trained weights look normal
    return lin, torch.randn(4, k)


@pytest.mark.parametrize("n,k", [(48, 64), (100, 256)])
def test_llm_int8_within_tolerance(n, k):
    lin, x = _layer(n, k, seed=n)
    q = bnb_int8_linear(lin, threshold=6.0)
    assert q.weight.dtype == torch.int8 and q.state.threshold == 6.0
    assert [t.shape for t in bnb_tensors(q)] == [(n,)]  # SCB: one scale per output row
    with torch.no_grad():
        assert relative_error(q(x).float(), lin(x)) < INT8_TOL


@pytest.mark.parametrize("n,k,double_quant", [(48, 64, True), (100, 256, True), (64, 128, False)])
def test_nf4_within_tolerance(n, k, double_quant):
    lin, x = _layer(n, k, seed=k)
    q = bnb_nf4_linear(lin, double_quant=double_quant)
    assert q.weight.dtype == torch.uint8 and q.weight.numel() == n * k // 2
    assert q.weight.quant_state.nested is double_quant
    with torch.no_grad():
        assert relative_error(q(x).float(), lin(x)) < INT4_TOL


def test_bad_input():
    with pytest.raises(ValueError, match="threshold"):
        bnb_int8_linear(nn.Linear(8, 8), threshold=-1.0)
    with pytest.raises(ValueError, match="blocksize"):
        bnb_nf4_linear(nn.Linear(8, 8), blocksize=48)
