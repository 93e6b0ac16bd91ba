"""Swap a Hugging Face Llama model's RMSNorm, MLP activation and attention for labkit's Triton kernels.

``patch_model(model)`` changes, in place and reversibly (``unpatch``):

* every RMSNorm (``LlamaRMSNorm`` and look-alikes: a ``weight`` and a ``variance_epsilon``) -> ``rms_norm``;
* every decoder layer's ``residual + attention`` followed by ``post_attention_layernorm`` -> one fused
  ``rms_norm(..., residual=...)`` (one pass instead of two);
* every MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` -> ``silu_and_mul(gate_proj(x), up_proj(x))`` (the
  projections stay whatever modules they are: plain, quantised, ...);
* attention -> ``flash_attention``, registered with transformers' ``AttentionInterface`` as ``labkit_triton``
  together with the boolean mask builder of its ``sdpa`` path, so padded batches and static caches get the
  same masks SDPA would (``None`` where plain causal attention is exact).

Only instance attributes are set, so other models of the same class are untouched and ``unpatch`` simply
removes them. Rounding follows the modules replaced (see ``rms_norm`` and ``silu_and_mul``), which is why the
patched embedded model's greedy output matches the original token for token in float32.
"""

from __future__ import annotations

import types

import torch

from labkit.kernels.flash_attention import flash_attention
from labkit.kernels.rms_norm import rms_norm
from labkit.kernels.silu_and_mul import silu_and_mul

ATTN_IMPLEMENTATION = "labkit_triton"
_STATE = "_labkit_patch"


def triton_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function: ``query`` ``[B, H, S, D]``, ``key``/``value``
    ``[B, H_kv, T, D]``, boolean ``attention_mask`` ``[B, 1, S, T]`` or ``None`` (plain causal). Returns the
    output as ``[B, S, H, D]`` and no attention weights (they are never materialised)."""
    if dropout and module.training:
        raise ValueError(f"dropout={dropout}: labkit's flash_attention is inference-only; call model.eval()")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask has dtype {attention_mask.dtype}; the labkit_triton implementation "
                         "takes the boolean masks of transformers' sdpa mask builder")
    causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = flash_attention(query, key, value, causal=causal, scale=scaling, attn_mask=attention_mask)
    return out.transpose(1, 2), None


def register_attention() -> str:
    """Register ``labkit_triton`` with transformers' attention and mask interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, triton_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTN_IMPLEMENTATION


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _decoder_layer_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                           position_embeddings=None, **kwargs) -> torch.Tensor:
    """Llama's decoder layer with the mid-layer residual add fused into the second RMSNorm. Extra keyword
    arguments (the cache, under whichever name this transformers version uses) pass through to attention."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, position_embeddings=position_embeddings,
                                      **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, residual = rms_norm(hidden_states, norm.weight, norm.variance_epsilon, residual=residual)
    return residual + self.mlp(hidden_states)


def _is_rms_norm(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight") and hasattr(m, "variance_epsilon")


def _is_swiglu_mlp(m: torch.nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
    return silu and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))


def _is_llama_layer(m: torch.nn.Module) -> bool:
    return (type(m).__name__.endswith("DecoderLayer")
            and all(hasattr(m, n) for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))
            and _is_rms_norm(m.post_attention_layernorm))


def patch_model(model: torch.nn.Module, attention: bool = True, norms: bool = True, mlp: bool = True):
    """Patch ``model`` (a Hugging Face Llama-family causal LM) in place; returns it. Patching twice is a no-op.

    ``attention``, ``norms``, ``mlp`` choose what is swapped (``norms`` includes the fused residual add).
    Raises ``ValueError`` for a model with none of the Llama modules (e.g. GPT-2).
    """
    if getattr(model, _STATE, None) is not None:
        return model
    patched: list[torch.nn.Module] = []

    def swap(m: torch.nn.Module, fn) -> None:
        m.forward = types.MethodType(fn, m)
        patched.append(m)

    found = {"norm": 0, "mlp": 0, "layer": 0}
    for m in model.modules():
        if norms and _is_rms_norm(m):
            swap(m, _rms_norm_forward)
            found["norm"] += 1
        elif mlp and _is_swiglu_mlp(m):
            swap(m, _mlp_forward)
            found["mlp"] += 1
        elif norms and _is_llama_layer(m):
            swap(m, _decoder_layer_forward)
            found["layer"] += 1
    config = getattr(model, "config", None)
    prev_attn = getattr(config, "_attn_implementation", None)
    if attention:
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise ValueError("attention=True needs a Hugging Face PreTrainedModel (it sets attn_implementation)")
        model.set_attn_implementation(register_attention())
    if not any(found.values()) and not attention:
        raise ValueError(f"{type(model).__name__} has no Llama-style RMSNorm, SwiGLU MLP or decoder layer to patch")
    setattr(model, _STATE, {"modules": patched, "attn": prev_attn, "found": found, "attention": attention})
    return model


def unpatch(model: torch.nn.Module):
    """Undo ``patch_model``: the original forwards and attention implementation come back. Returns ``model``."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    for m in state["modules"]:
        del m.forward  # the instance attribute shadowed the class's forward
    if state["attention"]:
        model.set_attn_implementation(state["attn"] or "sdpa")
    delattr(model, _STATE)
    return model


def patch_summary(model: torch.nn.Module) -> dict:
    """What ``patch_model`` swapped: counts of norms, MLPs and decoder layers, and the attention function."""
    state = getattr(model, _STATE, None)
    if state is None:
        return {"patched": False}
    return {"patched": True, **state["found"],
            "attention": ATTN_IMPLEMENTATION if state["attention"] else state["attn"]}
