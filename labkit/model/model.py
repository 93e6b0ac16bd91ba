"""The decoder: ``Transformer`` (embeddings, layers, final norm) and ``CausalLM`` (with the LM head).

Two forwards over the same weights:

* ``CausalLM.forward(input_ids)``: ``[batch, T]`` -> logits ``[batch, T, vocab]``, dense causal attention and no
  cache: the correctness path, compared with HF's ``model(input_ids).logits``.
* ``CausalLM.forward_paged(inp, cache)``: one step's ``ModelInput`` (``labkit.model.attention``: a flat batch of tokens
  of several sequences, prefill chunks and decode tokens alike) over a ``PagedKVCache``; writes each token's K/V at
  its slot and returns float32 logits of the rows ``inp.logits_indices`` names (each sequence's last token,
  ``[num_seqs, vocab]``): the path the engine drives.

Module names follow HF's (``model.layers.N.self_attn.o_proj`` ...), except the merged ``qkv_proj`` and
``gate_up_proj`` (``loader.MERGED``), so a checkpoint maps by name.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.checks import check_bool, check_type
from labkit.kvcache.paged import PagedKVCache
from labkit.model.attention import ModelInput
from labkit.model.config import FAMILIES, ModelConfig
from labkit.model.fusion import FusionPlan, resolve_plan
from labkit.model.layers import DecoderLayer, RMSNorm
from labkit.model.ops import add_norm, epilogue_ready, peers_take
from labkit.model.rotary import RotaryEmbedding


class Transformer(nn.Module):
    """Token embeddings, ``num_layers`` decoder layers and the final RMSNorm: hidden states, not logits."""

    def __init__(self, cfg: ModelConfig, merge_qkv: bool = True, merge_gate_up: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, merge_qkv, merge_gate_up) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.rotary_emb = RotaryEmbedding(cfg)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:  # Gemma: the scale rounded to the weights' dtype, as HF rounds it
            # (a CPU scalar tensor: no host-to-device copy, so the step stays capturable in a CUDA graph)
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dense: hidden states after the final norm, ``[batch, T, hidden]``."""
        cos, sin = self.rotary_emb(positions)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)

    def forward_paged(self, inp: ModelInput, cache: PagedKVCache, plan: FusionPlan) -> torch.Tensor:
        """Paged: the final hidden states of the rows ``inp.logits_indices`` names, ``[rows, hidden]``. Each layer runs
        its one paged forward; the int8/int4 GEMVs take their neighbours (``plan.quant_epilogues``) unless the kernel
        table hands this step's rows to a peer kernel (``labkit.quant.dispatch``: a choice by rows, not the plan's)."""
        seq_lens = inp.token_seq_lens() if self._dynamic else None
        h = self.embed(inp.input_ids)
        cos, sin = self.rotary_emb.lookup(inp.positions, h.dtype, seq_lens)
        fuse = plan.quant_epilogues and not self._peer_rows(h.shape[0])
        pdl, residual = "release" if fuse and plan.gemv_pdl else "", None
        for layer in self.layers:
            h, residual = layer.forward_paged(h, residual, cos, sin, cache, inp, plan, fuse, pdl)
            pdl = "overlap" if pdl else ""
        if not inp.is_decode:  # rows of prefill chunks (or every row's logits wanted): keep the named rows
            rows = inp.logits_indices
            h = h.index_select(0, rows)
            residual = residual.index_select(0, rows) if residual is not None else None
        return add_norm(self.norm, h, residual, plan, inp.kernel_log)[0]

    def _peer_rows(self, rows: int) -> bool:
        """Whether the layers' kernel table gives ``rows`` rows to a peer (``ops.peers_take``; one table for all)."""
        ly = self.layers[0]
        return peers_take([ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj], rows)

    @property
    def _dynamic(self) -> bool:
        return self.cfg.rope_scaling is not None and self.cfg.rope_scaling.rope_type == "dynamic"


class CausalLM(nn.Module):
    """A decoder-only language model of any family ``ModelConfig`` admits.

    Build it with ``labkit.model.load_checkpoint`` (a local HF checkpoint), ``adopt_hf_model`` (an HF model in
    memory) or ``from_config`` (random weights); ``CausalLM(cfg)`` itself leaves the weights at torch's defaults.
    """

    def __init__(self, cfg: ModelConfig, merge_qkv: bool = True, merge_gate_up: bool = True):
        check_type("cfg", cfg, ModelConfig)
        if cfg.model_type not in FAMILIES:
            raise ValueError(f"model_type={cfg.model_type!r} is sized by ModelConfig but has no labkit.model decoder; "
                             f"allowed: {FAMILIES}")
        super().__init__()
        self.config = cfg
        self.merge_qkv = check_bool("merge_qkv", merge_qkv)  # the weight layout, fixed here
        self.merge_gate_up = check_bool("merge_gate_up", merge_gate_up)
        self.model = Transformer(cfg, merge_qkv, merge_gate_up)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._plan = FusionPlan()

    @property
    def plan(self) -> FusionPlan:
        """The frozen plan ``forward_paged`` runs (torch for a model as built); ``use`` is the one way to change it."""
        return self._plan

    def use(self, kernels: str | FusionPlan = "auto", cache: PagedKVCache | None = None) -> CausalLM:
        """This model over the same modules and weights, with ``plan`` ``kernels`` (a ``FusionPlan`` or 'auto' |
        'torch' | 'triton') resolved once, here (``resolve_plan``): what the family cannot run turns back to torch
        (``FusionPlan.fit``); the int8/int4 epilogue fusions stay only where every projection is labkit's int8/int4
        linear, merged, on its kernels on this device; the fused cache writes only for a ``cache`` (default: one of
        the model's dtype) stored in the activations' dtype. Raises ``ValueError`` for Triton attention in bf16 on the
        CPU. ``self`` is unchanged; resolve again after moving the model or replacing its layers."""
        unfit = {}
        if not all(epilogue_ready([getattr(ly.self_attn, "qkv_proj", None), ly.self_attn.o_proj,
                                   getattr(ly.mlp, "gate_up_proj", None), ly.mlp.down_proj], self.device)
                   for ly in self.model.layers):
            unfit["quant_epilogues"] = "the projections are not labkit's int8/int4 linears on their kernels, merged"
        if cache is not None and not self._caches_raw(cache):
            unfit.update(rope_cache_write=cache.fmt.name, qkv_rope_cache=cache.fmt.name)
        view = CausalLM.__new__(CausalLM)
        nn.Module.__init__(view)
        view.config, view.merge_qkv, view.merge_gate_up = self.config, self.merge_qkv, self.merge_gate_up
        view.model, view.lm_head = self.model, self.lm_head
        view._plan = resolve_plan(kernels, self.config, self.device, self.dtype, unfit)
        return view.train(self.training)

    def _caches_raw(self, cache: PagedKVCache) -> bool:
        """Whether ``cache`` stores K/V as they are (this model's dtype): kernels may write its pools directly."""
        return not cache.fmt.quantised and cache.fmt.storage_dtype == self.dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's; quantised layers hold other dtypes)."""
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` int ``[batch, T]`` (every row ``T`` real tokens; no padding) -> logits ``[batch, T,
        vocab]`` in the model's dtype, as HF's ``model(input_ids).logits``. ``positions`` defaults to ``0 ..
        T-1``."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be int64 [batch, T], got {input_ids.dtype} {tuple(input_ids.shape)}")
        self._check_ids(input_ids)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.lm_head(self.model(input_ids, positions))

    @torch.inference_mode()
    def forward_paged(self, inp: ModelInput, cache: PagedKVCache, out: torch.Tensor | None = None) -> torch.Tensor:
        """One engine step, ``inp`` (``ModelInput.build``; sequences back to back): K/V written into ``cache`` at
        ``inp.slot_mapping``, each op by the kernel of ``self.plan`` (``use``). Returns float32 logits ``[num_logits,
        vocab]`` of the rows ``inp.logits_indices`` names (each sequence's last token, or every row); written into
        ``out`` (float32 ``[num_logits, vocab]``) when given, as CUDA graphs do to share one output buffer."""
        inp.check()
        self.check_cache(cache)
        if (self._plan.rope_cache_write or self._plan.qkv_rope_cache) and not self._caches_raw(cache):
            raise ValueError(f"this model's plan writes K/V in the activations' dtype, and cache is {cache.fmt.name}: "
                             "resolve the plan for it, model.use(kernels, cache)")
        logits = self.lm_head(self.model.forward_paged(inp, cache, self.plan))
        if out is None:
            return logits.float()
        if out.dtype != torch.float32 or out.shape != logits.shape:
            raise ValueError(f"out must be float32 {tuple(logits.shape)}, got {out.dtype} {tuple(out.shape)}")
        return out.copy_(logits)

    def check_cache(self, cache: PagedKVCache) -> None:
        """The cache's layers, KV heads, head dim and device fit this model (a clear error otherwise)."""
        c = self.config
        got = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
        want = (c.num_layers, c.num_kv_heads, c.head_dim)
        if got != want:
            raise ValueError(f"cache has (layers, kv_heads, head_dim)={got}; this model needs {want}")
        if not cache.k_caches:
            raise ValueError("cache was built with allocate_pools=False: it holds no K/V tensors")
        if cache.device != self.device:
            raise ValueError(f"cache is on {cache.device}, the model on {self.device}")

    def make_cache(self, num_blocks: int, block_size: int = 16, kv_dtype=None, **kwargs) -> PagedKVCache:
        """A ``PagedKVCache`` shaped for this model on its device (``kv_dtype`` defaults to the model's dtype)."""
        return PagedKVCache.for_model(self, num_blocks, block_size, kv_dtype, **kwargs)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids hold ids in [{int(input_ids.min())}, {int(input_ids.max())}]; allowed: "
                             f"[0, {self.config.vocab_size})")
