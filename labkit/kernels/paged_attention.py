"""Decode attention over a paged KV cache.

Layout (shared with ``labkit.kvcache.PagedKVCache``):

* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one pair per layer
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; entry ``j`` of row ``s`` is the physical block that
  holds tokens ``j * block_size ... (j + 1) * block_size - 1`` of sequence ``s`` (entries past the sequence's last
  block are ignored and may hold anything)
* ``context_lens``: int32 ``[num_seqs]``, tokens cached for each sequence (the new token's K/V already written)
* ``q``: ``[num_seqs, num_heads, head_dim]``, one query token per sequence; ``num_heads % num_kv_heads == 0``
"""

from __future__ import annotations

import torch


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Torch reference: gather each sequence's blocks into a contiguous K/V, then softmax(q k^T * scale) v.

    Returns ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype; the arithmetic is done in float32.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for s in range(num_seqs):
        n = int(context_lens[s])
        blocks = block_tables[s, : (n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()  # [n, kv, d]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, h, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float(), k) * scale
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
