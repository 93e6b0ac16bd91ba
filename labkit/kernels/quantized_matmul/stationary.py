"""The stationary-activation GEMVs: one 16-bit row of ``x``, whole tiles, int4 (``_w4_gemv_xs``) or int8
(``_w8_gemv_xs``) weights -- the decode step's GEMVs.

The split-K GEMV (``splitk.py``) prepares the activations at every step of every row block. These kernels turn the
loop around: program ``(k, n)`` owns slice ``k`` of ``BLOCK_K`` activations, prepares it once, and walks down
``ROW_STEPS`` blocks of ``BLOCK_N`` rows with nothing but weight (and scale) loads and the packed float16 dot, the
next block's loads in flight while this one's math runs, the first block's issued before the slice's preparation.
With one slice (``SPLIT_P2 == 1``: the program owns all of K) it stores its rows; otherwise partials go to the
float32 workspace ``[slices, N]`` and the last slice of a row chunk to arrive (an atomic counter) sums all slices in
slice order (``SPLIT_P2 >= slices``, ``RED_ROWS`` rows at a time), writes the rows and resets its counter. What each
choice was measured against: research/README.md (``gemv_study.py``, ``sass_report.py``) and their records.

They take a decoder layer's neighbours in (``fused.py``): ``SWIGLU`` (``x`` is ``[gate | up]``), ``NORM_CHUNKS``
(the RMSNorm in the prologue), ``RESIDUAL`` (the residual add in the store), ``ROPE_HALF`` (a merged q/k/v
projection: RoPE and the paged-cache write in the store), and ``PDL``: the next launch released at the start and,
where this one is launched as a programmatic dependent launch (``pdl="overlap"``, sm_90), the first weight loads
issued before waiting for the kernel ahead (the engine's quantised GEMV chain; measured in
results/h200/records/04_quantization.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import check_pdl, pdl_launch
from labkit.kernels.quantized_matmul.fused import (
    _normed_activations,
    _output_rows,
    _rope_cache_rows,
    _rope_rows,
    _rope_step,
    _slice_activations,
)
from labkit.kernels.quantized_matmul.ptx import (
    _even_odd_words,
    _pow2_of,
    _pow2_scales,
    _w4_pair_dot,
    _w8_pair_dot,
    _word_dot,
    _x_byte_pairs,
    _x_half2,
    _x_octets,
)
from labkit.kernels.quantized_matmul.splitk import _split_buffers
from labkit.kernels.quantized_matmul.tuning import StationaryPlan


@triton.jit
def _xs_block_done(part, rows, lrows, ws_ptr, res_ptr, out_ptr, N, SPLIT_P2: tl.constexpr, RESIDUAL: tl.constexpr):
    """A stationary program's float32 sums for one row block: the output rows ``rows`` where the program owns
    the whole of K (``SPLIT_P2 == 1``), else its slice's partials at the logical rows ``lrows`` of the workspace."""
    if SPLIT_P2 == 1:
        _output_rows(part, rows, res_ptr, out_ptr, RESIDUAL)
    else:
        tl.store(ws_ptr + tl.program_id(0) * N + lrows, part)


@triton.jit
def _xs_reduce(ws_ptr, cnt_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
               n_k_rows, n_slots, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT_P2: tl.constexpr,
               RED_ROWS: tl.constexpr, RESIDUAL: tl.constexpr, ROPE_HALF: tl.constexpr):
    """Where K is split (``SPLIT_P2 > 1``): count this program's arrival at its row chunk (``program_id(1)``,
    ``ROWS`` rows); the last slice to arrive sums every slice's partials in slice order, ``RED_ROWS`` rows at a
    time, stores them (``_output_rows``, or ``_rope_cache_rows`` with ``ROPE_HALF``) and resets the chunk's
    counter (its cost: research/records/h200/gemv_study_xs_pdl_0a9fcfd.json)."""
    if SPLIT_P2 == 1:
        return
    pid_n = tl.program_id(1)
    tl.debug_barrier()  # all of this program's partials are written before its arrival is counted
    if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        sl = tl.arange(0, SPLIT_P2)
        for r0 in range(0, ROWS, RED_ROWS):  # slices summed in a fixed order: the same bits whoever came last
            rows = pid_n * ROWS + r0 + tl.arange(0, RED_ROWS)
            parts = tl.load(ws_ptr + sl[:, None] * N + rows[None, :], mask=(sl < tl.num_programs(0))[:, None],
                            other=0.0, cache_modifier=".cg")
            _xs_chunk_rows(tl.sum(parts, 0), rows, pid_n * ROWS + r0, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                           kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots, BLOCK_N, RED_ROWS, RESIDUAL, ROPE_HALF)
        tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def _xs_chunk_rows(total, rows, r0, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
                   n_k_rows, n_slots, BLOCK_N: tl.constexpr, RED_ROWS: tl.constexpr, RESIDUAL: tl.constexpr,
                   ROPE_HALF: tl.constexpr):
    """Store ``RED_ROWS`` summed rows from logical row ``r0``: ``_output_rows``, or ``_rope_cache_rows``."""
    if ROPE_HALF > 0:
        _rope_cache_rows(total, r0 // BLOCK_N, out_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
                         n_k_rows, n_slots, RED_ROWS, BLOCK_N, ROPE_HALF)
    else:
        _output_rows(total, rows, res_ptr, out_ptr, RESIDUAL)


@triton.jit
def _w4_gemv_xs(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, norm_w_ptr, res_ptr, eps, N, K, stride_pk,
                stride_pn, stride_sk, stride_sn, stride_zk, stride_zn, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
                n_rot_rows, n_k_rows, n_slots, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROW_STEPS: tl.constexpr, SPLIT_P2: tl.constexpr, RED_ROWS: tl.constexpr,
                HALF_MATH: tl.constexpr, PDL: tl.constexpr, SWIGLU: tl.constexpr, NORM_CHUNKS: tl.constexpr,
                RESIDUAL: tl.constexpr, ROPE_HALF: tl.constexpr, PAIR_WORDS: tl.constexpr):
    """int4 weights as int32 words (``p_ptr``), scales and zeros per group, power-of-two groups that divide
    ``BLOCK_K``; ``N`` a multiple of ``BLOCK_N * ROW_STEPS``, ``K`` of ``BLOCK_K``. ``HALF_MATH``: 1 PTX (CUDA), 2
    the interpreter's emulation. ``PAIR_WORDS`` (groups of 16 weights or more): two words' products share float16
    lanes (``_w4_pair_dot``), one float32 conversion and add per 16 weights. ``ROPE_HALF > 0`` (split programs; a
    merged q/k/v projection of heads of ``2 * ROPE_HALF`` rows): each block of ``BLOCK_N`` rows holds half a block of
    a head's first half and the same dims of its second half (``_rope_rows``), so the last program rotates the
    first ``n_rot_rows`` rows (q and k) by ``cos_ptr``/``sin_ptr`` as it stores them and writes the k and v rows
    (``n_k_rows`` each) to the paged caches at ``slot_ptr``'s slot (skipped outside ``[0, n_slots)``)."""
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8
    ROWS: tl.constexpr = BLOCK_N * ROW_STEPS
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    gl = tl.arange(0, BLOCK_G)  # the slice's groups
    wl = gl[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # and its words
    kw = pid_k * (BLOCK_G * WORDS) + wl
    lrows = (pid_n * ROWS + tl.arange(0, BLOCK_N)).to(tl.int64)  # the logical rows of this program's first block
    n64 = _rope_rows(pid_n * ROW_STEPS, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else lrows  # and the weights' rows
    # the weights as 2-D rows of the slice's contiguous words, viewed as [rows, groups, words] only for the math
    # (a 3-D load takes more registers: research/records/cpu/sass_xs.json)
    p_ptrs = p_ptr + pid_k.to(tl.int64) * stride_pk + n64[:, None] * stride_pn + tl.arange(0, BLOCK_G * WORDS)[None, :]
    s_ptrs = s_ptr + pid_k.to(tl.int64) * stride_sk + n64[:, None] * stride_sn + gl[None, :]
    z_ptrs = z_ptr + pid_k.to(tl.int64) * stride_zk + n64[:, None] * stride_zn + gl[None, :]
    if PDL:  # the next launch may start now: its first weight loads overlap this kernel's tail
        tl.extra.cuda.gdc_launch_dependents()
    nw, ns, nz = tl.load(p_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)  # in flight while the slice is prepared
    if PDL:  # launched before the kernel ahead finished: nothing it writes may be read or written before this
        tl.extra.cuda.gdc_wait()
    k8 = kw[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    if NORM_CHUNKS > 0:
        x8 = _normed_activations(x_ptr, norm_w_ptr, k8, K, eps, BLOCK_K, NORM_CHUNKS)
    else:
        x8 = _slice_activations(x_ptr, k8, K, SWIGLU)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_octets(x8, BLOCK_G, WORDS)
    x_sum = tl.sum((x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7), 1)
    up, down = _pow2_scales(x8)
    xa, xb, xc, xd = _x_half2(x0, x1, x2, x3, x4, x5, x6, x7, up[:, None], HALF_MATH == 1)
    if PAIR_WORDS:  # words 2j and 2j + 1 of a group share float16 lanes
        xa, ya = _even_odd_words(xa, BLOCK_G, WORDS)
        xb, yb = _even_odd_words(xb, BLOCK_G, WORDS)
        xc, yc = _even_odd_words(xc, BLOCK_G, WORDS)
        xd, yd = _even_odd_words(xd, BLOCK_G, WORDS)
    for i in tl.range(0, ROW_STEPS, num_stages=1):  # loads a block ahead in registers, not Triton's pipeliner
        step = _rope_step(pid_n * ROW_STEPS + i, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else BLOCK_N  # rows to next
        wd, s, z = nw, ns, nz  # this block's loads were issued a block ago; issue the next block's now
        more = i + 1 < ROW_STEPS
        nw = tl.load(p_ptrs + step * stride_pn, mask=more)
        ns = tl.load(s_ptrs + step * stride_sn, mask=more)
        nz = tl.load(z_ptrs + step * stride_zn, mask=more)
        p_ptrs += step * stride_pn
        s_ptrs += step * stride_sn
        z_ptrs += step * stride_zn
        if PAIR_WORDS:
            we, wo = tl.split(tl.reshape(wd, [BLOCK_N, BLOCK_G, WORDS // 2, 2]))
            dots = _w4_pair_dot(we, wo, xa[None], xb[None], xc[None], xd[None], ya[None], yb[None], yc[None],
                                yd[None], HALF_MATH == 1)
        else:
            dots = _word_dot(tl.reshape(wd, [BLOCK_N, BLOCK_G, WORDS]), xa[None], xb[None], xc[None], xd[None],
                             HALF_MATH == 1)
        q_x = tl.sum(dots, 2) * down[None, :]
        part = tl.sum(s.to(tl.float32) * (q_x - z.to(tl.float32) * x_sum[None, :]), 1)
        _xs_block_done(part, n64 + i * BLOCK_N, lrows + i * BLOCK_N, ws_ptr, res_ptr, out_ptr, N, SPLIT_P2,
                       RESIDUAL)
    _xs_reduce(ws_ptr, cnt_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
               n_k_rows, n_slots, BLOCK_N, ROWS, SPLIT_P2, RED_ROWS, RESIDUAL, ROPE_HALF)


@triton.jit
def _w8_gemv_xs(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, norm_w_ptr, res_ptr, eps, N, K, stride_wk, stride_wn,
                cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROW_STEPS: tl.constexpr, SPLIT_P2: tl.constexpr, RED_ROWS: tl.constexpr,
                HALF_MATH: tl.constexpr, PDL: tl.constexpr, SWIGLU: tl.constexpr, NORM_CHUNKS: tl.constexpr,
                RESIDUAL: tl.constexpr, ROPE_HALF: tl.constexpr):
    """``_w4_gemv_xs`` for int8 weights with a per-row scale: the same grid, slices, prefetch, programmatic
    dependent launch, cross-slice reduction and neighbours, so an int8 decode step loses the same kernels an int4 one
    does. ``w_ptr``: the weights as int32 words (bytes ``4w .. 4w + 3`` of a row, k = 4w + i at bits 8i); ``s_ptr``
    ``[N]``; strides in words, ``stride_wk`` from one slice to the next. Packed float16 pairs (``_w8_pair_dot``: word
    p of the slice's first half with word p of its second; ``HALF_MATH`` 1 PTX, 2 emulated), the slice's activations
    scaled by one power of two into [32, 64) (its sm_90 loop: research/records/cpu/sass_w8xs.json). Each slice's
    partial sum is scaled by its row's scale before the slices are summed."""
    WORDS: tl.constexpr = BLOCK_K // 4
    ROWS: tl.constexpr = BLOCK_N * ROW_STEPS
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    HALF_WORDS: tl.constexpr = WORDS // 2
    wl = tl.arange(0, WORDS)
    lrows = (pid_n * ROWS + tl.arange(0, BLOCK_N)).to(tl.int64)
    n64 = _rope_rows(pid_n * ROW_STEPS, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else lrows
    # the slice's words in two halves, word p of the first meeting word p of the second in one packed dot
    w_ptrs = w_ptr + pid_k.to(tl.int64) * stride_wk + n64[:, None] * stride_wn + tl.arange(0, HALF_WORDS)[None, :]
    s_ptrs = s_ptr + n64
    if PDL:  # the next launch may start now: its first weight loads overlap this kernel's tail
        tl.extra.cuda.gdc_launch_dependents()
    na, nb, ns = tl.load(w_ptrs), tl.load(w_ptrs + HALF_WORDS), tl.load(s_ptrs)  # in flight during the preparation
    if PDL:  # nothing the kernel ahead writes may be read or written before this
        tl.extra.cuda.gdc_wait()
    # [words, 2, 2]: k = 4w + 2a + b, so splitting b then a gives bytes 0 and 2, then 1 and 3 of each word
    k4 = (pid_k * WORDS + wl)[:, None, None] * 4 + (tl.arange(0, 2)[:, None] * 2 + tl.arange(0, 2)[None, :])[None]
    if NORM_CHUNKS > 0:
        x4 = _normed_activations(x_ptr, norm_w_ptr, k4, K, eps, BLOCK_K, NORM_CHUNKS)
    else:
        x4 = _slice_activations(x_ptr, k4, K, SWIGLU)
    xa, xb = tl.split(tl.permute(tl.reshape(x4, [2, HALF_WORDS, 2, 2]), (1, 2, 3, 0)))  # the two halves
    # one power of two puts the slice's largest |x| in [32, 64): no float16 lane overflows
    up, down = _pow2_of(tl.max(tl.max(tl.max(tl.abs(x4), 2), 1), 0), 5)
    a02, a13 = _x_byte_pairs(xa, up, HALF_MATH == 1)
    b02, b13 = _x_byte_pairs(xb, up, HALF_MATH == 1)
    for i in range(ROW_STEPS):
        step = _rope_step(pid_n * ROW_STEPS + i, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else BLOCK_N  # rows to next
        wa, wb, s = na, nb, ns  # this block's loads were issued a block ago; issue the next block's now
        more = i + 1 < ROW_STEPS
        na = tl.load(w_ptrs + step * stride_wn, mask=more)
        nb = tl.load(w_ptrs + step * stride_wn + HALF_WORDS, mask=more)
        ns = tl.load(s_ptrs + step, mask=more)
        w_ptrs += step * stride_wn
        s_ptrs += step
        qx = _w8_pair_dot(wa, wb, a02[None, :], a13[None, :], b02[None, :], b13[None, :], HALF_MATH == 1)
        part = tl.sum(qx, 1) * (down * s.to(tl.float32))
        _xs_block_done(part, n64 + i * BLOCK_N, lrows + i * BLOCK_N, ws_ptr, res_ptr, out_ptr, N, SPLIT_P2,
                       RESIDUAL)
    _xs_reduce(ws_ptr, cnt_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
               n_k_rows, n_slots, BLOCK_N, ROWS, SPLIT_P2, RED_ROWS, RESIDUAL, ROPE_HALF)


def w4_gemv_xs(x2: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int,
               plan: StationaryPlan, swiglu: bool = False, norm: tuple[torch.Tensor, float] | None = None,
               residual: torch.Tensor | None = None, rope: dict | None = None, pdl: str = "") -> torch.Tensor:
    """Launch ``_w4_gemv_xs`` on one row ``x2`` ``[1, K]`` (float16/bfloat16) and int4 weights as int32 words
    ``[N, K // 8]`` with scales and zeros ``[N, K // group]``; ``plan`` from ``tuning.stationary_plan``.
    ``swiglu``: ``x2`` is ``[1, 2K]``, ``[gate | up]``, and the GEMV multiplies ``silu(gate) * up``. ``norm``:
    ``(weight [K], eps)``, the GEMV multiplies ``rms_norm(x2)``. ``residual`` ``[1, N]`` (contiguous, ``x2``'s
    dtype): added to the output. ``rope`` (a merged q/k/v projection on a split plan whose row blocks fit its
    heads: see ``w4a16_qkv_rope_cache``): ``cos``, ``sin`` (the token's rows, at least ``head_dim / 2`` values),
    ``slot`` (int ``[1]``), ``k_cache``, ``v_cache`` and ``num_heads``. ``pdl`` (``common.PDL_MODES``): ``"release"``
    lets the next launch start at once, ``"overlap"`` also makes this launch a programmatic dependent one (sm_90;
    plain elsewhere). Returns ``[1, N]``."""
    if plan.pair_words and group < 16:
        raise ValueError(f"pair_words needs groups of two int32 words or more (group_size >= 16), got {group}")
    bk = plan.block_k
    # (slice, row) strides: the kernel also reads weights stored slice after slice (gemv_study_xs_sm_492b4c7)
    strides = (bk // 8, words.stride(0), bk // group, s.stride(0), bk // group, z.stride(0))
    return _xs_launch(_w4_gemv_xs, 4, x2, words.shape[0], (words, s, z), strides, plan, swiglu, norm, residual,
                      rope, pdl, GROUP=group)


def w8_gemv_xs(x2: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, plan: StationaryPlan,
               swiglu: bool = False, norm: tuple[torch.Tensor, float] | None = None,
               residual: torch.Tensor | None = None, rope: dict | None = None, pdl: str = "") -> torch.Tensor:
    """``w4_gemv_xs`` for int8 weights: launch ``_w8_gemv_xs`` on one row ``x2`` and the weights as int32 words
    ``[N, K // 4]`` with ``scale`` ``[N]``; ``plan`` from ``tuning.stationary_plan`` (unit 4); the other arguments as
    ``w4_gemv_xs`` takes them. Returns ``[1, N]``."""
    strides = (plan.block_k // 4, words.stride(0))
    return _xs_launch(_w8_gemv_xs, 8, x2, words.shape[0], (words, scale), strides, plan, swiglu, norm, residual,
                      rope, pdl)


def _xs_launch(kernel, bits: int, x2: torch.Tensor, n: int, weights: tuple, strides: tuple, plan: StationaryPlan,
               swiglu: bool, norm: tuple[torch.Tensor, float] | None, residual: torch.Tensor | None,
               rope: dict | None, pdl: str, **consts) -> torch.Tensor:
    """Launch a stationary GEMV (``weights`` and their ``strides`` are what each kernel reads) with the neighbours
    it takes in: one program per (slice, row chunk)."""
    check_pdl(pdl)
    k = x2.shape[1] // (2 if swiglu else 1)
    out = torch.empty(1, n, dtype=x2.dtype, device=x2.device)
    slices, rows = k // plan.block_k, plan.block_n * plan.row_steps
    ws, cnt = _split_buffers(x2.device, n, slices)
    nw, eps = norm if norm is not None else (x2, 0.0)
    half, rope_args = 0, (x2,) * 5 + (0, 0, 0)
    if rope is not None:
        kc = rope["k_cache"]
        head_dim, k_rows = kc.shape[-1], kc.shape[-2] * kc.shape[-1]
        half = head_dim // 2
        rope_args = (rope["cos"], rope["sin"], rope["slot"], kc, rope["v_cache"],
                     rope["num_heads"] * head_dim + k_rows, k_rows, kc.shape[0] * kc.shape[1])
    kernel[(slices, n // rows)](x2, *weights, out, ws, cnt, nw, x2 if residual is None else residual, eps, n, k,
                                *strides, *rope_args, **plan.meta(bits), **pdl_launch(pdl, x2.device), **consts,
                                HALF_MATH=1 if x2.device.type == "cuda" else 2, num_warps=plan.num_warps,
                                num_stages=1, SWIGLU=swiglu, NORM_CHUNKS=slices if norm is not None else 0,
                                RESIDUAL=residual is not None, ROPE_HALF=half)
    return out
