"""The engine's ModelRunner: a Hugging Face Llama's weights run over a flat token batch on the paged KV cache,
with labkit's Triton kernels on CUDA and decode steps replayed from CUDA graphs captured per batch-size bucket.

A step is a ``ModelInput`` (vLLM's names): ``num_tokens`` tokens of ``num_seqs`` sequences back to back, single-
token rows (decodes) first, with each token's cache slot (``slot_mapping``) and each sequence's ``block_table``
and ``context_len``. Per layer: [add residual +] RMSNorm -> q, k, v (one merged matmul on the Triton path) ->
RoPE -> write k, v at ``slot_mapping`` (one kernel for both on the Triton path with an unquantised cache) ->
attention (an all-decode step: ``paged_attention`` over the block tables, flash-decoding for long contexts; a step
with prefill chunks: ``paged_prefill_attention``, every row causally over its sequence's cached tokens, decode rows
included, in one launch) -> o projection -> add residual + RMSNorm -> SwiGLU MLP (gate and up merged,
``silu_and_mul``). With int8 or int4 weights each RMSNorm, residual add and SwiGLU runs inside the projection next
to it (``Int8Linear`` / ``Int4Linear.fused_forward``: at decode batch 1 inside the GEMVs).
Logits are computed for each sequence's last token only (``logits_indices``).

``kernels='torch'`` (the CPU default) calls the model's own modules and the torch references of
``labkit.kvcache.attention``, so greedy output equals HF ``generate`` token for token in float32; ``'triton'``
(the CUDA default; on the CPU it runs through Triton's interpreter, slowly, for tests) swaps in the kernels.

All-decode steps of up to the largest captured batch replay a CUDA graph, and so do steps with prefill chunks of up
to the largest captured token count when ``graph_token_sizes`` are given (``labkit.engine.cuda_graph``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from labkit.engine.cuda_graph import StepGraphs, default_graph_batch_sizes
from labkit.engine.model_input import ModelInput, collect_step, input_views, pack_step
from labkit.kvcache import PagedKVCache, dequantised_blocks, paged_decode_attention_ref, paged_prefill_attention_ref
from labkit.quant import concat_linears

KERNELS = ("auto", "torch", "triton")
"""Kernel choices of the ModelRunner ('auto': Triton on CUDA, torch on the CPU)."""


def uses_triton(kernels: str, device: torch.device) -> bool:
    """Whether ``kernels`` ('auto', 'torch', 'triton') runs labkit's Triton kernels on ``device``."""
    return kernels == "triton" or (kernels == "auto" and device.type == "cuda")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    """Runs a Hugging Face ``LlamaForCausalLM`` (or one with the same module names) on a ``PagedKVCache``.

    * ``kernels``: 'auto' (Triton on CUDA, torch on the CPU), 'torch' or 'triton'
    * ``cuda_graphs``: 'auto' (on with CUDA and an unquantised cache), True, False; decode steps are captured
      for ``graph_batch_sizes`` (default ``cuda_graph.default_graph_batch_sizes(max_num_seqs)``), steps with
      prefill chunks for ``graph_token_sizes`` (total tokens of the step; default none, see
      ``cuda_graph.default_graph_token_sizes``)
    * ``merge_weights``: on the Triton path, point q/k/v and gate/up weights at slices of one merged matrix per
      layer (the same values, no extra memory; the HF model still works), so each is one matmul; plain, int8 and
      int4 linears (``labkit.quant``) merge
    * ``max_model_len``: longest sequence (sets the graphs' block-table width); default the model's maximum
    * ``fuse_layer_ops``: where every merged projection is labkit's int8 or int4 layer, fold each RMSNorm into
      the projection after it and each residual add into the one before it (``fused_forward``): at decode batch 1
      the GEMVs do them, two kernels fewer per layer (default True; the H200's 8B step with int4 2.308 -> 2.057 ms,
      with int8 2.801 -> 2.681 ms, results/h200/records/04_quantization.json)
    * ``fuse_qkv_rope`` (with ``fuse_layer_ops``): RoPE and the k/v cache write in the q/k/v GEMV's store too
      (``w4a16_qkv_rope_cache`` / ``w8a16_qkv_rope_cache``): one kernel fewer per layer (the H200's 8B int4
      step 2.374 -> 2.313 ms, results/h200/records/04_quantization_1c63a29.json)
    * ``gemv_pdl`` (with ``fuse_layer_ops``, sm_90): the quantised GEMVs after the first are programmatic dependent
      launches (the next layer's q/k/v after down, gate/up after o, down after gate/up, and o after attention,
      which releases it as it starts), so each GEMV's first weight loads overlap the kernels ahead of it: the
      H200's 8B int4 step 2.325 -> 2.225 ms (results/h200/records/04_quantization.json), with the plain
      launches' bits (research/pdl_check.py, results/h200/records/pdl_check_47e547d.json)
    """

    def __init__(self, model, cache: PagedKVCache, kernels: str = "auto", cuda_graphs: bool | str = "auto",
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 graph_batch_sizes: Sequence[int] | None = None, merge_weights: bool = True,
                 graph_token_sizes: Sequence[int] = (), fuse_layer_ops: bool = True, fuse_qkv_rope: bool = True,
                 gemv_pdl: bool = True):
        self._check_model(model, cache)
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} is unknown; allowed: {KERNELS}")
        self.model, self.cache, self.inner = model, cache, model.model
        self.layers = list(self.inner.layers)
        self.device, self.dtype = cache.device, next(model.parameters()).dtype
        self.use_triton = uses_triton(kernels, self.device)
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = cache.num_kv_heads
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.max_num_seqs = max_num_seqs
        self.max_blocks = cache.blocks_for(self.max_model_len)
        self._dequantise = cache.fmt.quantised or cache.fmt.storage_dtype != self.dtype
        self._rope_tables()
        self.merged = self._merge_projections() if (self.use_triton and merge_weights) else False
        if fuse_layer_ops not in (True, False):
            raise ValueError(f"fuse_layer_ops={fuse_layer_ops!r}; allowed: True, False")
        self.fused_layer_ops = bool(fuse_layer_ops) and self.merged and self._fusable()
        self.fuse_qkv_rope = fuse_qkv_rope and self.fused_layer_ops
        self.gemv_pdl = gemv_pdl and self.fused_layer_ops
        self.scratch_block: int | None = None  # padding rows of captured steps write here (cuda_graph.py)
        self.graphs = None
        self.last_step_replayed = False  # whether the last ``execute`` replayed a graph
        if self._want_graphs(cuda_graphs):
            self.graphs = StepGraphs(self, graph_batch_sizes or default_graph_batch_sizes(max_num_seqs),
                                     graph_token_sizes)

    @property
    def graph_batch_sizes(self) -> list[int]:
        """Batch sizes with a captured decode graph (empty without CUDA graphs)."""
        return self.graphs.batch_sizes if self.graphs is not None else []

    # --- setup ----------------------------------------------------------------------------------------------
    @staticmethod
    def _check_model(model, cache: PagedKVCache) -> None:
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
            raise TypeError(f"model={type(model).__name__}: need a Llama-family HF causal LM with .model."
                            f"{{{', '.join(needed)}}} and .lm_head")
        attn = inner.layers[0].self_attn
        if len(inner.layers) != cache.num_layers or attn.head_dim != cache.head_dim or \
                attn.k_proj.out_features != cache.num_kv_heads * cache.head_dim:
            raise ValueError("cache shape does not match the model; build it with PagedKVCache.for_model")
        if next(model.parameters()).device != cache.device:
            raise ValueError(f"model is on {next(model.parameters()).device} but the cache on {cache.device}; "
                             "put them on one device")

    def _rope_tables(self) -> None:
        """cos/sin of every position, ``[max_position, head_dim]`` in the model's dtype, computed by the model's
        own rotary module (each entry depends on its position alone, so a lookup equals HF's computation)."""
        n = self.model.config.max_position_embeddings
        pos = torch.arange(n, device=self.device)[None]
        probe = torch.empty(1, device=self.device, dtype=self.dtype)
        cos, sin = self.inner.rotary_emb(probe, pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    def _merge_projections(self) -> bool:
        """Re-point each layer's q/k/v and gate/up weights at row slices of one merged layer (kept in ``self.w_qkv``,
        ``self.w_gate_up``) where all are bias-free layers of one kind: plain ``nn.Linear`` or labkit's int8 /
        int4 ones (``labkit.quant.weight_only.concat_linears``); returns whether every layer merged."""
        self.w_qkv = [concat_linears([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj])
                      for ly in self.layers]
        self.w_gate_up = [concat_linears([ly.mlp.gate_proj, ly.mlp.up_proj]) for ly in self.layers]
        return all(w is not None for w in self.w_qkv + self.w_gate_up)

    def _fusable(self) -> bool:
        """Whether every projection can take in its neighbours (``fused_forward``: labkit's int8/int4 layers) and every
        norm is an RMSNorm with ``weight`` and ``variance_epsilon``."""
        projections = [p for i, ly in enumerate(self.layers)
                       for p in (self.w_qkv[i], ly.self_attn.o_proj, self.w_gate_up[i], ly.mlp.down_proj)]
        norms = [n for ly in self.layers for n in (ly.input_layernorm, ly.post_attention_layernorm)]
        return all(hasattr(p, "fused_forward") for p in projections) and \
            all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms)

    def _want_graphs(self, cuda_graphs: bool | str) -> bool:
        if cuda_graphs not in ("auto", True, False):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}; allowed: 'auto', True, False")
        if cuda_graphs == "auto":
            return self.device.type == "cuda" and not self._dequantise
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device: CUDA graphs do not exist on the CPU "
                             "(use cuda_graphs='auto' or False)")
        if cuda_graphs and self._dequantise:
            raise ValueError(f"cuda_graphs=True needs a cache stored in the model's dtype; this one is "
                             f"{cache_name(self.cache)} (dequantised per step, not capturable)")
        return bool(cuda_graphs)

    # --- inputs ---------------------------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int], num_decode: int,
                pad_to: int | None = None, width: int | None = None, pad_tokens: int | None = None) -> ModelInput:
        """A ``ModelInput`` computing the next ``num_tokens[i]`` uncomputed tokens of each sequence (slots
        reserved already). ``pad_to`` adds padding sequences (no tokens, context 1, scratch-block tables) and as
        many token rows, ``pad_tokens`` pads the token rows to that count instead (scratch slot, position 0);
        ``width`` fixes the block-table width."""
        step = self._collect(seq_ids, num_tokens)
        return self._to_device(list(seq_ids), *step, list(num_tokens), num_decode, pad_to, width, pad_tokens)

    def _collect(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> tuple[list, ...]:
        return collect_step(self.cache, seq_ids, num_tokens)

    def _pack(self, ids, pos, slots, ctx, tables, qlens, n_seqs: int, n_tok: int,
              width: int) -> tuple[np.ndarray, np.ndarray]:
        """``pack_step`` with this runner's scratch block, after checking the tables fit ``width``."""
        if any(len(t) > width for t in tables):
            raise ValueError(f"a sequence holds {max(len(t) for t in tables)} blocks, more than max_model_len="
                             f"{self.max_model_len} allows ({width} blocks of {self.cache.block_size})")
        return pack_step(ids, pos, slots, ctx, tables, qlens, n_seqs, n_tok, width, self.cache.block_size,
                         self.scratch_block or 0)

    def pack_for_graphs(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> tuple[np.ndarray, ...]:
        """The step packed for ``StepGraphs.run_packed`` (the static buffers' shape, tables ``max_blocks`` wide):
        ``(longs, ints, context_lens)``, the last a host list of each sequence's context after the step."""
        ids, pos, slots, ctx, tables = self._collect(seq_ids, num_tokens)
        longs, ints = self._pack(ids, pos, slots, ctx, tables, list(num_tokens), *self.graphs.static_shape,
                                 self.max_blocks)
        return longs, ints, ctx

    def _to_device(self, seq_ids, ids, pos, slots, ctx, tables, qlens, num_decode, pad_to, width,
                   pad_tokens=None) -> ModelInput:
        n_seqs = pad_to or len(ctx)
        n_tok = pad_tokens or len(ids) + n_seqs - len(ctx)
        width = width or max(len(t) for t in tables)
        longs, ints = self._pack(ids, pos, slots, ctx, tables, qlens, n_seqs, n_tok, width)
        longs = torch.from_numpy(longs).to(self.device, non_blocking=True)
        ints = torch.from_numpy(ints).to(self.device, non_blocking=True)
        return input_views(longs, ints, n_seqs, width, seq_ids, qlens, ctx, tables, num_decode)

    # --- the step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int], num_decode: int) -> torch.Tensor:
        """Compute the scheduled tokens; returns float32 logits of each sequence's last token ``[num_seqs,
        vocab]`` (a tensor of the caller's own, also after a graph replay) and marks the tokens computed in the
        cache. A step replays a CUDA graph when one is captured for its shape (``StepGraphs.lookup``)."""
        key = self.graphs.lookup(len(seq_ids), sum(num_tokens), num_decode) if self.graphs is not None else None
        self.last_step_replayed = key is not None
        if key is not None:  # packed on the host in the static buffers' layout: two copies feed the graph
            longs, ints, ctx = self.pack_for_graphs(seq_ids, num_tokens)
            logits = self.graphs.run_packed(longs, ints, key, len(seq_ids))  # a copy of the real rows
        else:
            inp = self.prepare(seq_ids, num_tokens, num_decode)
            logits, ctx = self.forward(inp), inp.context_lens_host
        for sid, c in zip(seq_ids, ctx):
            self.cache.mark_computed(sid, c)
        return logits

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """The model over ``inp`` (no bookkeeping): float32 logits ``[num_seqs (+ padding), vocab]``."""
        h = self.inner.embed_tokens(inp.input_ids)  # [T, hidden]
        cos, sin = self.cos[inp.positions], self.sin[inp.positions]  # [T, head_dim]
        if self.fused_layer_ops:
            return self._forward_fused(h, cos, sin, inp)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = self._add_norm(layer.input_layernorm, h, residual)
            h = self._attention(i, layer.self_attn, x, cos, sin, inp)
            x, residual = self._add_norm(layer.post_attention_layernorm, h, residual)
            h = self._mlp(i, layer.mlp, x)
        return self._logits(h, residual, inp)

    def _forward_fused(self, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       inp: ModelInput) -> torch.Tensor:
        """``forward`` with quantised layers that take in their neighbours (``fused_forward``): each RMSNorm
        inside the projection after it (q/k/v, gate/up), each residual add inside the one before it (o, down),
        SwiGLU inside the down projection. Only the residual stream passes from layer to layer; at decode batch
        1 a layer is four GEMVs (RoPE and the cache write in the first) and attention. With ``gemv_pdl`` every
        kernel of the chain releases the launch after it and every GEMV but the first overlaps the one ahead."""
        overlap, release = ("overlap", "release") if self.gemv_pdl else ("", "")
        for i, layer in enumerate(self.layers):
            attn = self._fused_attention_input(i, layer, stream, cos, sin, inp, overlap if i else release)
            stream = layer.self_attn.o_proj.fused_forward(attn, residual=stream, pdl=overlap)
            gate_up = self.w_gate_up[i].fused_forward(stream, norm=layer.post_attention_layernorm, pdl=overlap)
            stream = layer.mlp.down_proj.fused_forward(gate_up, swiglu=True, residual=stream, pdl=overlap)
        return self._logits(stream, None, inp)

    def _fused_attention_input(self, i: int, layer, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               inp: ModelInput, pdl: str = "") -> torch.Tensor:
        """RMSNorm, the q/k/v GEMV, RoPE, the cache write and attention of a quantised layer: ``[T, heads * D]``.
        With ``fuse_qkv_rope`` (and an unquantised cache) RoPE and the cache write run in the GEMV's store
        (``qkv_rope_cache``) at batch 1. ``pdl``: the GEMV's launch mode; decode attention then releases
        the launch after it as it starts."""
        qkv_layer, norm = self.w_qkv[i], layer.input_layernorm
        attn_pdl = "release" if pdl else ""
        if self.fuse_qkv_rope and not self._dequantise and qkv_layer.uses_kernels(stream):  # merged: no bias
            q, k = qkv_layer.qkv_rope_cache(stream, self.num_heads, cos, sin, self.cache.k_caches[i],
                                            self.cache.v_caches[i], inp.slot_mapping, norm=norm, pdl=pdl)
            return self._attend(i, q, k, None, inp, attn_pdl).reshape(q.shape[0], -1)
        qkv = qkv_layer.fused_forward(stream, norm=norm, pdl=pdl)
        return self._attend_qkv(i, *self._split_qkv(qkv), cos, sin, inp, attn_pdl)

    def _logits(self, h: torch.Tensor, residual: torch.Tensor | None, inp: ModelInput) -> torch.Tensor:
        """The final add + RMSNorm and the LM head, for each sequence's last token only."""
        if not inp.is_decode:
            h = h.index_select(0, inp.logits_indices)
            residual = residual.index_select(0, inp.logits_indices) if residual is not None else None
        h, _ = self._add_norm(self.inner.norm, h, residual)
        return self.model.lm_head(h).float()

    def _add_norm(self, norm, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + h), residual + h)``, rounded as HF's decoder layer rounds (one fused kernel on the
        Triton path)."""
        if self.use_triton:
            from labkit.kernels.rms_norm import rms_norm

            if residual is None:
                return rms_norm(h, norm.weight, norm.variance_epsilon), h
            return rms_norm(h, norm.weight, norm.variance_epsilon, residual=residual)
        if residual is not None:
            h = residual + h
        return norm(h), h

    def _attention(self, i: int, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   inp: ModelInput) -> torch.Tensor:
        if self.merged:
            q, k, v = self._split_qkv(self.w_qkv[i](x))
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        return attn.o_proj(self._attend_qkv(i, q, k, v, cos, sin, inp))

    def _split_qkv(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        D = self.head_dim
        return qkv.split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)

    def _attend_qkv(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, inp: ModelInput, pdl: str = "") -> torch.Tensor:
        """RoPE on ``q``, ``k`` ``[T, heads * head_dim]``, ``k`` and ``v`` written to the cache, attention:
        ``[T, heads * head_dim]``, the o projection's input."""
        T, D = q.shape[0], self.head_dim
        q, k, v = q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D)
        if self.use_triton and not self._dequantise:  # one launch: RoPE and the cache write of k and v
            from labkit.kernels.rope import apply_rope_and_cache

            q, k = apply_rope_and_cache(q, k, v, cos, sin, self.cache.k_caches[i], self.cache.v_caches[i],
                                        inp.slot_mapping)
        else:
            if self.use_triton:
                from labkit.kernels.rope import apply_rope

                q, k = apply_rope(q, k, cos, sin)
            else:
                q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
                k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
            self.cache.write(i, inp.slot_mapping, k, v)
        return self._attend(i, q, k, v, inp, pdl).reshape(T, -1)

    def _mlp(self, i: int, mlp, x: torch.Tensor) -> torch.Tensor:
        if not self.use_triton:
            return mlp(x)
        from labkit.kernels.silu_and_mul import silu_and_mul

        if self.merged:
            return mlp.down_proj(silu_and_mul(self.w_gate_up[i](x)))
        return mlp.down_proj(silu_and_mul(mlp.gate_proj(x), mlp.up_proj(x)))

    # --- attention ------------------------------------------------------------------------------------------
    def _pools(self, i: int, tables: torch.Tensor, dtype: torch.dtype):
        if self._dequantise:
            return dequantised_blocks(self.cache, i, tables, dtype)
        return self.cache.k_caches[i], self.cache.v_caches[i], tables

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inp: ModelInput,
                pdl: str = "") -> torch.Tensor:
        """Attention of every query row ``[T, heads, head_dim]``: decode rows over the paged cache, prefill
        chunks causally over their sequence's cached context. ``pdl``: decode attention's (``paged_attention``)."""
        d = inp.num_decode
        if inp.is_decode:
            return self._decode_attention(i, q, inp.block_tables, inp.context_lens, pdl)
        if self.use_triton:  # every row, decode rows included, in one launch whose grid depends on shapes only
            from labkit.kernels.paged_prefill_attention import paged_prefill_attention

            k_cache, v_cache, tables = self._pools(i, inp.block_tables, q.dtype)
            return paged_prefill_attention(q, k_cache, v_cache, tables, inp.query_start_loc, inp.context_lens,
                                           self.scale, out=torch.zeros_like(q),  # padding rows stay finite
                                           check=False)  # tables from the allocator, width checked in _pack
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode_attention(i, q[:d], inp.block_tables[:d], inp.context_lens[:d])
        k_cache, v_cache, tables = self._pools(i, inp.block_tables[d:], q.dtype)
        qsl = torch.tensor([0, *inp.query_lens[d:]]).cumsum(0)
        out[d:] = paged_prefill_attention_ref(q[d:], k_cache, v_cache, tables, qsl, inp.context_lens[d:],
                                              self.scale)
        return out

    def _decode_attention(self, i: int, q: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                          pdl: str = "") -> torch.Tensor:
        k_cache, v_cache, tables = self._pools(i, tables, q.dtype)
        if self.use_triton:
            from labkit.kernels.paged_attention import paged_attention

            return paged_attention(q, k_cache, v_cache, tables, ctx, scale=self.scale, pdl=pdl, check=False)
        return paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, self.scale)


def cache_name(cache: PagedKVCache) -> str:
    return cache.fmt.name
