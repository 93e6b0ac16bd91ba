import json

import pytest
import torch

from labkit.data import EMBEDDED_MODEL_DIR
from labkit.model import PRESETS, TINY, ModelConfig, count_parameters, dtype_bytes, get_config, load_model, random_model


def test_llama3_8b_arithmetic():
    s = PRESETS["llama-3-8b"]
    assert s.num_params == 8_030_261_248  # the published 8.03 B
    assert s.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert s.weight_bytes("bf16") == 2 * s.num_params
    # a decode step reads every weight except the (untied) embedding table, which it only indexes
    assert s.decode_weight_bytes("bf16") == 2 * (s.num_params - s.vocab_size * s.hidden_size)


def test_gpt3_175b_kv_and_params():
    s = PRESETS["gpt3-175b"]
    assert s.kv_bytes_per_token("bf16") == 4_718_592
    assert abs(s.num_params / 175e9 - 1) < 0.01


def test_flops_hand_computed():
    s = PRESETS["llama-3-8b"]
    # decode: 2 FLOPs per matmul weight plus QK^T and PV over the context
    ctx = 1000
    assert s.decode_flops_per_token(ctx) == 2 * s.matmul_params + 4 * 32 * 32 * 128 * ctx
    # prefill of n tokens: n times the matmul work, causal attention over (n + 1) / 2 tokens on average
    n = 64
    assert s.prefill_flops(n) == pytest.approx(n * (2 * s.matmul_params + 4 * 32 * 32 * 128 * (n + 1) / 2))


def test_tiny_matches_embedded_checkpoint():
    cfg = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    from transformers import LlamaConfig

    spec = get_config(LlamaConfig(**cfg))
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                  "head_dim", "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rms_norm_eps"):
        assert getattr(spec, field) == getattr(TINY, field), field
    assert TINY.num_kv_heads < TINY.num_heads  # grouped-query attention
    assert 5e6 <= TINY.num_params <= 12e6


def test_embedded_model_loads_and_counts(tiny_model):
    model, tok = tiny_model
    assert count_parameters(model) == TINY.num_params
    assert model.dtype == torch.float32 and not model.training
    ids = tok("The list type", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "The list type"


def test_load_model_logs_the_dtype_it_picks(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="labkit.model.build"):
        model = load_model(dtype="auto")[0]
    assert model.dtype == torch.bfloat16  # the embedded checkpoint stores bfloat16
    assert "torch.bfloat16 on cpu (asked; the checkpoint stores bfloat16)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="labkit.model.build"):
        load_model()
    assert "torch.float32 on cpu (the default; the checkpoint stores bfloat16)" in caplog.text


def test_data_dir_under_budget():
    total = sum(p.stat().st_size for p in EMBEDDED_MODEL_DIR.parent.rglob("*") if p.is_file())
    assert total < 25e6


def test_random_model_shapes_on_meta():
    m = random_model("llama-3-8b", device="meta")
    assert count_parameters(m) == PRESETS["llama-3-8b"].num_params
    small = random_model("llama-3-8b", device="meta", num_layers=2)
    assert small.config.num_hidden_layers == 2


def test_random_model_real_weights_not_zero():
    m = random_model("tiny", device="cpu", dtype="fp32")
    w = m.model.layers[0].self_attn.q_proj.weight
    assert w.std() > 0.01 and torch.isfinite(w).all()


@pytest.mark.parametrize("call,match", [
    (lambda: get_config("llama-9"), "preset_or_model='llama-9' is unknown; allowed"),
    (lambda: random_model("gpt5", device="meta"), "unknown; allowed"),
    (lambda: load_model("/nonexistent/ckpt"), "not a Hugging Face checkpoint directory"),
    (lambda: dtype_bytes("fp7"), "dtype='fp7' is unknown"),
    (lambda: load_model(dtype="int8"), "dtype='int8' is not allowed here"),
    (lambda: load_model(dtype="fp7"), "dtype='fp7' is not allowed here"),
    (lambda: load_model(42), "name_or_path=42 must be a checkpoint directory"),
    (lambda: PRESETS["tiny"].kv_bytes(tokens=-5), "tokens=-5 must be a finite number >= 0"),
    (lambda: PRESETS["tiny"].prefill_flops(prompt_len=-3), "prompt_len=-3 must be a finite number >= 0"),
    (lambda: PRESETS["tiny"].kv_bytes(float("nan")), "tokens=nan"),
    (lambda: get_config(42), "cannot read a ModelConfig from int"),
    (lambda: load_model(device="cuda:0") if not torch.cuda.is_available() else load_model(device="tpu"),
     "device="),
    (lambda: random_model("tiny", device="meta", num_layers=0), "num_layers=0"),
    (lambda: ModelConfig(name="x", vocab_size=10, hidden_size=64, num_layers=1, num_heads=6, num_kv_heads=4,
                         intermediate_size=128), "multiple of num_kv_heads"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()



def _family_configs():
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    small = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama3": LlamaConfig(**small, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32}),
        "llama2-mha": LlamaConfig(**dict(small, num_key_value_heads=4)),
        "llama-bias": LlamaConfig(**small, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        "mistral-window": MistralConfig(**small, sliding_window=16),
        "qwen2": Qwen2Config(**small),
        "qwen3": Qwen3Config(**small, head_dim=16),
        "gemma": GemmaConfig(**small, head_dim=16),
        "phi3": Phi3Config(**small, pad_token_id=0),
        "gpt2": GPT2Config(vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=64),
    }


@pytest.mark.parametrize("family", list(_family_configs()))
def test_spec_counts_every_parameter_of_each_family(family):
    from transformers import AutoModelForCausalLM

    config = _family_configs()[family]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = get_config(config)
    assert spec.num_params == count_parameters(model), family
    linears = sum(m.weight.numel() for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
    assert spec.matmul_params == linears  # the LM head is a Linear, tied to the embedding table or not


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_heads=0), "num_heads=0 must be an int >= 1"),
    (dict(hidden_size=-64), "hidden_size=-64 must be an int >= 1"),
    (dict(vocab_size=10.5), "vocab_size=10.5 must be an int"),
    (dict(num_layers=True), "num_layers=True must be an int"),
    (dict(hidden_size=65), "not a multiple of num_heads"),
    (dict(head_dim=0), "head_dim=0"),
    (dict(rope_theta=float("nan")), "rope_theta=nan"),
    (dict(rope_theta=0.0), "rope_theta=0.0 must be a finite number > 0"),
    (dict(rms_norm_eps=0), "rms_norm_eps=0"),
    (dict(hidden_act="relu"), "hidden_act='relu' is unknown"),
    (dict(model_type="gpt_neox"), "model_type='gpt_neox' is unknown"),
])
def test_spec_refuses_bad_shapes(kwargs, match):
    base = dict(name="x", vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                intermediate_size=128)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **kwargs})
