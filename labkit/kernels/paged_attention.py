"""Decode attention over a paged KV cache.

Layout (shared with ``labkit.kvcache.PagedKVCache``):

* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one pair per layer
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; entry ``j`` of row ``s`` is the physical block
  that holds tokens ``j * block_size ... (j + 1) * block_size - 1`` of sequence ``s`` (entries past the
  sequence's last block are ignored and may hold anything)
* ``context_lens``: int32 ``[num_seqs]``, tokens cached for each sequence (the new token's K/V already
  written)
* ``q``: ``[num_seqs, num_heads, head_dim]``, one query token per sequence; ``num_heads % num_kv_heads == 0``
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import (
    FLOAT_DTYPES,
    check_block_tables,
    check_pdl,
    check_tensor,
    next_pow2,
    num_sms,
    pdl_launch,
    refuse_bf16_dot_on_cpu,
    should_check,
)
from labkit.kernels.quantized_matmul.ptx import kv_as_16bit


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
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


# --- Triton kernel ----------------------------------------------------------------------------------------
# Decode attention is memory-bound: each step reads every cached K/V byte once and does 4 FLOPs per byte pair,
# far below the ridge point. So the kernel is built around the loads: one program per (sequence, KV head,
# context split) reads its KV head once for all ``num_heads / num_kv_heads`` query heads that share it (GQA),
# gathering ``BLOCK_N`` tokens per step through the block table. Long contexts at small batch leave most SMs
# idle with one program per (sequence, KV head); the split-context path (flash-decoding) cuts each context
# into ``num_splits`` ranges processed in parallel, each writing an un-normalised partial output with its row
# maximum and sum, and a second small kernel merges them (the online-softmax rescaling, across programs).
# Each sequence's ranges are cut from its own context length, on the device: a CUDA-graph step's block tables
# are max_model_len wide whatever the sequences hold, so ranges cut from the table width would leave a short
# context in one range of a long split.

LOG2E = 1.4426950408889634
QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
# Ranges of at least one 16-token block: at batch 1 short contexts want many short ranges, each program one small
# tile (research/records/h200/attention_splits_4aec4fc.json); the 4-programs-per-SM target binds at larger batches.
# The default of ``auto_num_splits``' ``min_split_tokens``.
MIN_SPLIT_TOKENS = 16


@triton.jit
def _block_slots(block_tables_ptr, row_off, tok, ok, BLOCK_SIZE: tl.constexpr):
    """Token index -> (physical block, offset in it) through one sequence's block table (vLLM's slot arithmetic);
    ``row_off`` is the table row's offset, ``ok`` masks tokens past the range."""
    blk = tl.load(block_tables_ptr + row_off + tok // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    return blk, (tok % BLOCK_SIZE).to(tl.int64)


@triton.jit
def _kv_tile(pool_ptr, blk, in_blk, head_off, stride_b, stride_t, stride_h, offs_d, mask):
    """``[tokens, head_dim]`` of one KV head gathered from a pool ``[num_blocks, block_size, kv_heads, head_dim]``."""
    return tl.load(pool_ptr + blk[:, None] * stride_b + in_blk[:, None] * stride_t + head_off * stride_h
                   + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _attend_tile(q, k, v, t_ok, blk, in_blk, kv_head_off, m_i, l_i, acc, k_scale_ptr, v_scale_ptr, stride_sb,
                 stride_st, stride_sh, qk_scale, KV_QUANT: tl.constexpr, PRECISION: tl.constexpr,
                 PTX: tl.constexpr):
    """One tile of the online softmax: ``q`` ``[G, D]`` against ``k``, ``v`` ``[N, D]`` (rows where ``t_ok``);
    returns the running maximum, sum and un-normalised output, updated. Quantised K/V are multiplied in ``q``'s
    dtype (float16 for 16-bit queries -- ``paged_attention`` passes them as float16 then -- float32 otherwise)."""
    if KV_QUANT:
        # int8/fp8 K with one scale per (token, head): q . (kq * s) = (q . kq) * s, so the scale is
        # applied to the [G, N] scores, not to the [N, D] tile
        slot = blk * stride_sb + in_blk * stride_st + kv_head_off * stride_sh
        ks = tl.load(k_scale_ptr + slot, mask=t_ok, other=0.0)
        vs = tl.load(v_scale_ptr + slot, mask=t_ok, other=0.0)
        qk = tl.dot(q, tl.trans(kv_as_16bit(k, q.dtype, PTX)), input_precision=PRECISION) * (ks * qk_scale)[None, :]
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    qk = tl.where(t_ok[None, :], qk, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT:  # p @ (vq * s) = (p * s) @ vq
        acc = tl.dot((p * vs[None, :]).to(q.dtype), kv_as_16bit(v, q.dtype, PTX), acc * alpha[:, None],
                     input_precision=PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr,
                       part_ml_ptr, k_scale_ptr, v_scale_ptr, qk_scale, group, n_heads, n_splits,
                       stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                       stride_sb, stride_st, stride_sh, stride_bt, stride_os, stride_oh, CTX_BUCKET, table_len,
                       BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       KV_QUANT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
                       ONE_TILE: tl.constexpr = False, PTX: tl.constexpr = False):
    """One program per (sequence, KV head, context range). ``ONE_TILE`` (with ``SPLIT``; the host knows every
    range of a ``table_len``-token table fits one tile): range ``split`` is tokens ``split * BLOCK_N ...`` whatever
    the context, so its block-table entries are read alongside the context length, not after it -- one memory round
    trip fewer before K and V (sm_90 at BLOCK_N 16: 72 registers against 163 for the general loop)."""
    if PDL:  # the launch after this one may start now (see ``paged_attention``'s ``pdl``)
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N) * BLOCK_N  # whole tiles; trailing ranges may be empty
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, BLOCK_G)
    heads = kvh * group + g
    h_ok = g < group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    kv_head_off = kvh.to(tl.int64)
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if KV_QUANT and q.dtype == tl.bfloat16:
        # 8-bit K/V are exact in float16, and a query's float16 rounding (2**-11) is finer than bfloat16's:
        # float16 Tensor Core operands, where int8 and fp8 convert without going through float32
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if ONE_TILE:
        tok = split * BLOCK_N + offs_n  # == start + offs_n: split_len is BLOCK_N for every context
        blk, in_blk = _block_slots(block_tables_ptr, seq * stride_bt, tok, tok < table_len, BLOCK_SIZE)
        if start < end:
            t_ok = tok < end
            ld_mask = t_ok[:, None] & d_ok[None, :]
            k = _kv_tile(k_ptr, blk, in_blk, kv_head_off, stride_kb, stride_kt, stride_kh, offs_d, ld_mask)
            v = _kv_tile(v_ptr, blk, in_blk, kv_head_off, stride_vb, stride_vt, stride_vh, offs_d, ld_mask)
            m_i, l_i, acc = _attend_tile(q, k, v, t_ok, blk, in_blk, kv_head_off, m_i, l_i, acc, k_scale_ptr,
                                         v_scale_ptr, stride_sb, stride_st, stride_sh, qk_scale, KV_QUANT,
                                         PRECISION, PTX)
    else:
        for t0 in range(start, end, BLOCK_N):
            tok = t0 + offs_n
            t_ok = tok < end
            blk, in_blk = _block_slots(block_tables_ptr, seq * stride_bt, tok, t_ok, BLOCK_SIZE)
            ld_mask = t_ok[:, None] & d_ok[None, :]
            k = _kv_tile(k_ptr, blk, in_blk, kv_head_off, stride_kb, stride_kt, stride_kh, offs_d, ld_mask)
            # V's loads go out with K's, not after the scores: a short range (a decode step's few tiles) waits
            # for one memory round trip instead of two
            v = _kv_tile(v_ptr, blk, in_blk, kv_head_off, stride_vb, stride_vt, stride_vh, offs_d, ld_mask)
            m_i, l_i, acc = _attend_tile(q, k, v, t_ok, blk, in_blk, kv_head_off, m_i, l_i, acc, k_scale_ptr,
                                         v_scale_ptr, stride_sb, stride_st, stride_sh, qk_scale, KV_QUANT,
                                         PRECISION, PTX)
    if SPLIT:
        # partials: acc [seq, head, split, D] un-normalised; (m, l) [seq, head, split, 2]
        row = (seq * n_heads + heads) * n_splits + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=h_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty context gives zeros, not NaN
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_head(part_acc_ptr, part_ml_ptr, out_ptr, seq, h, n_heads, n_splits, stride_os, stride_oh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """Query head ``h`` of sequence ``seq``: its ranges' partials rescaled to their common maximum and summed.
    The loads bypass L1 (``.cg``): other SMs wrote the partials."""
    sp = tl.arange(0, BLOCK_SPLITS)
    sp_ok = sp < n_splits
    offs_d = tl.arange(0, BLOCK_D)
    row = (seq * n_heads + h) * n_splits + sp
    m = tl.load(part_ml_ptr + row * 2, mask=sp_ok, other=-float("inf"), cache_modifier=".cg")
    lsum = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 0)
    w = tl.where(m == -float("inf"), 0.0, tl.math.exp2(m - m_max))  # empty splits weigh nothing
    total = tl.sum(w * lsum, 0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=sp_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _paged_attn_reduce(part_acc_ptr, part_ml_ptr, out_ptr, n_heads, n_splits, stride_os, stride_oh,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:  # launched while the split kernel runs: release the next launch, then wait for the partials
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _merge_head(part_acc_ptr, part_ml_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), n_heads,
                n_splits, stride_os, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_SPLITS)


def _configs() -> list:
    # memory-bound gathers: enough tokens per step and enough stages to keep loads in flight on Hopper
    cfgs = [(64, 4, 3), (128, 4, 3), (64, 8, 3), (32, 4, 4)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in cfgs]


# Where every range fits in one tile of at most this many tokens, the tile is picked, not autotuned: a decode
# step's ranges are that short at small batch, and the autotuner would time whatever context its first call
# has -- in the engine the CUDA-graph warm-up's padding rows, one token each
# (results/h200/logs/2026-12-04f_call5_attention_splits_kernel.log).
SHORT_RANGE_TOKENS = 64


def short_range_tile(max_context: int, num_splits: int) -> dict | None:
    """The split kernel's tile where no range of a ``max_context``-token table cut into ``num_splits`` needs more
    than one tile of ``SHORT_RANGE_TOKENS``: the smallest power of two of at least 16 tokens that holds a range,
    4 warps, 1 stage (nothing to pipeline in one tile). None for longer ranges (the autotuner picks)."""
    longest = -(-max_context // num_splits)
    if longest > SHORT_RANGE_TOKENS:
        return None
    return dict(BLOCK_N=max(16, next_pow2(longest)), num_warps=4, num_stages=1)


_paged_attn_tuned = triton.autotune(configs=_configs(),
                                    key=["CTX_BUCKET", "n_splits", "BLOCK_SIZE", "HEAD_DIM", "BLOCK_G",
                                         "SPLIT", "KV_QUANT"],
                                    )(_paged_attn_kernel)
CPU_BLOCK_N = 32


def _one_tile(split: bool, max_context: int, num_splits: int, block_n: int) -> bool:
    """Whether the split kernel takes its ``ONE_TILE`` path: every range of the table fits a tile."""
    return split and -(-max_context // num_splits) <= block_n


def auto_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                    min_split_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Context splits so that about four programs per SM are in flight, each range at least ``min_split_tokens`` of
    ``max_context`` long (the ranges themselves are cut per sequence on the device)."""
    if not isinstance(min_split_tokens, int) or min_split_tokens < 1:
        raise ValueError(f"min_split_tokens={min_split_tokens!r} must be a positive int")
    programs = num_seqs * num_kv_heads
    want = -(-4 * num_sms(device) // programs)
    return max(1, min(want, max_context // min_split_tokens, 64))


def check_pools_fit_q(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise unless both pools are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with ``q``'s head_dim
    (its last dimension) and ``q``'s head count (its second to last) a multiple of ``num_kv_heads``."""
    num_heads, head_dim = q.shape[-2:]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[num_blocks, block_size, num_kv_heads, head_dim={head_dim}]")
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"q's num_heads={num_heads} must be a multiple of the cache's "
                         f"num_kv_heads={k_cache.shape[2]}")


def _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale) -> None:
    check_tensor("q", q, FLOAT_DTYPES, dim=3)
    quant = k_cache.dtype in QUANT_KV_DTYPES if isinstance(k_cache, torch.Tensor) else False
    check_tensor("k_cache", k_cache, QUANT_KV_DTYPES if quant else (q.dtype,), dim=4, device=q.device)
    check_tensor("v_cache", v_cache, (k_cache.dtype,), dim=4, device=q.device)
    if quant != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"k_scale and v_scale are needed exactly when the caches are int8/float8_e4m3fn; "
                         f"got caches of {k_cache.dtype} and k_scale={'given' if k_scale is not None else None}, "
                         f"v_scale={'given' if v_scale is not None else None}")
    if quant:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, t, (torch.float32,), dim=3, device=q.device)
            if t.shape != k_cache.shape[:3] or t.stride() != k_scale.stride():
                raise ValueError(f"{name} {tuple(t.shape)} must be float32 [num_blocks, block_size, "
                                 f"num_kv_heads] = {list(k_cache.shape[:3])}, laid out like k_scale")
    check_tensor("block_tables", block_tables, (torch.int32,), dim=2, device=q.device)
    check_tensor("context_lens", context_lens, (torch.int32,), dim=1, device=q.device)
    refuse_bf16_dot_on_cpu("q", q)
    check_pools_fit_q(q, k_cache, v_cache)
    num_seqs = q.shape[0]
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} need one row per sequence (num_seqs={num_seqs})")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)) or block_tables.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache and block_tables need a contiguous last dimension")


PDL_MODES = ("", "release")  # decode attention releases the launch after it; it is never a dependent launch itself


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float | None = None, num_splits: int | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    pdl: str = "", check: bool | None = None) -> torch.Tensor:
    """Decode attention over the paged layout above, in Triton (``paged_attention_ref`` is the reference).

    ``q`` ``[num_seqs, num_heads, head_dim]``; caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` of
    ``q``'s dtype (float16, bfloat16 on CUDA, float32); ``block_tables`` int32 ``[num_seqs, max_blocks]``;
    ``context_lens`` int32 ``[num_seqs]``, each in ``1 ... max_blocks * block_size``. ``check``: check the context
    lengths and the block ids they reach on the host (``common.check_block_tables``, one copy per call); default
    (``None``) on, except while a CUDA graph is captured; ``False`` where the caller checked the step already (the
    engine). The device never checks them, so the call stays capturable. ``num_splits``: context ranges per sequence,
    merged by a second kernel (flash-decoding); ``None`` picks from the SM count (``auto_num_splits``), ``1`` is the
    single-pass kernel. Quantised caches (``labkit.kvcache.quant``): int8 or float8_e4m3fn caches with float32
    ``k_scale``/``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` (``x = q * scale`` per token and head),
    dequantised in registers, so the kernel reads 1 byte per element instead of 2. ``pdl="release"`` (sm_90):
    the launch after this call may start as soon as this one does (a programmatic dependent launch, such as an
    int4 GEMV's ``pdl="overlap"``, then issues its first weight loads while attention runs); the merge kernel is
    then a programmatic dependent launch itself, waiting for the partials before it reads them. Returns ``[num_seqs,
    num_heads, head_dim]`` in ``q``'s dtype. (Variants measured and removed: research/README.md.)
    """
    _check_paged_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    if should_check(check, q):
        check_block_tables(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])
    check_pdl(pdl, PDL_MODES)
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, k_scale, v_scale, pdl)


def _launch(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, k_scale, v_scale, pdl,
            tile: dict | None = None) -> torch.Tensor:
    """``paged_attention`` on checked arguments; ``tile`` (CUDA: ``BLOCK_N``, ``num_warps``, ``num_stages`` of the
    split kernel) replaces the default (``short_range_tile``, else the autotuner's): research/attention_splits.py's
    sweep."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = auto_num_splits(num_seqs, num_kv_heads, max_context, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be a positive int or None (automatic)")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    split = num_splits > 1
    if split:
        f32 = dict(dtype=torch.float32, device=q.device)
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, **f32)
    else:
        part_acc = part_ml = out  # never written: SPLIT=False
    quant = k_scale is not None
    k_s, v_s = (k_scale, v_scale) if quant else (out, out)  # never read without KV_QUANT
    args = (q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, k_s, v_s, scale * LOG2E,
            group, num_heads, num_splits, q.stride(0), q.stride(1), *k_cache.stride()[:3],
            *v_cache.stride()[:3], *(k_scale.stride() if quant else (0, 0, 0)), block_tables.stride(0),
            out.stride(0), out.stride(1), next_pow2(max_context), max_context)
    meta = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
                BLOCK_G=max(16, next_pow2(group)), SPLIT=split, KV_QUANT=quant,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact
                PTX=q.device.type == "cuda" and torch.version.hip is None)  # the interpreter runs no PTX
    grid = (num_seqs, num_kv_heads, num_splits)
    launch = pdl_launch(pdl, q.device)
    if q.device.type == "cuda":
        config = tile or (short_range_tile(max_context, num_splits) if split else None)
    else:
        config = {"BLOCK_N": CPU_BLOCK_N}  # the interpreter's one tile
    # with no tile yet (the autotuner picks one per launch) the general loop, which any tile runs
    meta["ONE_TILE"] = config is not None and _one_tile(split, max_context, num_splits, config["BLOCK_N"])
    kernel = _paged_attn_tuned if config is None else _paged_attn_kernel
    kernel[grid](*args, **meta, **launch, **(config or {}))
    if split:  # the merge: a dependent launch of a split kernel that releases it
        _paged_attn_reduce[(num_seqs, num_heads)](part_acc, part_ml, out, num_heads, num_splits,
                                                 out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                                 BLOCK_D=next_pow2(head_dim),
                                                 BLOCK_SPLITS=next_pow2(num_splits),
                                                 **pdl_launch("overlap" if launch["PDL"] else "", q.device))
    return out
