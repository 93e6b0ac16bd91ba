"""Named shapes: the embedded model's (``TINY``) and the full-size architectures the speed measurements use.

Two scales, one code path (DESIGN.md): accuracy is measured on the embedded model, trained by this project and
shipped in ``data/``; speed on real architectures at full size with random weights (``from_config("llama-3-8b")``,
``random_model("llama-3-8b")``), because speed does not depend on weight values. ``get_config`` gives the
``ModelConfig`` of a preset name, an HF model or config, or a ``ModelConfig`` itself.
"""

from __future__ import annotations

from labkit.checks import ArgumentTypeError
from labkit.model.config import ModelConfig

TINY = ModelConfig(name="tiny", vocab_size=8192, hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2,
                   intermediate_size=768, tie_word_embeddings=True, max_position_embeddings=2048,
                   rope_theta=10000.0, rms_norm_eps=1e-5)
"""The embedded model's shape; kept in step with data/pydocs-llama/config.json by a test."""

PRESETS: dict[str, ModelConfig] = {
    "tiny": TINY,
    "llama-2-7b": ModelConfig(name="llama-2-7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=32, intermediate_size=11008, max_position_embeddings=4096,
                              rope_theta=10000.0, rms_norm_eps=1e-5),
    "llama-3-8b": ModelConfig(name="llama-3-8b", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, intermediate_size=14336, max_position_embeddings=8192,
                              rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama-3-70b": ModelConfig(name="llama-3-70b", vocab_size=128256, hidden_size=8192, num_layers=80,
                               num_heads=64, num_kv_heads=8, intermediate_size=28672, max_position_embeddings=8192,
                               rope_theta=500000.0, rms_norm_eps=1e-5),
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads of 128, 2048 context; its
    # matrices, embeddings and norm weights (biases and the position table, 0.2% of it, are left out)
    "gpt3-175b": ModelConfig(model_type="gpt2", name="gpt3-175b", vocab_size=50257, hidden_size=12288,
                             num_layers=96, num_heads=96, intermediate_size=4 * 12288, gated_mlp=False,
                             tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=0.0,
                             rms_norm_eps=1e-5, hidden_act="gelu_new"),
}
"""Named shapes by name."""


def get_config(preset_or_model, name: str = "preset_or_model") -> ModelConfig:
    """The ``ModelConfig`` of a preset name (``PRESETS``), a Hugging Face model or config (or its dict), a
    ``labkit.model.CausalLM``, or a ``ModelConfig`` itself; an error names the caller's argument ``name``."""
    if isinstance(preset_or_model, ModelConfig):
        return preset_or_model
    if isinstance(preset_or_model, str):
        if preset_or_model not in PRESETS:
            raise ValueError(f"{name}={preset_or_model!r} is unknown; allowed: {sorted(PRESETS)}, a Hugging Face "
                             f"model or config, or a ModelConfig")
        return PRESETS[preset_or_model]
    config = getattr(preset_or_model, "config", preset_or_model)
    if isinstance(config, ModelConfig):
        return config
    if not (isinstance(config, dict) or hasattr(config, "to_dict")):
        raise ArgumentTypeError(f"{name}={preset_or_model!r:.60}: cannot read a ModelConfig from "
                                f"{type(preset_or_model).__name__}; pass a preset name ({sorted(PRESETS)}), a "
                                f"Hugging Face model or config, or a ModelConfig")
    return ModelConfig.from_hf(config)
