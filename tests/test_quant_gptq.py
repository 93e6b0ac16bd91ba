import pytest
import torch

from labkit.evaluate import relative_error
from labkit.quant.gptq import decoder_layers, gptq_quantize, gptq_quantize_model
from labkit.quant.packing import dequantize_int4, unpack_int4
from labkit.quant.weight_only import Int4Linear, quantize_int4


def _correlated_inputs(m: int, k: int, seed: int) -> torch.Tensor:
    """Activations with correlated features and a few large ones, as in a real layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5)
    x[:, :3] *= 8.0
    return x


@pytest.mark.parametrize("n,k,group", [(96, 256, 128), (33, 96, 32), (40, 192, 64)])
def test_gptq_beats_rtn_on_output_error(n, k, group):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = _correlated_inputs(4 * k, k, seed=k)
    packed, scales, zeros = gptq_quantize(w, x.T @ x, group_size=group)
    assert packed.shape == (n, k // 2) and scales.shape == (n, k // group) == zeros.shape
    assert int(unpack_int4(packed).max()) <= 15 and torch.equal(zeros, zeros.round())
    ref = x @ w.T
    err_gptq = relative_error(x @ dequantize_int4(packed, scales, zeros, group).T, ref)
    err_rtn = relative_error(x @ dequantize_int4(*quantize_int4(w, group), group).T, ref)
    assert err_gptq < 1e-1 and err_gptq < 0.9 * err_rtn


def test_gptq_handles_dead_inputs():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=g)
    x = torch.randn(200, 64, generator=g)
    x[:, 10] = 0.0  # an input that never fires: its column is dropped, the rest stays finite
    packed, scales, zeros = gptq_quantize(w, x.T @ x, group_size=32)
    deq = dequantize_int4(packed, scales, zeros, 32)
    assert torch.isfinite(deq).all() and torch.all(deq[:, 10] == 0)


def test_gptq_bad_input():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="hessian must be"):
        gptq_quantize(w, torch.eye(32), group_size=32)
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize(w, torch.eye(64), group_size=48)
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(w, torch.eye(64), group_size=32, damp=0.0)


def test_gptq_model_replaces_every_decoder_linear(tiny_model):
    model, tok = tiny_model
    import copy

    qmodel = copy.deepcopy(model)
    calib = torch.randint(3, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    gptq_quantize_model(qmodel, calib)
    layers = decoder_layers(qmodel)
    kinds = {type(m).__name__ for layer in layers for m in layer.modules() if "Linear" in type(m).__name__}
    assert kinds == {"Int4Linear"}
    assert type(qmodel.lm_head).__name__ == "Linear"  # not asked for
    assert sum(isinstance(m, Int4Linear) for m in qmodel.modules()) == 7 * len(layers)
    with pytest.raises(ValueError, match="calib must be int64"):
        gptq_quantize_model(copy.deepcopy(model), calib.float())
