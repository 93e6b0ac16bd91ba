"""LoRA and QLoRA layers against their formula, what trains, merging, and bad input."""

import copy

import pytest
import torch
from torch import nn

from labkit.evaluate import relative_error
from labkit.finetune.lora import (
    LLAMA_LINEARS,
    LoRALinear,
    apply_lora,
    count_trainable,
    merge_lora,
    quantize_nf4,
    trainable_parameters,
)
from labkit.model import TINY

FP32_TOL = 1e-5


def _random_lora(base, rank, seed):
    layer = LoRALinear(base, rank=rank, alpha=2.5 * rank)
    with torch.no_grad():  # B starts at zero; test on a non-zero update
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=torch.Generator().manual_seed(seed)))
    return layer


@pytest.mark.parametrize("fan_in,fan_out,rank", [(37, 53, 3), (256, 96, 8), (64, 64, 64)])
def test_lora_linear_matches_formula(fan_in, fan_out, rank):
    torch.manual_seed(fan_in)
    base = nn.Linear(fan_in, fan_out, bias=True)
    layer = _random_lora(base, rank, seed=fan_out)
    x = torch.randn(2, 5, fan_in)
    ref = x.double() @ (base.weight.double() + 2.5 * layer.lora_B.double() @ layer.lora_A.double()).T + \
        base.bias.double()
    out = torch.full((2, 5, fan_out), float("nan"))
    out.copy_(layer(x))
    assert relative_error(out, ref) < FP32_TOL
    assert relative_error(layer.delta_weight(), 2.5 * layer.lora_B @ layer.lora_A) < FP32_TOL


def test_lora_starts_as_the_base_model(tiny_model):
    model = copy.deepcopy(tiny_model[0])
    ids = torch.randint(0, TINY.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        apply_lora(model, rank=4)
        assert torch.equal(model(ids).logits, ref)  # B = 0: exactly the pretrained function


def test_nf4_base_matches_dequantized_formula():
    import bitsandbytes.functional as bf

    from labkit.quant.bnb import bnb_nf4_linear

    torch.manual_seed(3)
    base = nn.Linear(192, 80, bias=False)
    q = bnb_nf4_linear(base, double_quant=True, compute_dtype=torch.float32)
    layer = _random_lora(q, rank=6, seed=4)
    x = torch.randn(7, 192)
    w = bf.dequantize_4bit(q.weight.data, q.weight.quant_state).float()  # the weight NF4 actually holds
    ref = x.double() @ (w.double() + 15.0 / 6 * layer.lora_B.double() @ layer.lora_A.double()).T
    assert relative_error(layer(x), ref) < FP32_TOL
    assert relative_error(w, base.weight) < 0.1  # and NF4 is within the int4 bar of the original


def test_qlora_gradients_survive_an_evaluation(tiny_model):
    # bitsandbytes would repack NF4 weights for an inference-only CPU kernel on the first no-grad eval forward
    ids = torch.randint(0, TINY.vocab_size, (2, 21), generator=torch.Generator().manual_seed(6))
    grads = []
    for evaluate_first in (False, True):
        model = apply_lora(quantize_nf4(copy.deepcopy(tiny_model[0]), targets=("q_proj", "up_proj")),
                           targets=("q_proj", "up_proj"))
        for p in trainable_parameters(model):
            with torch.no_grad():
                p.copy_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        if evaluate_first:
            with torch.no_grad():
                model.eval()(ids)
        model.train()(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainable_parameters(model)]))
    assert relative_error(grads[1], grads[0]) < FP32_TOL


def test_only_adapters_train(tiny_model):
    model = apply_lora(copy.deepcopy(tiny_model[0]), rank=8, targets=("q_proj", "v_proj", "down_proj"))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.endswith(("lora_A", "lora_B")) for n in names)
    assert len(names) == 2 * 3 * TINY.num_layers
    ids = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in names), n
    # B = 0 at the start, so A's gradient is zero and B's is not: the update starts in B
    layer = model.model.layers[3].self_attn.q_proj
    assert layer.lora_B.grad.abs().sum() > 0 and layer.lora_A.grad.abs().sum() == 0


def test_trainable_fraction(tiny_model):
    model = apply_lora(copy.deepcopy(tiny_model[0]), rank=8)
    trainable, total = count_trainable(model)
    per_layer = 8 * (2 * (256 + 256) + 2 * (256 + 128) + 3 * (256 + 768))
    assert trainable == TINY.num_layers * per_layer == sum(p.numel() for p in trainable_parameters(model))
    assert total == TINY.num_params + trainable


def test_qlora_counts_logical_weights(tiny_model):
    model = quantize_nf4(copy.deepcopy(tiny_model[0]))
    assert count_trainable(apply_lora(model, rank=2))[1] == TINY.num_params + \
        2 * TINY.num_layers * (2 * 512 + 2 * 384 + 3 * 1024)


def test_merge_gives_the_same_function(tiny_model):
    model = apply_lora(copy.deepcopy(tiny_model[0]), rank=4)
    gen = torch.Generator().manual_seed(5)
    for p in trainable_parameters(model):
        with torch.no_grad():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    ids = torch.randint(0, TINY.vocab_size, (3, 23), generator=gen)
    with torch.no_grad():
        ref = model(ids).logits
        merged = merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert relative_error(merged(ids).logits, ref) < FP32_TOL


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(rank=0), ValueError, "rank"), (dict(rank=65), ValueError, "rank"),
    (dict(alpha=0.0), ValueError, "alpha"), (dict(dropout=1.0), ValueError, "dropout"),
])
def test_bad_lora_args(kwargs, err, match):
    with pytest.raises(err, match=match):
        LoRALinear(nn.Linear(64, 128), **kwargs)


def test_bad_models_and_targets(tiny_model):
    with pytest.raises(TypeError, match="base"):
        LoRALinear(nn.Conv1d(3, 3, 1))
    model = copy.deepcopy(tiny_model[0])
    with pytest.raises(ValueError, match="allowed"):
        apply_lora(model, targets=("qkv_proj",))
    with pytest.raises(ValueError, match="targets"):
        apply_lora(model, targets=())
    with pytest.raises(TypeError, match="model.layers"):
        apply_lora(nn.Linear(4, 4))
    apply_lora(model, targets=("q_proj",))
    with pytest.raises(ValueError, match="once"):
        apply_lora(model, targets=("q_proj",))
    with pytest.raises(TypeError, match="before apply_lora"):
        quantize_nf4(model, targets=("q_proj",))
    with pytest.raises(TypeError, match="once"):
        quantize_nf4(quantize_nf4(copy.deepcopy(tiny_model[0]), targets=("k_proj",)), targets=("k_proj",))
    with pytest.raises(ValueError, match="compute_dtype"):
        quantize_nf4(copy.deepcopy(tiny_model[0]), compute_dtype=torch.int8)
    q = apply_lora(quantize_nf4(copy.deepcopy(tiny_model[0]), targets=("o_proj",)), targets=("o_proj",))
    with pytest.raises(TypeError, match="NF4"):
        merge_lora(q)


def test_all_llama_linears_are_targets():
    assert set(LLAMA_LINEARS) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
