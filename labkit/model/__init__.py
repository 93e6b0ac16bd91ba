"""labkit's own decoder (gpt-fast / nano-vllm style): one plain implementation of the Llama family and its
relatives (Mistral, Qwen2, Qwen3, Gemma, Phi-3), with the families' features behind ``ModelConfig``.

    from labkit.model import load_checkpoint, ModelInput
    model = load_checkpoint("path/to/hf-checkpoint", device="cuda", dtype="bf16")
    logits = model(input_ids)                                   # [batch, T, vocab], like HF's
    cache = model.make_cache(num_blocks=1024)                   # a labkit.kvcache.PagedKVCache
    seq = SeqBlocks(prompt)                                     # from labkit.kvcache: tokens, blocks, computed
    cache.allocate(seq)
    inp = ModelInput.build(cache, [seq], [len(prompt)])         # the step: its uncomputed tokens
    last = model.forward_paged(inp, cache)                      # [num_seqs, vocab] float32
    cache.mark_computed(seq, len(prompt))

``FusionPlan`` says which kernel runs each op of ``forward_paged`` (``model.use(plan)``; the engine's ``kernels``);
``adopt_hf_model`` wraps an HF model in memory, sharing its weights (what the engine does with one).
"""

from labkit.model.adopt import adopt_hf_model
from labkit.model.attention import ModelInput, causal_attention, pack_step, paged_attention
from labkit.model.config import FAMILIES, ROPE_TYPES, ModelConfig, RopeScaling
from labkit.model.fusion import KERNEL_NAMES, KERNELS, FusionPlan
from labkit.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from labkit.model.loader import (
    MERGED,
    Checkpoint,
    empty_model,
    from_config,
    load_checkpoint,
    load_hf_model,
    load_weights,
    weight_sources,
)
from labkit.model.model import CausalLM, Transformer
from labkit.model.rope import RotaryEmbedding, apply_rope, inv_frequencies

__all__ = [
    "FAMILIES", "KERNELS", "KERNEL_NAMES", "MERGED", "ROPE_TYPES", "MLP", "Attention", "CausalLM", "Checkpoint",
    "DecoderLayer", "FusionPlan", "ModelConfig", "ModelInput", "RMSNorm", "RopeScaling", "RotaryEmbedding",
    "Transformer", "adopt_hf_model", "apply_rope", "causal_attention", "empty_model", "from_config",
    "inv_frequencies", "load_checkpoint", "load_hf_model", "load_weights", "pack_step", "paged_attention",
    "weight_sources",
]
