"""The decoder: ``Transformer`` (embeddings, layers, final norm) and ``CausalLM`` (with the LM head).

Two forwards over the same weights:

* ``CausalLM.forward(input_ids)``: ``[batch, T]`` -> logits ``[batch, T, vocab]``, dense causal attention and no
  cache: the correctness path, compared with HF's ``model(input_ids).logits``.
* ``CausalLM.forward_paged(input_ids, positions, cache, meta)``: a flat batch of tokens of several sequences
  (prefill chunks and decode tokens alike) over a ``PagedKVCache``; writes each token's K/V at its slot and
  returns float32 logits of each sequence's last token ``[num_seqs, vocab]``: the path the engine drives.

Module names follow HF's (``model.layers.N.self_attn.o_proj`` ...), except the merged ``qkv_proj`` and
``gate_up_proj`` (``loader.MERGED``), so a checkpoint maps by name.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.kvcache.paged import PagedKVCache
from labkit.model.attention import AttentionMetadata
from labkit.model.config import ModelConfig
from labkit.model.layers import DecoderLayer, RMSNorm
from labkit.model.rope import RotaryEmbedding


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
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype, device=h.device)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache | None = None,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Hidden states after the final norm, shaped as ``input_ids`` plus ``hidden``."""
        seq_lens = meta.token_seq_lens() if meta is not None and self._dynamic else None
        cos, sin = self.rotary_emb(positions, seq_lens)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, cache, meta)
        return self.norm(h)

    @property
    def _dynamic(self) -> bool:
        return self.cfg.rope_scaling is not None and self.cfg.rope_scaling.rope_type == "dynamic"


class CausalLM(nn.Module):
    """A decoder-only language model of any family ``ModelConfig`` admits.

    Build it with ``labkit.model.load_checkpoint`` (a local HF checkpoint), ``load_hf_model`` (an HF model in
    memory) or ``from_config`` (random weights); ``CausalLM(cfg)`` itself leaves the weights at torch's defaults.
    """

    def __init__(self, cfg: ModelConfig, merge_qkv: bool = True, merge_gate_up: bool = True):
        super().__init__()
        self.config = cfg
        self.merge_qkv, self.merge_gate_up = merge_qkv, merge_gate_up
        self.model = Transformer(cfg, merge_qkv, merge_gate_up)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

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
    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                      meta: AttentionMetadata) -> torch.Tensor:
        """One engine step: ``input_ids`` and ``positions`` int64 ``[num_tokens]`` (sequences back to back, as
        ``meta`` lays them out), K/V written into ``cache`` at ``meta.slot_mapping``. Returns float32 logits
        ``[num_seqs, vocab]`` of each sequence's last token only."""
        n = input_ids.shape[0]
        if input_ids.dim() != 1 or tuple(positions.shape) != (n,):
            raise ValueError(f"input_ids and positions must both be [num_tokens], got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        meta.check(n)
        self.check_cache(cache)
        h = self.model(input_ids, positions, cache, meta)
        if n != meta.num_seqs:  # a step with a prefill chunk: keep each sequence's last row
            h = h.index_select(0, meta.logits_indices)
        return self.lm_head(h).float()

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
        c = self.config
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size,
                            kv_dtype=self.dtype if kv_dtype is None else kv_dtype, device=self.device, **kwargs)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids hold ids in [{int(input_ids.min())}, {int(input_ids.max())}]; allowed: "
                             f"[0, {self.config.vocab_size})")
