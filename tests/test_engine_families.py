"""The engine on every family labkit.model builds: a tiny random checkpoint made with each family's HF config class,
the engine's greedy output equal to HF ``generate``'s token for token, on the torch plan (the engine given the HF
model in memory: its modules adopted) and on the Triton plan (through the interpreter; the engine given our
loader's ``CausalLM`` of the saved checkpoint; what the kernels cannot run stays on torch: ``FusionPlan.fit``).
A feature labkit.model lacks is refused at load with its name; every EOS id of a checkpoint reaches the model's
config (``ModelConfig.eos_token_ids``)."""

import pytest
import torch
from transformers import GemmaConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from labkit.engine import LLMEngine, SamplingParams
from labkit.model import FusionPlan, adopt_hf_model, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)

FAMILIES = {
    "llama3-rope-tied": (LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama2-mha": (LlamaConfig, dict(num_key_value_heads=4)),
    "mistral-window": (MistralConfig, dict(sliding_window=5)),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, dict(head_dim=16)),
    "gemma": (GemmaConfig, dict(head_dim=16)),
    "phi3": (Phi3Config, dict(partial_rotary_factor=0.5)),
}
PROMPTS = [[3, 17, 99, 5, 42, 8, 61], [120, 4, 4, 77]]  # irregular lengths; prompt + output passes the window


def make_hf(name):
    from transformers import AutoModelForCausalLM

    cls, over = FAMILIES[name]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cls(**{**TINY, **over}), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:  # Gemma initialises its (1 + w) norms at w = 0 and the others at 1: make them count
                p.normal_(1.0 if name != "gemma" else 0.0, 0.1)
    return hf


def hf_greedy(hf, steps):
    return [hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def engine_greedy(model, steps, kernels):
    engine = LLMEngine(model, kernels=kernels, num_blocks=24, block_size=4, max_num_seqs=2, cuda_graphs=False)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=steps, ignore_eos=True), progress=False)
    return engine, [o.output_token_ids for o in outs]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_greedy_equals_hf_generate(name, tmp_path):
    hf = make_hf(name)
    steps = 8
    ref = hf_greedy(hf, steps)
    engine, got = engine_greedy(hf, steps, "torch")
    assert got == ref, name
    assert engine.runner.plan == FusionPlan()
    # the Triton plan on our loader's model of the saved checkpoint (the interpreter: fewer steps)
    hf.save_pretrained(tmp_path)
    engine, got = engine_greedy(load_checkpoint(tmp_path, dtype=torch.float32), 4, "triton")
    assert got == [r[:4] for r in ref], name
    plan = engine.runner.plan
    assert plan.rope_cache_write == (name != "phi3")  # partial rotary: RoPE in torch
    assert plan.attention == ("torch" if name == "mistral-window" else "triton")
    assert plan.norm == ("torch" if name == "gemma" else "triton")


def test_unsupported_feature_is_refused_at_load(tmp_path):
    cfg = Phi3Config(**{**TINY, "rope_scaling": dict(type="longrope", short_factor=[1.0] * 4,
                                                     long_factor=[1.0] * 4, original_max_position_embeddings=16)})
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match="longrope"):
        LLMEngine(hf, num_blocks=8, block_size=4)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="longrope"):
        load_checkpoint(tmp_path)


def test_every_eos_id_reaches_the_model_config(tmp_path):
    """config.json's eos id and generation_config.json's list (Llama 3 Instruct: <|end_of_text|>, <|eot_id|>), in
    order and without repeats, for a checkpoint and for an HF model in memory alike."""
    from transformers import GenerationConfig

    hf = make_hf("llama2-mha")
    hf.config.eos_token_id = 7
    hf.generation_config = GenerationConfig(eos_token_id=[7, 9, 11])
    assert adopt_hf_model(hf).config.eos_token_ids == (7, 9, 11)
    hf.save_pretrained(tmp_path)
    cfg = load_checkpoint(tmp_path).config
    assert cfg.eos_token_ids == (7, 9, 11) and cfg.eos_token_id == 7
