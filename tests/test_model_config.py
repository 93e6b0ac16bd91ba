"""ModelConfig from HF configs (v5 objects and v4-style config.json dicts), RoPE tables against HF's own
functions, every refused family and feature with an error naming it, and FusionPlan's validation."""

import pytest
import torch
from transformers import GemmaConfig, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from labkit.model import FusionPlan, ModelConfig, RopeScaling, inv_frequencies
from labkit.model.rotary import RotaryEmbedding

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
RAW = dict(model_type="llama", **TINY)  # a config.json's keys


def test_fields_from_each_family():
    c = ModelConfig.from_hf(LlamaConfig(**TINY, tie_word_embeddings=True, attention_bias=True))
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.tie_word_embeddings and c.qkv_bias and c.o_bias and not c.mlp_bias and c.rope_scaling is None
    q2 = ModelConfig.from_hf(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert (q2.qkv_bias, q2.o_bias) == (True, False)
    assert [q2.window(i) for i in range(2)] == [None, 8]
    assert ModelConfig.from_hf(Qwen2Config(**TINY, sliding_window=8)).window(1) is None  # use_sliding_window off
    q3 = ModelConfig.from_hf(Qwen3Config(**TINY, head_dim=32))
    assert q3.qk_norm and q3.head_dim == 32 and q3.q_size == 128
    g = ModelConfig.from_hf(GemmaConfig(**TINY, head_dim=16))
    assert (g.norm_offset, g.embed_scale, g.hidden_act, g.tie_word_embeddings) == (1.0, 8.0, "gelu_pytorch_tanh", True)
    p = ModelConfig.from_hf(Phi3Config(**TINY, partial_rotary_factor=0.5, sliding_window=7))
    assert p.fused_checkpoint and p.rotary_dim == 8 and p.window(0) == p.window(1) == 7


def test_v4_config_json_keys():
    """config.json of transformers 4.x: rope_scaling with 'type', rope_theta at the top, Gemma's 'gelu'."""
    c = ModelConfig.from_dict({**RAW, "rope_theta": 500000.0, "eos_token_id": [1, 9],
                               "rope_scaling": {"type": "linear", "factor": 4.0}, "torch_dtype": "bfloat16"})
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling("linear", factor=4.0)
    assert c.eos_token_ids == (1, 9) and c.dtype == "bfloat16"
    l3 = ModelConfig.from_dict({**RAW, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}})
    assert l3.rope_scaling.original_max_position_embeddings == 8192
    assert ModelConfig.from_dict({**RAW, "model_type": "gemma", "hidden_act": "gelu"}).hidden_act == \
        "gelu_pytorch_tanh"


ROPES = {
    "default": None,
    "linear": dict(rope_type="linear", factor=2.5),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.7,
                        mscale_all_dim=1.0, beta_fast=16.0, truncate=False),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_inverse_frequencies_equal_hf(kind):
    rope = None if ROPES[kind] is None else {**ROPES[kind], "rope_theta": 10000.0}
    hf = LlamaConfig(**TINY, rope_parameters=rope)
    inv, scale = inv_frequencies(ModelConfig.from_hf(hf))
    if rope is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    assert torch.equal(inv, ref) and scale == ref_scale


def test_dynamic_rope_tables_equal_hf_past_max_positions():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(**{**TINY, "max_position_embeddings": 16},
                         rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    ours = RotaryEmbedding(ModelConfig.from_hf(hf_cfg))
    for n in (9, 16, 23, 40):
        pos = torch.arange(n)[None]
        cos, sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), pos)
        c, s = ours(pos)
        assert torch.allclose(c, cos, atol=1e-6) and torch.allclose(s, sin, atol=1e-6), n


REFUSED = {
    "model_type='gpt2' needs GPT-2's keys": dict(model_type="gpt2"),
    "model_type='mixtral'": dict(model_type="mixtral"),
    "'longrope'": dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 8,
                                            long_factor=[2.0] * 8)),
    "'proportional'": dict(rope_parameters=dict(rope_type="proportional", rope_theta=1e4)),
    "quantization_config": dict(quantization_config={"quant_method": "gptq", "bits": 4}),
    "use_bidirectional_attention": dict(model_type="gemma", use_bidirectional_attention=True),
    "final_logit_softcapping": dict(model_type="gemma", final_logit_softcapping=30.0),
    "num_local_experts": dict(num_local_experts=8),
    "partial_rotary_factor": dict(partial_rotary_factor=0.5),
    "hidden_act='relu'": dict(hidden_act="relu"),
    "layer type 'chunked_attention'": dict(model_type="qwen2", layer_types=["full_attention",
                                                                            "chunked_attention"]),
    "per-layer-type rope_parameters": dict(model_type="qwen2", layer_types=["full_attention", "sliding_attention"],
                                           rope_parameters={"full_attention": {"rope_theta": 1e4}}),
    "parameters ['foo']": dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4, foo=1)),
    "num_heads=4 must be a multiple of num_kv_heads=3": dict(num_key_value_heads=3),
    "needs low_freq_factor < high_freq_factor": dict(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, rope_theta=1e4)),
}


@pytest.mark.parametrize("needle", list(REFUSED))
def test_unsupported_is_refused_by_name(needle):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict({**RAW, **REFUSED[needle]})
    assert needle in str(e.value)


def test_from_pretrained_refuses_before_hf_parses(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "my_custom_lm"}')
    with pytest.raises(ValueError, match="model_type='my_custom_lm'"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path / "nowhere")


def test_fusion_plan_validation_and_fit():
    assert FusionPlan.for_device("cpu") == FusionPlan()
    with pytest.raises(ValueError, match="norm='cuda'"):
        FusionPlan(norm="cuda")
    with pytest.raises(ValueError, match="gemv_pdl=1"):
        FusionPlan(gemv_pdl=1)
    with pytest.raises(ValueError, match="rope_cache_write=True needs rope='triton'"):
        FusionPlan(rope_cache_write=True)
    with pytest.raises(ValueError, match="qkv_rope_cache=True needs quant_epilogues"):
        FusionPlan(qkv_rope_cache=True)
    full = FusionPlan(norm="triton", rope="triton", attention="triton", activation="triton", rope_cache_write=True,
                      quant_epilogues=True, qkv_rope_cache=True, gemv_pdl=True)
    assert full == FusionPlan.triton() == FusionPlan.named("triton", "cpu") and full.uses_triton
    assert FusionPlan.named("auto", "cpu") == FusionPlan.named("torch", "cpu") == FusionPlan()
    with pytest.raises(ValueError, match="kernels='cuda' is unknown"):
        FusionPlan.named("cuda", "cpu")
    llama = ModelConfig.from_dict(RAW)
    full.check(llama)
    assert full.fit(llama) == full
    gemma = ModelConfig.from_dict({**RAW, "model_type": "gemma"})
    with pytest.raises(ValueError, match="norm: gemma's RMSNorm is x \\* \\(1 \\+ w\\)"):
        full.check(gemma)
    g = full.fit(gemma)
    assert (g.norm, g.activation, g.quant_epilogues, g.qkv_rope_cache, g.gemv_pdl) == \
        ("torch", "torch", False, False, False)
    assert g.attention == "triton" and g.rope_cache_write
    mistral = ModelConfig.from_dict({**RAW, "model_type": "mistral", "sliding_window": 8})
    m = full.fit(mistral)
    assert (m.attention, m.norm) == ("torch", "triton")
    phi = ModelConfig.from_dict({**RAW, "model_type": "phi3", "partial_rotary_factor": 0.5})
    assert (full.fit(phi).rope, full.fit(phi).rope_cache_write) == ("torch", False)
    qwen3 = ModelConfig.from_dict({**RAW, "model_type": "qwen3"})
    assert not full.fit(qwen3).qkv_rope_cache and full.fit(qwen3).quant_epilogues
    with pytest.raises(ValueError, match="bf16"):
        FusionPlan(attention="triton").check(llama, "cpu", torch.bfloat16)


def test_gpt2_is_sized_but_never_built():
    from transformers import GPT2Config

    from labkit.model import CausalLM, get_config

    cfg = get_config(GPT2Config(vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=64))
    assert cfg.model_type == "gpt2" and not cfg.gated_mlp and cfg.learned_positions
    with pytest.raises(ValueError, match="model_type='gpt2' is sized by ModelConfig but has no labkit.model decoder"):
        CausalLM(cfg)
