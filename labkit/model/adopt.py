"""A ``CausalLM`` over the modules of a Hugging Face model in memory, sharing its weights: what the engine runs when
it is given an HF model (``LLMEngine(hf_model, ...)``, ``ModelRunner(hf_model, cache)``).

``load_hf_model`` copies the weights into a new model; ``adopt_hf_model`` takes the HF model's own modules instead
(the embedding, o/down projections and the LM head as they are, the norms' weights), so nothing is held twice and a
model quantised by ``labkit.quant.quantize`` (int8, int4, fp8, bitsandbytes layers) runs with its quantised
layers. q/k/v and gate/up become one merged layer each where ``labkit.quant.concat_linears`` can merge them (plain,
int8 and int4 linears): the HF layers are re-pointed at row slices of the merged weights, so the HF model still
works and still holds its values; where they cannot merge (fp8, bitsandbytes) the model keeps them separate. No HF
module is called by the result's forwards: the HF model only lends its tensors and linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.model.config import ModelConfig
from labkit.model.model import CausalLM
from labkit.quant.weight_only import concat_linears


def eos_ids(hf_model) -> tuple[int, ...]:
    """Every end-of-sequence id of an HF model: its config's and its ``generation_config``'s (either may be a
    list), in that order, without repeats."""
    ids = []
    for src in (hf_model.config, getattr(hf_model, "generation_config", None)):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        ids += [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]
    return tuple(dict.fromkeys(int(i) for i in ids))


def adopt_hf_model(hf_model, merge: bool = True) -> CausalLM:
    """A ``CausalLM`` whose layers are ``hf_model``'s (module names of HF's Llama family: ``model.embed_tokens``,
    ``model.layers[i].self_attn.{q,k,v,o}_proj`` or a fused ``qkv_proj``, ``mlp.{gate,up,down}_proj`` or
    ``gate_up_proj``, the norms, ``lm_head``), on its device and in its dtype. ``merge``: merge q/k/v and gate/up
    where the layers allow it. Raises ``ValueError`` for a family or feature ``ModelConfig`` refuses."""
    inner = getattr(hf_model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(hf_model, "lm_head"):
        raise TypeError(f"model={type(hf_model).__name__}: need a labkit.model.CausalLM or an HF causal LM with "
                        f".model.layers and .lm_head")
    cfg = ModelConfig.from_hf(hf_model.config)
    cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": eos_ids(hf_model)})
    layers = list(inner.layers)
    qkv = [_merged(ly.self_attn, ("qkv_proj",), ("q_proj", "k_proj", "v_proj"), merge) for ly in layers]
    gate_up = [_merged(ly.mlp, ("gate_up_proj",), ("gate_proj", "up_proj"), merge) for ly in layers]
    merge_qkv, merge_gate_up = all(m is not None for m in qkv), all(m is not None for m in gate_up)
    with torch.device("meta"):
        model = CausalLM(cfg, merge_qkv, merge_gate_up)
    ours = model.model
    ours.embed_tokens = inner.embed_tokens
    _share(ours.norm, inner.norm)
    for i, (mine, theirs) in enumerate(zip(ours.layers, layers)):
        _share(mine.input_layernorm, theirs.input_layernorm)
        _share(mine.post_attention_layernorm, theirs.post_attention_layernorm)
        a, b = mine.self_attn, theirs.self_attn
        if merge_qkv:
            a.qkv_proj = qkv[i]
        else:
            a.q_proj, a.k_proj, a.v_proj = b.q_proj, b.k_proj, b.v_proj
        a.o_proj = b.o_proj
        if a.q_norm is not None:
            _share(a.q_norm, b.q_norm)
            _share(a.k_norm, b.k_norm)
        if merge_gate_up:
            mine.mlp.gate_up_proj = gate_up[i]
        else:
            mine.mlp.gate_proj, mine.mlp.up_proj = theirs.mlp.gate_proj, theirs.mlp.up_proj
        mine.mlp.down_proj = theirs.mlp.down_proj
    model.lm_head = hf_model.lm_head
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"{type(hf_model).__name__}: no weights found for {left[:8]}")
    model.plan = type(model.plan)(merge_qkv=merge_qkv, merge_gate_up=merge_gate_up)
    return model.eval()


def _merged(parent: nn.Module, fused: tuple[str], parts: tuple[str, ...], merge: bool) -> nn.Module | None:
    """The parent's fused layer (Phi-3 stores one), a merge of its ``parts`` (``concat_linears``), or None."""
    if hasattr(parent, fused[0]):
        return getattr(parent, fused[0])
    if not merge:
        return None
    return concat_linears([getattr(parent, p) for p in parts])


def _share(mine: nn.Module, theirs: nn.Module) -> None:
    """Our RMSNorm computes with ``theirs``' weight tensor (the eps comes from the config)."""
    mine.weight = theirs.weight
