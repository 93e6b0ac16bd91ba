"""Attention for the model: dense causal attention (the plain forward) and attention over the paged KV cache for
a flat batch of tokens (the engine's forward), with an optional sliding window in both.

The paged path's inputs carry vLLM's names (``AttentionMetadata``). On the torch path it runs the references of
``labkit.kvcache.attention`` (``paged_prefill_attention_ref``: every row causally over its sequence's cached
tokens, decode rows included); a sliding-window layer whose contexts outgrow the window runs
``paged_window_attention_ref`` here instead, the same reference with the window's lower edge in its mask.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.kvcache.attention import dequantised_blocks, paged_prefill_attention_ref
from labkit.kvcache.paged import PagedKVCache


@dataclass
class AttentionMetadata:
    """Where a flat batch of ``num_tokens`` query tokens of ``num_seqs`` sequences sits in the paged cache.

    Sequences lie back to back in the token dimension; the ``num_decodes`` leading sequences have one token each
    (decode rows first, as the engine schedules them). Device tensors:

    * ``slot_mapping``: int64 ``[num_tokens]``, each token's cache slot (``block * block_size + offset``); its K
      and V are written there before attention
    * ``block_tables``: int32 ``[num_seqs, max_blocks]``, each sequence's physical blocks (padding never read)
    * ``context_lens``: int32 ``[num_seqs]``, tokens each sequence has cached after this step's writes (so its
      queries sit at positions ``context_len - query_len ... context_len - 1``)
    * ``query_start_loc``: int32 ``[num_seqs + 1]``, sequence ``s`` owns token rows
      ``query_start_loc[s]:query_start_loc[s + 1]`` (vLLM's ``cu_seqlens_q``)
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int = 0

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def logits_indices(self) -> torch.Tensor:
        """int64 ``[num_seqs]``: the row of each sequence's last token."""
        return self.query_start_loc[1:].long() - 1

    def token_seq_lens(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: the context length of each token's sequence (what 'dynamic' RoPE needs)."""
        query_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
        return self.context_lens.long().repeat_interleave(query_lens, output_size=self.num_tokens)

    def check(self, num_tokens: int) -> None:
        """Shapes and dtypes agree (host-side metadata only: no device sync)."""
        n = self.num_seqs
        for name, t, dtypes, shape in (
                ("slot_mapping", self.slot_mapping, (torch.int64, torch.int32), (num_tokens,)),
                ("context_lens", self.context_lens, (torch.int32, torch.int64), (n,)),
                ("query_start_loc", self.query_start_loc, (torch.int32, torch.int64), (n + 1,))):
            if t.dtype not in dtypes or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {dtypes[0]} of shape {shape}, got {t.dtype} {tuple(t.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != n:
            raise ValueError(f"block_tables must be [num_seqs={n}, max_blocks], got {tuple(self.block_tables.shape)}")
        if not 0 <= self.num_decodes <= min(n, num_tokens):
            raise ValueError(f"num_decodes={self.num_decodes} must be in [0, {min(n, num_tokens)}]")

    @classmethod
    def from_cache(cls, cache: PagedKVCache, seq_ids: Sequence[Hashable], query_lens: Sequence[int],
                   num_decodes: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, metadata)`` for a step computing the last ``query_lens[i]`` tokens that
        ``cache`` holds slots for in sequence ``seq_ids[i]`` (after ``allocate`` / ``append_slots``). The host
        bookkeeping a test or a simple driver needs; the engine packs the same tensors itself."""
        if len(seq_ids) != len(query_lens) or not seq_ids:
            raise ValueError(f"seq_ids ({len(seq_ids)}) and query_lens ({len(query_lens)}) must be equally long "
                             f"and not empty")
        ids, pos, slots = [], [], []
        for sid, m in zip(seq_ids, query_lens):
            seq = cache.seq(sid)
            n = seq.num_tokens
            if not 1 <= m <= n:
                raise ValueError(f"query_lens: {m} tokens of sequence {sid!r}, which holds {n}")
            ids += seq.token_ids[n - m:]
            pos += range(n - m, n)
            slots += cache.slots(sid, n - m, n)
        dev = cache.device
        starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = cls(torch.tensor(slots, dtype=torch.int64, device=dev), cache.block_tables(seq_ids),
                   cache.context_lens(seq_ids), starts.to(dev), num_decodes)
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Dense causal attention, ``q`` ``[batch, T, heads, head_dim]``, ``k``/``v`` ``[batch, T, kv_heads,
    head_dim]`` -> ``[batch, T, heads, head_dim]``; with ``window``, query ``i`` sees keys ``i - window < j <=
    i`` (HF's sliding-window mask). KV heads are repeated for grouped-query attention."""
    T, group = q.shape[1], q.shape[2] // k.shape[2]
    i = torch.arange(T, device=q.device)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def paged_window_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """``paged_prefill_attention_ref`` with a sliding window: a query at position ``p`` sees the cached keys
    ``p - window < j <= p``. Shapes and dtypes as there: ``q`` ``[num_tokens, heads, head_dim]``, pools ``[num_blocks,
    block_size, kv_heads, head_dim]``; float32 arithmetic; returns ``q``'s dtype."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    out = torch.full_like(q, float("nan"))
    for s, n in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]].float()
        m = q_s.shape[0]
        lo = max(0, n - m - window + 1)  # the first key any of these queries can see
        b0 = lo // block_size
        blocks = block_tables[s, b0:(n + block_size - 1) // block_size].long()
        first = b0 * block_size  # position of the first gathered key
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n - first].float().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n - first].float().repeat_interleave(group, 1)
        q_pos = torch.arange(n - m, n, device=q.device)[:, None]
        k_pos = torch.arange(first, n, device=q.device)[None, :]
        seen = (k_pos <= q_pos) & (k_pos > q_pos - window)
        scores = torch.einsum("mhd,nhd->hmn", q_s, k) * scale
        p = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        out[starts[s]:starts[s + 1]] = torch.einsum("hmn,nhd->mhd", p, v).to(q.dtype)
    return out


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Attention of every query row ``q`` ``[num_tokens, heads, head_dim]`` over ``layer``'s pools of ``cache``
    (this step's K/V already written), torch references; ``window``: the layer's sliding window or None.

    An int8/fp8 cache, or one stored in another dtype than ``q``, is read through ``dequantised_blocks``."""
    if cache.fmt.quantised or cache.fmt.storage_dtype != q.dtype:
        k_cache, v_cache, tables = dequantised_blocks(cache, layer, meta.block_tables, q.dtype)
    else:
        k_cache, v_cache, tables = cache.k_caches[layer], cache.v_caches[layer], meta.block_tables
    if window is not None and int(meta.context_lens.max()) > window:
        return paged_window_attention_ref(q, k_cache, v_cache, tables, meta.query_start_loc, meta.context_lens,
                                          scale, window)
    return paged_prefill_attention_ref(q, k_cache, v_cache, tables, meta.query_start_loc, meta.context_lens, scale)
