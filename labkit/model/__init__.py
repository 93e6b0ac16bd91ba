"""labkit's own decoder (gpt-fast / nano-vllm style): one plain implementation of the Llama family and its
relatives (Mistral, Qwen2, Qwen3, Gemma, Phi-3), with the families' features behind ``ModelConfig``, which also
sizes a model (parameters, bytes, FLOPs, KV bytes; the presets); one way to build a model from each source
(``labkit.model.build``).

    from labkit.model import load_checkpoint, ModelInput
    model = load_checkpoint("path/to/hf-checkpoint", device="cuda", dtype="bf16")
    logits = model(input_ids)                                   # [batch, T, vocab], like HF's
    cache = model.make_cache(num_blocks=1024)                   # a labkit.kvcache.PagedKVCache
    seq = SeqBlocks(prompt)                                     # from labkit.kvcache: tokens, blocks, computed
    cache.allocate(seq)
    inp = ModelInput.build(cache, [seq], [len(prompt)])         # the step: its uncomputed tokens
    last = model.forward_paged(inp, cache)                      # [num_seqs, vocab] float32
    cache.mark_computed(seq, len(prompt))

``FusionPlan`` says which kernel runs each op of ``forward_paged``: ``model.use(kernels, cache)`` (the engine's
``kernels``) resolves it once and returns the model over the same weights with that frozen ``plan``; the weight layout
(merged q/k/v, gate/up) is chosen when the model is built. A ``KernelLog`` handed to a step
(``ModelInput.kernel_log``, ``ModelRunner(kernel_log=...)``) records which kernel ran.
"""

from labkit.kernels.common import KernelCall, KernelLog
from labkit.model.attention import ModelInput, cached_attention, causal_attention, pack_step
from labkit.model.build import adopt_hf_model, from_config, load_checkpoint, load_model, random_model
from labkit.model.config import FAMILIES, MODEL_TYPES, ROPE_TYPES, ModelConfig, RopeScaling
from labkit.model.fusion import KERNEL_NAMES, KERNELS, FusionPlan
from labkit.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from labkit.model.loader import MERGED, Checkpoint, load_weights, weight_sources
from labkit.model.model import CausalLM, Transformer
from labkit.model.presets import PRESETS, TINY, get_config
from labkit.model.rotary import RotaryEmbedding, inv_frequencies, rotate
from labkit.model.shapes import DTYPE_BYTES, count_parameters, dtype_bytes, dtype_name, human_bytes

__all__ = [
    "DTYPE_BYTES", "FAMILIES", "KERNELS", "KERNEL_NAMES", "MERGED", "MODEL_TYPES", "PRESETS", "ROPE_TYPES", "TINY",
    "MLP", "Attention", "CausalLM", "Checkpoint", "DecoderLayer", "FusionPlan", "KernelCall", "KernelLog",
    "ModelConfig", "ModelInput", "RMSNorm", "RopeScaling", "RotaryEmbedding", "Transformer", "adopt_hf_model",
    "cached_attention", "causal_attention", "count_parameters", "dtype_bytes", "dtype_name", "from_config",
    "get_config", "human_bytes", "inv_frequencies", "load_checkpoint", "load_model", "load_weights", "pack_step",
    "random_model", "rotate", "weight_sources",
]
