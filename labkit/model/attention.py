"""Attention for the model: dense causal attention (the plain forward) and attention over the paged KV cache for
a flat batch of tokens (the engine's forward), with an optional sliding window in both.

The paged path's inputs carry vLLM's names (``AttentionMetadata``). On the torch path it runs the references of
``labkit.kvcache.attention`` (``paged_prefill_attention_ref``: every row causally over its sequence's cached
tokens; the decode rows batched), with the layer's window as their ``window`` argument; on the Triton path the
kernels of ``labkit.kernels`` (``FusionPlan.attention``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.kvcache.attention import dequantised_blocks, paged_decode_attention_ref, paged_prefill_attention_ref
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
    rows: torch.Tensor | None = None  # the rows whose logits a step returns (None: each sequence's last)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def logits_indices(self) -> torch.Tensor:
        """int ``[num_seqs]``: the rows whose logits the step returns: ``rows`` if given, else each sequence's last
        token's."""
        return self.rows if self.rows is not None else self.query_start_loc[1:].long() - 1

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


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float,
                    window: int | None = None, kernel: str = "torch", pdl: str = "") -> torch.Tensor:
    """Attention of every query row ``q`` ``[num_tokens, heads, head_dim]`` over ``layer``'s pools of ``cache``
    (this step's K/V already written); ``window``: the layer's sliding window or None.

    ``kernel`` 'torch': the references of ``labkit.kvcache.attention`` (the decode rows batched, prefill rows per
    sequence); 'triton': ``labkit.kernels.paged_attention`` for an all-decode step (``pdl``: its launch mode),
    ``paged_prefill_attention`` for every row of a step with prefill chunks, in one launch whose grid depends on
    shapes only (no window: ``FusionPlan.fit`` keeps sliding-window layers on torch). An int8/fp8 cache, or one
    stored in another dtype than ``q``, is read through ``dequantised_blocks``."""
    if cache.fmt.quantised or cache.fmt.storage_dtype != q.dtype:
        k_cache, v_cache, tables = dequantised_blocks(cache, layer, meta.block_tables, q.dtype)
    else:
        k_cache, v_cache, tables = cache.k_caches[layer], cache.v_caches[layer], meta.block_tables
    d = meta.num_decodes
    if kernel == "triton":
        if window is not None:
            raise ValueError(f"kernel='triton' has no sliding window (window={window}); use 'torch'")
        if d == meta.num_seqs:
            from labkit.kernels.paged_attention import paged_attention as decode

            # check=False: the engine's tables come from its allocator (width checked when packed); the host check
            # would synchronise every layer and break a graph capture
            return decode(q, k_cache, v_cache, tables, meta.context_lens, scale=scale, pdl=pdl, check=False)
        from labkit.kernels.paged_prefill_attention import paged_prefill_attention

        return paged_prefill_attention(q, k_cache, v_cache, tables, meta.query_start_loc, meta.context_lens, scale,
                                       out=torch.zeros_like(q),  # padding rows of a captured step stay finite
                                       check=False)
    if d == meta.num_seqs:
        return paged_decode_attention_ref(q, k_cache, v_cache, tables, meta.context_lens, scale, window)
    out = torch.empty_like(q)
    if d:
        out[:d] = paged_decode_attention_ref(q[:d], k_cache, v_cache, tables[:d], meta.context_lens[:d], scale,
                                             window)
    qsl = meta.query_start_loc[d:] - meta.query_start_loc[d]
    out[d:] = paged_prefill_attention_ref(q[d:], k_cache, v_cache, tables[d:], qsl, meta.context_lens[d:], scale,
                                          window)
    return out
