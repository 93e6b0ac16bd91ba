"""Attention over the paged cache for a flat batch of query tokens: prefill chunks and decode tokens alike.

The torch reference of paged attention, the one the engine's torch path runs and the kernels are tested against:

* ``paged_prefill_attention_ref``: gather each sequence's blocks, causal mask offset by the tokens already
  cached. It covers decode too (one query per sequence) and chunks that attend to a cached prefix.
* ``paged_decode_attention_ref``: the one-query case, batched (no loop over sequences), so the engine's CPU
  decode steps stay cheap.
* ``decode_attention``: one query per sequence; the Triton ``paged_attention`` kernel on CUDA (int8/fp8 pools
  dequantised in registers), else ``paged_decode_attention_ref``.
* ``dequantised_blocks`` / ``dequantise_gathered``: the blocks a batch reads, dequantised, with block tables remapped
  onto them, so the torch references run unchanged on int8/fp8 caches (dequantise on read).
"""

from __future__ import annotations

import torch

from labkit.kvcache.paged import raw
from labkit.kvcache.quant import dequantize_kv

BACKENDS = ("auto", "torch", "triton")


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float | None = None,
                                window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over all of its cached tokens (new ones included); with
    ``window`` (a sliding-window layer) a query at position ``p`` sees the keys ``p - window < j <= p`` only.

    ``q``: ``[num_tokens, num_heads, head_dim]``, sequences back to back; ``query_start_loc``: int
    ``[num_seqs + 1]`` (sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``);
    ``context_lens``: int ``[num_seqs]``, cached tokens after this step's writes, so the queries sit at
    positions ``context_len - query_len ... context_len - 1``. Pools and ``block_tables`` as in
    ``paged_decode_attention_ref``. Returns ``[num_tokens, num_heads, head_dim]`` in ``q``'s dtype; arithmetic in
    float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    out = torch.full_like(q, float("nan"))
    for s, n in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]].float()  # [m, h, d]
        m = q_s.shape[0]
        # with a window, gather from the first block any of these queries can see
        b0 = 0 if window is None else max(0, n - m - window + 1) // block_size
        first = b0 * block_size  # position of the first gathered key
        blocks = block_tables[s, b0:(n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n - first].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n - first].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q_s, k) * scale
        q_pos = torch.arange(n - m, n, device=q.device)[:, None]
        k_pos = torch.arange(first, n, device=q.device)[None, :]
        seen = k_pos <= q_pos  # [m, n - first]
        if window is not None:
            seen &= k_pos > q_pos - window
        scores = scores.masked_fill(~seen, float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Decode attention in plain torch, batched: gather every row's blocks, mask past its context (and, with
    ``window``, keys at or before ``context_len - 1 - window``), softmax in float32. ``q`` ``[num_seqs, heads,
    head_dim]``; pools ``[num_blocks, block_size, kv_heads, head_dim]``;
    ``block_tables`` int ``[num_seqs, width]`` (entries past a sequence's blocks may be anything in range);
    ``context_lens`` int ``[num_seqs]``. Returns ``[num_seqs, heads, head_dim]`` in ``q``'s dtype."""
    s, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    scale = d ** -0.5 if scale is None else scale
    n = block_tables.shape[1] * bs
    k = k_cache[block_tables.long()].view(s, n, kvh, d).float()
    v = v_cache[block_tables.long()].view(s, n, kvh, d).float()
    pos = torch.arange(n, device=q.device)[None, :]
    past = pos >= context_lens[:, None]  # [s, n]
    v = v.masked_fill(past[:, :, None, None], 0.0)
    if window is not None:
        past |= pos <= context_lens[:, None] - 1 - window  # slots past the context may hold anything, NaN included
    scores = torch.einsum("skgd,snkd->skgn", q.view(s, kvh, h // kvh, d).float(), k) * scale
    p = scores.masked_fill(past[:, None, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("skgn,snkd->skgd", p, v).reshape(s, h, d).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                     backend: str = "auto", k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, ``q`` ``[num_seqs, num_heads, head_dim]``; ``backend`` 'auto' (Triton on CUDA, else
    torch), 'torch' or 'triton' (``labkit.kernels.paged_attention``, imported when first asked for).

    int8/fp8 caches come with ``k_scale``/``v_scale`` float32 ``[num_blocks, block_size, num_kv_heads]``: the
    Triton kernel dequantises them in registers (reading one byte per element); the torch path first
    dequantises the blocks the batch names (``dequantise_gathered``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {BACKENDS}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together (int8/fp8 caches) or not at all")
    quant = k_scale is not None
    if (backend == "triton" or (backend == "auto" and q.is_cuda)) and (quant or k_cache.dtype == q.dtype):
        from labkit.kernels.paged_attention import paged_attention

        extra = {"k_scale": k_scale, "v_scale": v_scale} if quant else {}
        return paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=scale, **extra)
    if quant:
        k_cache, v_cache, block_tables = dequantise_gathered(k_cache, v_cache, k_scale, v_scale, block_tables,
                                                             q.dtype)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale=scale)


def dequantise_gathered(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                        v_scale: torch.Tensor | None, block_tables: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, v, block_tables)``: only the blocks named in ``block_tables`` (padding included, harmlessly),
    dequantised (or cast) to ``dtype``, and the tables renumbered to index them."""
    used = block_tables.flatten().unique().long()
    ks = None if k_scale is None else k_scale[used]
    vs = None if v_scale is None else v_scale[used]
    k = dequantize_kv(raw(k_cache)[used].view(k_cache.dtype), ks, dtype)
    v = dequantize_kv(raw(v_cache)[used].view(v_cache.dtype), vs, dtype)
    lut = torch.zeros(k_cache.shape[0], dtype=torch.int32, device=block_tables.device)
    lut[used] = torch.arange(used.numel(), dtype=torch.int32, device=block_tables.device)
    return k, v, lut[block_tables.long()]


def dequantised_blocks(cache, layer: int, block_tables: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dequantise_gathered`` for one layer of a ``PagedKVCache`` (any format)."""
    cache.check_layer(layer)
    q = cache.fmt.quantised
    return dequantise_gathered(cache.k_caches[layer], cache.v_caches[layer], cache.k_scales[layer] if q else None,
                               cache.v_scales[layer] if q else None, block_tables, dtype)
