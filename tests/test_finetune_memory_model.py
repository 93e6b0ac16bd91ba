"""The training memory model against counted tensors and measured peaks on small configurations."""

import math

import pytest
import torch

from labkit.experiments.finetuning import live_tensor_bytes, measure_step_memory
from labkit.finetune import (
    TrainSetup,
    activation_bytes,
    inference_memory,
    nf4_bytes,
    optimizer_bytes,
    param_inventory,
    training_memory,
)
from labkit.finetune.train import prepare_model
from labkit.model import PRESETS, TINY, ModelConfig, random_model

BAR = 0.15  # the bar on finetune.memory_model_rel_err
# irregular: 3 heads over 1 KV head, odd vocabulary and intermediate sizes, untied head
ODD = ModelConfig(name="odd", vocab_size=509, hidden_size=192, num_layers=3, num_heads=3, num_kv_heads=1,
                  intermediate_size=520, tie_word_embeddings=False, max_position_embeddings=512)


def _odd_model(seed=0):
    return random_model(ODD, device="cpu", dtype=torch.float32, seed=seed)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_inventory_counts_every_parameter(name):
    spec = PRESETS[name]
    assert sum(p.numel for p in param_inventory(spec)) == spec.num_params


def test_inventory_matches_hf_model():
    model = _odd_model()
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    assert shapes == sorted(p.shape for p in param_inventory(ODD))


@pytest.mark.parametrize("numel", [256 * 64, 509 * 192, 520 * 192 + 64])
def test_nf4_bytes_match_bitsandbytes(numel):
    from labkit.quant.bnb import bnb_nf4_linear

    torch.manual_seed(numel)
    lin = torch.nn.Linear(numel // 64, 64, bias=False)
    q = bnb_nf4_linear(lin, double_quant=True)
    assert live_tensor_bytes(q) == nf4_bytes(lin.weight.numel())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "sgd"])
def test_optimizer_bytes_match_allocated_state(optimizer):
    from labkit.finetune.train import make_optimizer

    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3000,), (70, 90), (4097,), (33, 257)]]
    opt = make_optimizer(params, optimizer, lr=1e-3)
    sum(p.square().sum() for p in params).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # live_tensor_bytes(opt) counts the optimizer's state only (parameters are not in opt.state)
    assert live_tensor_bytes(opt) == optimizer_bytes([p.numel() for p in params], optimizer)


def _saved_bytes(model, setup, batch):
    """Bytes autograd saves in one forward (distinct storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.precision == "bf16-mixed"):
            model(input_ids=batch, labels=batch, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("method,precision,base", [
    ("full", "fp32", "fp32"), ("full", "bf16-mixed", "fp32"), ("lora", "fp32", "fp32"),
    ("lora", "bf16-mixed", "fp32"), ("qlora", "bf16-mixed", "fp32"), ("lora", "bf16-mixed", "bf16"),
    ("qlora", "bf16-mixed", "bf16"),
])
def test_saved_activations_counted_tensor_by_tensor(method, precision, base):
    # (checkpointing installs saved-tensor hooks of its own; the measured-peak test below covers it)
    setup = TrainSetup(method=method, precision=precision, base_dtype=base, batch_size=2, seq_len=40,
                       device="cpu")
    model = prepare_model(_odd_model(), setup)
    batch = torch.randint(0, ODD.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    predicted = sum(activation_bytes(ODD, setup).values()) + 8 * batch.numel()  # + the labels' shifted copy
    measured = _saved_bytes(model, setup, batch)
    # LoRA's first-layer adapters keep bf16 copies of A that the model counts for every layer: a few hundred bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


@pytest.mark.parametrize("method,precision,checkpointing,optimizer,batch,seq", [
    ("full", "fp32", False, "adamw", 4, 96),          # activations dominate: the head's backward
    ("full", "fp32", False, "adamw", 1, 8),           # gradients dominate: the end of backward
    ("full", "bf16-mixed", True, "adamw8bit", 2, 64),
    ("lora", "fp32", True, "adamw", 2, 96),           # checkpointing: one layer recomputed
    ("lora", "bf16-mixed", False, "adamw8bit", 2, 64),
    ("lora-bf16", "bf16-mixed", False, "sgd", 3, 50),
    ("qlora-bf16", "bf16-mixed", True, "adamw8bit", 2, 64),
])
def test_peak_matches_measured(method, precision, checkpointing, optimizer, batch, seq):
    method, _, base = method.partition("-")
    setup = TrainSetup(method=method, precision=precision, checkpointing=checkpointing, optimizer=optimizer,
                       batch_size=batch, seq_len=seq, device="cpu", base_dtype=base or "fp32")
    model = prepare_model(_odd_model(), setup)
    ids = torch.randint(0, ODD.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
    measured = measure_step_memory(model, setup, ids)
    predicted = training_memory(ODD, setup)
    # the state that lives across steps is counted exactly; the peak on top of it within the bar
    assert sum(predicted.at_peak.values()) == pytest.approx(predicted.peak)
    static = predicted.weights + predicted.optimizer_states + 8 * ids.numel()
    assert static == pytest.approx(measured["live_at_start"], rel=1e-3)  # + the rotary tables (buffers)
    assert abs(predicted.peak - measured["peak"]) / measured["peak"] <= BAR, (predicted.peak_phase, measured)


def test_peak_matches_measured_embedded_model(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model[0])
    setup = TrainSetup(method="lora", precision="bf16-mixed", batch_size=2, seq_len=48, device="cpu")
    prepare_model(model, setup)
    ids = torch.randint(0, TINY.vocab_size, (2, 48), generator=torch.Generator().manual_seed(4))
    measured = measure_step_memory(model, setup, ids)
    assert abs(training_memory(TINY, setup).peak - measured["peak"]) / measured["peak"] <= BAR


def test_sharding_divides_the_right_parts():
    spec = PRESETS["llama-3-8b"]
    base = training_memory(spec, TrainSetup(batch_size=1, seq_len=1024))
    z = {s: training_memory(spec, TrainSetup(batch_size=1, seq_len=1024, zero_stage=s, data_parallel=8))
         for s in (1, 2, 3)}
    assert z[1].optimizer_states == pytest.approx(base.optimizer_states / 8)
    assert z[1].grads == base.grads and z[1].weights == base.weights
    assert z[2].grads == pytest.approx(base.grads / 8) and z[2].weights == base.weights
    assert z[3].weights == pytest.approx(base.weights / 8)
    assert z[1].activations == base.activations == z[3].activations  # data parallelism never splits these
    tp = training_memory(spec, TrainSetup(batch_size=1, seq_len=1024, tensor_parallel=8))
    assert base.weights / 8 < tp.weights < base.weights / 7  # norms are replicated
    assert tp.activations < base.activations / 2


def test_full_finetune_is_16_bytes_per_parameter_plus_activations():
    spec = PRESETS["gpt3-175b"]
    m = training_memory(spec, TrainSetup(batch_size=1, seq_len=2048, checkpointing=True))
    assert (m.weights + m.grads + m.optimizer_states) / spec.num_params == pytest.approx(16.0, rel=1e-6)
    inf = inference_memory(spec, batch_size=1, context_len=2048)
    assert inf.kv_cache == spec.kv_bytes(2048) and m.peak > 7 * inf.peak
    q = training_memory(spec, TrainSetup(method="qlora", batch_size=1, seq_len=2048, checkpointing=True))
    assert q.weights / spec.num_params < 0.6 and q.grads < 1e-3 * m.grads


def test_lora_trains_a_small_fraction():
    full = training_memory(TINY, TrainSetup(method="full"))
    lora = training_memory(TINY, TrainSetup(method="lora", lora_rank=8))
    # per layer r * (in + out) over all seven linears against the whole model
    expected = 8 * TINY.num_layers * (2 * (256 + 256) + 2 * (256 + 128) + 3 * (256 + 768))
    assert lora.grads == 4 * expected and full.grads == 4 * TINY.num_params
    assert math.isclose(lora.optimizer_states, 8 * expected + 4 * 2 * 7 * TINY.num_layers)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="dora"), "method"), (dict(precision="fp16"), "precision"), (dict(optimizer="lion"), "optimizer"),
    (dict(zero_stage=2), "data_parallel"), (dict(zero_stage=4, data_parallel=2), "zero_stage"),
    (dict(batch_size=0), "batch_size"), (dict(lora_rank=0), "lora_rank"), (dict(device="tpu"), "device"),
    (dict(method="lora", lora_targets=()), "lora_targets"), (dict(base_dtype="bf16"), "base_dtype"),
    (dict(method="lora", precision="fp32", base_dtype="bf16"), "base_dtype"), (dict(base_dtype="int8"), "base"),
])
def test_bad_setup(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainSetup(**kwargs)


def test_bad_targets_and_sizes():
    with pytest.raises(ValueError, match="gate_proj"):
        training_memory("gpt3-175b", TrainSetup(method="lora", lora_targets=("gate_proj",)))
    with pytest.raises(ValueError, match="spec='gpt-5' is unknown"):
        training_memory("gpt-5", TrainSetup())
    with pytest.raises(ValueError, match="context_len"):
        inference_memory(TINY, batch_size=1, context_len=0)
