"""labkit's model runner: a Hugging Face Llama's own modules, run over a flat token batch on the paged cache.

nano-vllm style: no padding and no per-sequence batch dimension. A step is a ``StepBatch`` of ``num_tokens``
tokens from ``num_seqs`` sequences laid back to back (a prefill chunk of many tokens, a decode token, or both
mixed), with where each token's K/V go (``slot_mapping``) and what each sequence attends to (``block_tables``,
``context_lens``). The runner reuses the model's modules and weights (embedding, q/k/v/o projections,
RMSNorms, rotary embedding, MLP, final norm, LM head), so greedy output matches HF ``generate`` token for
token in float32.

Per layer: RMSNorm -> q, k, v projections -> RoPE at ``positions`` -> write k, v into the pools at
``slot_mapping`` -> attention of q over the cache (its new tokens included) -> o projection + residual ->
RMSNorm -> MLP + residual.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from labkit.kvcache.attention import BACKENDS, decode_attention, dequantised_blocks, paged_prefill_attention_ref
from labkit.kvcache.paged import PagedKVCache


@dataclass
class StepBatch:
    """Inputs of one forward (vLLM's names). All tensors on the model's device.

    * ``seq_ids``: the sequences, in batch order (the runner marks their tokens computed after the step)
    * ``input_ids``: int64 ``[num_tokens]``; ``positions``: int64 ``[num_tokens]`` (index of each token in its
      sequence); ``slot_mapping``: int64 ``[num_tokens]``, the cache slot for each token's K/V
    * ``query_start_loc``: int32 ``[num_seqs + 1]``, sequence ``s``'s tokens are rows ``[qsl[s], qsl[s+1])``
    * ``context_lens``: int32 ``[num_seqs]``, tokens of each sequence in the cache after this step's writes
    * ``block_tables``: int32 ``[num_seqs, max_blocks]``
    """

    seq_ids: list[Hashable]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (the case the decode kernel handles)."""
        return self.num_tokens == self.num_seqs


def prepare_step(cache: PagedKVCache, seq_ids: Sequence[Hashable],
                 num_tokens: Sequence[int] | None = None) -> StepBatch:
    """A ``StepBatch`` that computes, for each sequence, its next ``num_tokens[i]`` uncomputed tokens
    (default: all tokens it has slots for but no K/V yet). Slots must already be reserved
    (``allocate``/``append_slots``)."""
    if not seq_ids:
        raise ValueError("seq_ids is empty: a step needs at least one sequence")
    ids, pos, slots, qsl, ctx = [], [], [], [0], []
    for i, sid in enumerate(seq_ids):
        seq = cache.seq(sid)
        start = seq.num_computed
        end = seq.num_tokens if num_tokens is None else start + num_tokens[i]
        if not start < end <= seq.num_tokens:
            raise ValueError(f"sequence {sid!r}: {end - start} tokens to compute, but it has "
                             f"{seq.num_tokens} slots of which {start} are computed; reserve slots first")
        ids += seq.token_ids[start:end]
        pos += range(start, end)
        slots += cache.slots(sid, start, end)
        qsl.append(qsl[-1] + end - start)
        ctx.append(end)
    long = dict(dtype=torch.long, device=cache.device)
    int32 = dict(dtype=torch.int32, device=cache.device)
    return StepBatch(list(seq_ids), torch.tensor(ids, **long), torch.tensor(pos, **long),
                     torch.tensor(slots, **long), torch.tensor(qsl, **int32), torch.tensor(ctx, **int32),
                     cache.block_tables(seq_ids))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PagedModelRunner:
    """Runs a Hugging Face ``LlamaForCausalLM`` (or a model with the same module names) on a ``PagedKVCache``.

    ``attention_backend``: 'auto' (the Triton decode kernel on CUDA when it exists), 'torch' or 'triton'.
    """

    def __init__(self, model, cache: PagedKVCache, attention_backend: str = "auto"):
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
            raise TypeError(f"model={type(model).__name__}: need a Llama-family HF causal LM with .model."
                            f"{{{', '.join(needed)}}} and .lm_head")
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend={attention_backend!r} is unknown; allowed: {BACKENDS}")
        attn = inner.layers[0].self_attn
        if len(inner.layers) != cache.num_layers or attn.head_dim != cache.head_dim or \
                attn.k_proj.out_features != cache.num_kv_heads * cache.head_dim:
            raise ValueError(f"cache shape (layers={cache.num_layers}, kv_heads={cache.num_kv_heads}, "
                             f"head_dim={cache.head_dim}) does not match the model; build it with "
                             f"PagedKVCache.for_model")
        self.model, self.inner, self.cache = model, inner, cache
        self.attention_backend = attention_backend
        self.dtype = next(model.parameters()).dtype
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.scale = attn.scaling

    @torch.inference_mode()
    def forward(self, batch: StepBatch, all_logits: bool = False) -> torch.Tensor:
        """Run one step; returns float32 logits of each sequence's last token ``[num_seqs, vocab]`` (or of
        every token, ``[num_tokens, vocab]``, with ``all_logits``). Marks the batch's tokens computed in the
        cache."""
        h = self.inner.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.inner.rotary_emb(h, batch.positions[None])  # [1, T, head_dim] each
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # broadcast over heads
        for i, layer in enumerate(self.inner.layers):
            h = h + self._attention_block(i, layer, h, cos, sin, batch)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.inner.norm(h)
        if not all_logits:
            h = h[batch.query_start_loc[1:].long() - 1]
        logits = self.model.lm_head(h).float()
        for sid, n in zip(batch.seq_ids, batch.context_lens.tolist(), strict=True):
            self.cache.mark_computed(sid, n)
        return logits

    def _attention_block(self, i: int, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         batch: StepBatch) -> torch.Tensor:
        attn, T, D = layer.self_attn, h.shape[0], self.cache.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(T, -1, D)
        k = attn.k_proj(x).view(T, -1, D)
        v = attn.v_proj(x).view(T, -1, D)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.cache.write(i, batch.slot_mapping, k, v)
        o = self._attend(i, q, batch)
        return attn.o_proj(o.reshape(T, -1))

    def _attend(self, i: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        cache, tables = self.cache, batch.block_tables
        if batch.is_decode:  # int8/fp8 pools go to the kernel as they are, with their scales
            quant = cache.fmt.quantised
            return decode_attention(q, cache.k_caches[i], cache.v_caches[i], tables, batch.context_lens, self.scale,
                                    self.attention_backend, k_scale=cache.k_scales[i] if quant else None,
                                    v_scale=cache.v_scales[i] if quant else None)
        if cache.fmt.quantised or cache.fmt.storage_dtype != q.dtype:
            k_cache, v_cache, tables = dequantised_blocks(cache, i, tables, q.dtype)
        else:
            k_cache, v_cache = cache.k_caches[i], cache.v_caches[i]
        return paged_prefill_attention_ref(q, k_cache, v_cache, tables, batch.query_start_loc,
                                           batch.context_lens, self.scale)

    # --- convenience ----------------------------------------------------------------------------------------
    def prefill(self, seq_id: Hashable, token_ids: Sequence[int]) -> torch.Tensor:
        """Allocate a sequence for ``token_ids`` and compute what the prefix cache does not hold; returns the
        last token's logits ``[vocab]``."""
        self.cache.allocate(seq_id, token_ids)
        return self.forward(prepare_step(self.cache, [seq_id]))[0]

    def decode(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> torch.Tensor:
        """Append one token to each sequence and run them as one decode step; returns ``[num_seqs,
        vocab]``."""
        for sid, t in zip(seq_ids, token_ids, strict=True):
            self.cache.append_slots(sid, [t])
        return self.forward(prepare_step(self.cache, seq_ids))

    def greedy(self, seq_ids: Sequence[Hashable], first_logits: torch.Tensor,
               max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of sequences already prefilled (``first_logits`` ``[num_seqs, vocab]`` from
        their last step): ``max_new_tokens`` tokens each, decoded together."""
        out = [[t] for t in first_logits.argmax(-1).tolist()]
        for _ in range(max_new_tokens - 1):
            logits = self.decode(seq_ids, [o[-1] for o in out])
            for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
                o.append(t)
        return out
