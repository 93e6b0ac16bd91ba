"""Causal attention of a step's query tokens over the paged KV cache: prefill chunks and decode rows in one
launch, with nothing chosen on the host from the step's values, so a whole mixed step can be captured in a CUDA
graph.

Layout: pools and ``block_tables`` as in ``labkit.kernels.paged_attention``; ``q`` ``[num_tokens, num_heads,
head_dim]`` with the sequences' query tokens back to back; ``query_start_loc`` int32 ``[num_seqs + 1]`` (sequence
``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]``; a padding sequence owns none);
``context_lens`` int32 ``[num_seqs]``, tokens cached after this step's writes, so sequence ``s``'s queries sit at
positions ``context_len - query_len ... context_len - 1`` and query ``i`` of it sees keys ``0 ...
context_len - query_len + i`` (bottom-right causal, as ``flash_attention``). The reference is
``labkit.kvcache.attention.paged_prefill_attention_ref``.

Why not ``flash_attention`` per chunk: that loop launches one kernel per sequence, and its grid depends on each
chunk's length, a host value; a CUDA graph replays the grid of its capture. Here the grid depends only on the
shapes: ``num_tokens // BLOCK_M + num_seqs`` query tiles per KV head covers any split of the tokens into
sequences (each sequence needs ``ceil(len / BLOCK_M)`` tiles, and the tiles of sequence ``s`` are numbered from
``query_start_loc[s] // BLOCK_M + s``, the scheme of vLLM's unified attention), and each program finds its
sequence by a binary search over ``query_start_loc`` on the device. Tiles past a sequence's queries exit at once.

A program owns ``BLOCK_M`` query tokens of one sequence and all ``num_heads / num_kv_heads`` query heads of one
KV head (GQA: each K/V tile is gathered once for the group), i.e. ``BLOCK_M x group`` rows of one ``tl.dot``.
It walks the key tiles through the block table up to its last query's position with an online softmax in
float32, and writes normalised outputs. FLOPs of attention are small next to the projections of the same tokens
(``4 x context x head_dim`` per query and head against ``2 x parameters``), so the kernel is kept simple: no
split of long contexts (decode-only steps keep ``paged_attention``'s flash-decoding path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import (
    FLOAT_DTYPES,
    check_block_tables,
    check_tensor,
    next_pow2,
    refuse_bf16_dot_on_cpu,
    should_check,
)
from labkit.kernels.paged_attention import _block_slots, _kv_tile, check_pools_fit_q

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_ptr, tile, num_seqs, BLOCK_M: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """The last sequence ``s`` whose first tile ``query_start[s] // BLOCK_M + s`` is ``<= tile``."""
    lo = 0
    hi = num_seqs - 1
    for _ in range(SEARCH_STEPS):  # a fixed trip count: log2(num_seqs) halvings always suffice
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_M + mid
        go_up = first <= tile
        lo = tl.where(go_up, mid, lo)
        hi = tl.where(go_up, hi, mid - 1)
    return lo


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                          num_seqs, group, qk_scale, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh, stride_bt, stride_ot, stride_oh,
                          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                          SEARCH_STEPS: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(query_start_ptr, tile, num_seqs, BLOCK_M, SEARCH_STEPS)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    m0 = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M  # first query of this tile within the sequence
    if m0 < q_len:
        ctx = tl.load(context_lens_ptr + seq)
        first_pos = ctx - q_len  # position of the sequence's first query token
        # rows: BLOCK_M tokens x BLOCK_G heads of the group, token-major
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        tok = m0 + r // BLOCK_G
        g = r % BLOCK_G
        row_ok = (tok < q_len) & (g < group)
        q_pos = first_pos + tok  # each row's position: it sees keys 0 ... q_pos
        head = kvh * group + g
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M * BLOCK_G], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        kv_head_off = kvh.to(tl.int64)
        seq64 = seq.to(tl.int64)
        end = tl.minimum(ctx, first_pos + m0 + BLOCK_M)  # keys past the tile's last query are never seen
        for n0 in range(0, end, BLOCK_N):
            key = n0 + offs_n
            k_ok = key < end
            blk, in_blk = _block_slots(block_tables_ptr, seq64 * stride_bt, key, k_ok, BLOCK_SIZE)
            ld_mask = k_ok[:, None] & d_ok[None, :]
            k = _kv_tile(k_ptr, blk, in_blk, kv_head_off, stride_kb, stride_kt, stride_kh, offs_d, ld_mask)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            seen = (key[None, :] <= q_pos[:, None]) & k_ok[None, :]
            qk = tl.where(seen, qk, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that have seen nothing yet stay at 0
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _kv_tile(v_ptr, blk, in_blk, kv_head_off, stride_vb, stride_vt, stride_vh, offs_d, ld_mask)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def query_tiles(num_tokens: int, num_seqs: int, block_m: int) -> int:
    """Programs per KV head that cover any split of ``num_tokens`` queries into ``num_seqs`` sequences."""
    return num_tokens // block_m + num_seqs


def _block_m(num_tokens: int, block_g: int) -> int:
    # 64 rows per program for short steps (decode rows waste the rest of a tile), 128 once chunks are long
    rows = 128 if num_tokens >= 1024 else 64
    return max(1, rows // block_g)


def _check_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens) -> None:
    check_tensor("q", q, FLOAT_DTYPES, dim=3)
    check_tensor("k_cache", k_cache, (q.dtype,), dim=4, device=q.device)
    check_tensor("v_cache", v_cache, (q.dtype,), dim=4, device=q.device)
    check_tensor("block_tables", block_tables, (torch.int32,), dim=2, device=q.device)
    check_tensor("query_start_loc", query_start_loc, (torch.int32,), dim=1, device=q.device)
    check_tensor("context_lens", context_lens, (torch.int32,), dim=1, device=q.device)
    refuse_bf16_dot_on_cpu("q", q)
    check_pools_fit_q(q, k_cache, v_cache)
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1 or num_seqs == 0:
        raise ValueError(f"need block_tables [num_seqs, max_blocks], query_start_loc [num_seqs + 1] and "
                         f"context_lens [num_seqs] with num_seqs >= 1; got {tuple(block_tables.shape)}, "
                         f"{tuple(query_start_loc.shape)} and {tuple(context_lens.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, block_tables)):
        raise ValueError("q, k_cache, v_cache and block_tables need a contiguous last dimension")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float | None = None, out: torch.Tensor | None = None,
                            check: bool | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached tokens (layout in the module docstring).

    ``q`` ``[num_tokens, num_heads, head_dim]`` (float16, bfloat16 on CUDA, float32); caches of ``q``'s dtype
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_tables`` int32 ``[num_seqs, max_blocks]``;
    ``query_start_loc`` int32 ``[num_seqs + 1]``, non-decreasing from 0, its last entry at most ``num_tokens``;
    ``context_lens`` int32 ``[num_seqs]``, each at least its sequence's query count. ``check``: check these values
    and the block ids they reach on the host (``common.check_block_tables``, one copy per call); default (``None``)
    on, except while a CUDA graph is captured; ``False`` where the caller checked the step already (the engine). The
    device never checks them (the call stays capturable); rows past ``query_start_loc[-1]`` are left as they were
    in ``out``. Returns ``out`` (default a new tensor like ``q``): ``[num_tokens, num_heads, head_dim]``.
    """
    _check_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    if should_check(check, q):
        check_block_tables(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1], query_start_loc,
                           q.shape[0])
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype} on "
                         f"{q.device} with a contiguous last dimension")
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = next_pow2(group)
    block_m = _block_m(num_tokens, block_g)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    grid = (query_tiles(num_tokens, num_seqs, block_m), num_kv_heads)
    on_gpu = q.device.type == "cuda"
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens, num_seqs, group, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_M=block_m, BLOCK_G=block_g,
        BLOCK_N=64 if on_gpu else 32, SEARCH_STEPS=max(1, (num_seqs - 1).bit_length()),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact
        num_warps=4 if block_m * block_g <= 64 else 8, num_stages=2 if on_gpu else 1)
    return out
