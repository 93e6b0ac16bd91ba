"""Attention for the model: dense causal attention (the plain forward) and attention over the paged KV cache for
a flat batch of tokens (the engine's forward), with an optional sliding window in both.

The paged path's input is a step's ``ModelInput`` (``labkit.model.step``, vLLM's names). On the torch path it runs
the references of ``labkit.kvcache.attention`` (``paged_prefill_attention_ref``: every row causally over its
sequence's cached tokens; the decode rows batched), with the layer's window as their ``window`` argument; on the
Triton path the kernels of ``labkit.kernels`` (``FusionPlan.attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.kvcache.attention import dequantised_blocks, paged_decode_attention_ref, paged_prefill_attention_ref
from labkit.kvcache.paged import PagedKVCache
from labkit.model.step import ModelInput


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


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, inp: ModelInput, scale: float,
                    window: int | None = None, kernel: str = "torch", pdl: str = "") -> torch.Tensor:
    """Attention of every query row ``q`` ``[num_tokens, heads, head_dim]`` over ``layer``'s pools of ``cache``
    (this step's K/V already written); ``window``: the layer's sliding window or None.

    ``kernel`` 'torch': the references of ``labkit.kvcache.attention`` (the decode rows batched, prefill rows per
    sequence); 'triton': ``labkit.kernels.paged_attention`` for an all-decode step (``pdl``: its launch mode),
    ``paged_prefill_attention`` for every row of a step with prefill chunks, in one launch whose grid depends on
    shapes only (no window: ``FusionPlan.fit`` keeps sliding-window layers on torch). An int8/fp8 cache, or one
    stored in another dtype than ``q``, is read through ``dequantised_blocks``."""
    if cache.fmt.quantised or cache.fmt.storage_dtype != q.dtype:
        k_cache, v_cache, tables = dequantised_blocks(cache, layer, inp.block_tables, q.dtype)
    else:
        k_cache, v_cache, tables = cache.k_caches[layer], cache.v_caches[layer], inp.block_tables
    d = inp.num_decodes
    if kernel == "triton":
        if window is not None:
            raise ValueError(f"kernel='triton' has no sliding window (window={window}); use 'torch'")
        if d == inp.num_seqs:
            from labkit.kernels.paged_attention import paged_attention as decode

            # check=False: the engine's tables come from its allocator (width checked when packed); the host check
            # would synchronise every layer and break a graph capture
            return decode(q, k_cache, v_cache, tables, inp.context_lens, scale=scale, pdl=pdl, check=False)
        from labkit.kernels.paged_prefill_attention import paged_prefill_attention

        return paged_prefill_attention(q, k_cache, v_cache, tables, inp.query_start_loc, inp.context_lens, scale,
                                       out=torch.zeros_like(q),  # padding rows of a captured step stay finite
                                       check=False)
    if d == inp.num_seqs:
        return paged_decode_attention_ref(q, k_cache, v_cache, tables, inp.context_lens, scale, window)
    out = torch.empty_like(q)
    if d:
        out[:d] = paged_decode_attention_ref(q[:d], k_cache, v_cache, tables[:d], inp.context_lens[:d], scale,
                                             window)
    qsl = inp.query_start_loc[d:] - inp.query_start_loc[d]
    out[d:] = paged_prefill_attention_ref(q[d:], k_cache, v_cache, tables[d:], qsl, inp.context_lens[d:], scale,
                                          window)
    return out
