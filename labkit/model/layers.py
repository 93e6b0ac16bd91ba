"""The decoder's layers: RMSNorm, the gated MLP, attention with grouped-query heads, and the decoder layer.

Each layer computes what the family's HF module computes, in the same dtype at each step (so bf16 rounds as HF
rounds): RMSNorm in float32 and cast back (Llama: cast, then ``* w``; Gemma: ``* (1 + w)`` in float32, then cast),
RoPE's cos/sin cast to the activations' dtype, attention's softmax in float32.

Weights live in one merged ``qkv_proj`` (rows: q, k, v) and one ``gate_up_proj`` (rows: gate, up) unless the
model is built with ``merge_qkv=False`` / ``merge_gate_up=False``, which keeps HF's separate projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.kvcache.paged import PagedKVCache
from labkit.model.attention import ModelInput, cached_attention, causal_attention
from labkit.model.config import ModelConfig
from labkit.model.fusion import FusionPlan
from labkit.model.ops import act_and_mul, add_norm, qkv_projection, rope_and_write
from labkit.model.rotary import rotate

TORCH = FusionPlan()  # every op in torch: the references


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` (Llama, Qwen, Mistral, Phi-3) or ``* (1 + w)`` with ``offset=1.0`` (Gemma), over the
    last dim, in float32; returns ``x``'s dtype."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma multiplies in float32 and casts last
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)  # Llama casts first, then multiplies in the weight's dtype


def activation(name: str):
    """The MLP's activation by HF name: 'silu', 'gelu' (exact), 'gelu_pytorch_tanh' / 'gelu_new' (tanh)."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"hidden_act={name!r} is not supported")


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, merged: bool = True):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.merged = merged
        if merged:
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=bias)
            self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, plan: FusionPlan = TORCH, log=None) -> torch.Tensor:
        if self.merged:
            return self.down_proj(act_and_mul(self.act, self.gate_up_proj(x), plan, log))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if plan.activation == "triton":
            return self.down_proj(act_and_mul(self.act, torch.cat((gate, up), -1), plan, log))
        return self.down_proj(self.act(gate) * up)


class Attention(nn.Module):
    """Projections, optional per-head q/k RMSNorm (Qwen3), RoPE, then attention: dense and causal over the
    sequence (``forward``) or over the paged cache (``forward_paged``), with the layer's sliding window if any."""

    def __init__(self, cfg: ModelConfig, layer: int, merged: bool = True):
        super().__init__()
        self.layer, self.window = layer, cfg.window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.merged = merged
        if merged:
            self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[..., hidden]`` -> q ``[..., heads, head_dim]``, k and v ``[..., kv_heads, head_dim]``, RoPE
        applied to q and k."""
        lead = x.shape[:-1]
        heads = self.qkv_heads(self.qkv_out(x.reshape(-1, x.shape[-1])))
        q, k, v = (t.view(*lead, *t.shape[1:]) for t in heads)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Dense: ``x`` ``[batch, T, hidden]``, cos/sin ``[batch, T, rotary_dim]`` -> ``[batch, T, hidden]``."""
        q, k, v = self.qkv(x, cos, sin)
        out = causal_attention(q, k, v, self.scale, self.window)
        return self.o_proj(out.reshape(*x.shape[:-1], self.q_size))

    def forward_paged(self, h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, cos: torch.Tensor,
                      sin: torch.Tensor, cache: PagedKVCache, inp: ModelInput, plan: FusionPlan = TORCH,
                      fuse: bool = False, pdl: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
        """Paged, in the layer's pair form (``DecoderLayer.forward_paged``): ``norm`` of the stream, the q/k/v
        projection, RoPE, k and v written at ``inp.slot_mapping``, attention over each sequence's cached tokens.
        Returns the o projection's input ``[num_tokens, heads * head_dim]`` and the stream. ``fuse``: the norm inside
        the q/k/v GEMV (with ``plan.qkv_rope_cache`` RoPE and the cache write too); ``pdl``: its launch mode."""
        log = inp.kernel_log
        if fuse:
            if plan.qkv_rope_cache:
                q, _ = qkv_projection(self.qkv_proj, h, norm, self.num_heads, cos, sin, cache, self.layer,
                                      inp.slot_mapping, pdl, log)
                return self._paged(q, cache, inp, plan, "release" if pdl else ""), h
            out, residual = self.qkv_proj(h, norm=norm, pdl=pdl, log=log), h
        else:
            x, residual = add_norm(norm, h, residual, plan, log)
            out = self.qkv_out(x)
        q, k, v = self.qkv_heads(out)
        q, k = rope_and_write(q, k, v, cos, sin, cache, self.layer, inp.slot_mapping, plan, log)
        return self._paged(q, cache, inp, plan, "release" if pdl else ""), residual

    def qkv_out(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of ``x`` ``[T, hidden]``: one merged ``[T, q + 2 kv]`` or three tensors."""
        return self.qkv_proj(x) if self.merged else (self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def qkv_heads(self, out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections' output (merged ``[T, q + 2 kv]`` or three tensors) as heads, q/k norms applied."""
        q, k, v = out.split([self.q_size, self.kv_size, self.kv_size], dim=-1) if self.merged else out
        T = q.shape[0]
        q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _paged(self, q: torch.Tensor, cache: PagedKVCache, inp: ModelInput, plan: FusionPlan,
               pdl: str = "") -> torch.Tensor:
        out = cached_attention(q, cache, self.layer, inp, self.scale, self.window, plan.attention, pdl)
        return out.reshape(q.shape[0], self.q_size)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, layer: int, merge_qkv: bool = True, merge_gate_up: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg, layer, merge_qkv)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg, merge_gate_up)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Dense: ``h`` ``[batch, T, hidden]``."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_paged(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      cache: PagedKVCache, inp: ModelInput, plan: FusionPlan = TORCH, fuse: bool = False,
                      pdl: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
        """Paged, vLLM's layout: ``h`` ``[num_tokens, hidden]`` is the last block's output and ``residual`` the
        stream before it (None: ``h`` is the stream); returns the pair for the next layer, whose first op adds them
        (one kernel with its RMSNorm on the Triton path).

        ``fuse`` (``plan.quant_epilogues``, unless a peer kernel takes the step's rows): the int8/int4 GEMVs take
        their neighbours as arguments (``Int8Linear.forward``): each RMSNorm inside the GEMV after it, each residual add
        inside the one before it, SwiGLU inside down; only the stream passes between layers (``residual`` None).
        ``pdl``: this layer's q/k/v GEMV launch mode ('' unless ``plan.gemv_pdl``); its later GEMVs overlap the
        kernel ahead."""
        log, overlap, attn, mlp = inp.kernel_log, "overlap" if pdl else "", self.self_attn, self.mlp
        out, residual = attn.forward_paged(h, residual, self.input_layernorm, cos, sin, cache, inp, plan, fuse, pdl)
        if fuse:
            h = attn.o_proj(out, residual=residual, pdl=overlap, log=log)
            gate_up = mlp.gate_up_proj(h, norm=self.post_attention_layernorm, pdl=overlap, log=log)
            return mlp.down_proj(gate_up, swiglu=True, residual=h, pdl=overlap, log=log), None
        x, residual = add_norm(self.post_attention_layernorm, attn.o_proj(out), residual, plan, log)
        return mlp(x, plan, log), residual
