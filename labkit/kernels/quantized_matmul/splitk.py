"""The split-K GEMVs: one row of ``x`` against int8 or int4 weights, ``SPLIT_K`` programs per block of rows.

Any shape and activation dtype (float32 included) takes these where the stationary GEMVs do not (``stationary.py``:
16-bit activations, whole tiles); a bare int8 product takes ``_w8_gemv`` always. Each program reads whole int32
words of weights (16-byte loads, no masks in the steady state where every step and row is whole, ``EVEN``) and
decodes them in registers (``ptx.py``); int4 accumulates ``sum_k q x`` per group and row, then adds ``s * (sum_k q
x - z * sum_k x)`` (the scale once per group). Partial sums go to a float32 workspace; the last split of a row block
to arrive (an atomic counter) adds them in split order (deterministic), writes the output and resets its counter:
one launch, no memset, CUDA-graph capturable. On CUDA the tile, split and load pipeline are autotuned per ``(N,
K)`` over ``tuning.SPLITK_CANDIDATES``, each candidate timed after a *clean* L2 flush (``cold_l2_bench``), once per
shape on the first call: warm up before capturing a CUDA graph (capture also refuses to grow the workspace).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import cold_l2_bench, next_pow2, num_sms
from labkit.kernels.quantized_matmul.ptx import (
    _MAGIC,
    _TWO23,
    _byte_pair,
    _nibble,
    _pow2_scales,
    _word_dot,
    _x_half2,
    _x_octets,
)
from labkit.kernels.quantized_matmul.tuning import SPLITK_CANDIDATES, SplitKTile

MAX_SPLIT_K = 16  # rows of the float32 partial-sum workspace
ANY_GROUP_TILE = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4)  # groups that are not a power of two: correct, untuned


@triton.jit
def _store_rows(part, offs_n, n_ok, out_ptr, ws_ptr, cnt_ptr, N, SPLIT_K: tl.constexpr):
    """Write this program's float32 sums for its rows; with ``SPLIT_K > 1`` the last split of the row block
    to finish adds every split's partials in split order and writes the output."""
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + tl.program_id(1) * N + offs_n, part, mask=n_ok)
        tl.debug_barrier()  # all of this CTA's partials are written before its arrival is counted
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # release ours, acquire the others'
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(part)
            for s in tl.static_range(SPLIT_K):  # fixed order: the same bits whichever split came last
                total += tl.load(ws_ptr + s * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def _w8_gemv(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_wn, lo_mask, hi_mask,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, LOAD_STAGES: tl.constexpr,
             WORDS_ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """``w_ptr``: the int8 weights as raw bytes, taken four at a time as int32 words (k = 4w + i at bits 8i).
    ``WORDS_ALIGNED`` (rows start on 4-byte boundaries, K % 4 == 0): one 32-bit load per word; otherwise each
    word is assembled from byte loads (correct, slower). ``lo_mask``/``hi_mask`` are 0xFF/0xFF00, passed at run
    time so that each byte's AND + XOR stays one LOP3 with a constant-bank operand."""
    WORDS: tl.constexpr = BLOCK_K // 4
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    offs_w = tl.arange(0, WORDS)
    n_words = tl.cdiv(K, 4)
    w_per = tl.cdiv(tl.cdiv(n_words, SPLIT_K), WORDS) * WORDS  # whole steps, so splits never overlap
    w_lo = tl.program_id(1) * w_per
    w_hi = tl.minimum(w_lo + w_per, n_words)
    k4 = (w_lo + offs_w)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [words, 4]: k of each byte, this step
    x_ptrs = x_ptr + k4
    if WORDS_ALIGNED:
        w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + n64[:, None] * (stride_wn // 4) + (w_lo + offs_w)[None, :]
    else:
        w_ptrs = w_ptr + n64[:, None, None] * stride_wn + k4[None, :, :]
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)  # reduced once at the end, not once per step
    for w0 in tl.range(w_lo, w_hi, WORDS, num_stages=LOAD_STAGES):
        # no `other` on whole words: any bits decode to finite values, met by x = 0 (k >= K) or rows never stored
        if EVEN:  # every step whole and every row real (the autotuner's heuristic): no masks
            wd = tl.load(w_ptrs)
            x4 = tl.load(x_ptrs)
        elif WORDS_ALIGNED:
            wd = tl.load(w_ptrs, mask=n_ok[:, None] & (w0 + offs_w < n_words)[None, :])
            x4 = tl.load(x_ptrs, mask=k4 < K, other=0.0)
        else:
            b = tl.load(w_ptrs, mask=n_ok[:, None, None] & (k4 < K)[None, :, :], other=0).to(tl.int32)
            wd = tl.sum(b << (tl.arange(0, 4) * 8)[None, None, :], 2)
            x4 = tl.load(x_ptrs, mask=k4 < K, other=0.0)
        x4 = x4.to(tl.float32)
        x_ptrs += BLOCK_K
        k4 += BLOCK_K
        if WORDS_ALIGNED:
            w_ptrs += WORDS
        else:
            w_ptrs += BLOCK_K
        ev, od = tl.split(tl.reshape(x4, [WORDS, 2, 2]))
        x0, x2 = tl.split(ev)
        x1, x3 = tl.split(od)
        b0, b1 = _byte_pair(wd, lo_mask, hi_mask)
        acc += b0 * x0[None, :]
        acc += b1 * x1[None, :]
        b2, b3 = _byte_pair(wd >> 16, lo_mask, hi_mask)
        acc += b2 * x2[None, :]
        acc += b3 * x3[None, :]
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    _store_rows(tl.sum(acc, 1) * s, offs_n, n_ok, out_ptr, ws_ptr, cnt_ptr, N, SPLIT_K)


@triton.jit
def _w4_program(N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's rows and groups in the int4 GEMVs: rows ``offs_n`` (``n_ok`` real, ``n64`` as int64), the
    step's groups ``g = g_lo + offs_g`` up to ``g_hi`` (split ``program_id(1)`` of ``SPLIT_K``, whole steps, so
    splits never overlap) and ``kw`` ``[groups, words]``, each word's index along a row."""
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    n_groups = K // GROUP
    g_per = tl.cdiv(tl.cdiv(n_groups, SPLIT_K), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g = g_lo + offs_g
    kw = g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    return offs_n, offs_n < N, offs_n.to(tl.int64), offs_g, g_lo, tl.minimum(g_lo + g_per, n_groups), g, kw


@triton.jit
def _w4_gemv(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_pn, stride_sn, stride_zn, exp_bits,
             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
             LOAD_STAGES: tl.constexpr, EVEN: tl.constexpr, HALF_MATH: tl.constexpr, PREFETCH: tl.constexpr):
    """Power-of-two groups >= 8. ``p_ptr``: the packed bytes viewed as int32 words (8 nibbles: k = 8w + i at
    bits 4i); a step is ``BLOCK_K // GROUP`` whole groups, a ``[BLOCK_N, groups, words]`` tile.
    ``exp_bits`` is 0x4F000000, passed at run time so that the compiler keeps one OR per word instead of
    folding it into every nibble's mask (which costs a register move per nibble). ``PREFETCH`` (with ``EVEN``)
    keeps the next step's loads in flight in registers while this step computes."""
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8  # int32 words per group and row
    offs_n, n_ok, n64, offs_g, g_lo, g_hi, g, kw = _w4_program(N, K, GROUP, BLOCK_N, BLOCK_K, SPLIT_K)
    p_ptrs = p_ptr + n64[:, None, None] * stride_pn + kw[None, :, :]
    x_ptrs = x_ptr + kw[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    n_groups = K // GROUP
    s_ptrs = s_ptr + n64[:, None] * stride_sn + g[None, :]
    z_ptrs = z_ptr + n64[:, None] * stride_zn + g[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    if EVEN and PREFETCH:
        nw, nx, ns, nz = tl.load(p_ptrs), tl.load(x_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)
    for g0 in tl.range(g_lo, g_hi, BLOCK_G, num_stages=LOAD_STAGES):
        if EVEN and PREFETCH:  # this step's loads were issued a step ago; issue the next step's now
            wd, x8, s, z = nw, nx, ns, nz
            more = g0 + BLOCK_G + offs_g < g_hi  # all or none: the last step prefetches nothing
            nw = tl.load(p_ptrs + BLOCK_G * WORDS, mask=more[None, :, None])
            nx = tl.load(x_ptrs + BLOCK_K, mask=more[:, None, None])
            ns = tl.load(s_ptrs + BLOCK_G, mask=more[None, :])
            nz = tl.load(z_ptrs + BLOCK_G, mask=more[None, :])
        elif EVEN:  # whole steps, real rows (the autotuner's heuristic): no masks
            wd = tl.load(p_ptrs)
            x8 = tl.load(x_ptrs)
            s = tl.load(s_ptrs)
            z = tl.load(z_ptrs)
        else:
            g_ok = g0 + offs_g < n_groups
            # no `other`: masked-off words decode to finite values that meet x = 0 or rows never stored
            wd = tl.load(p_ptrs, mask=n_ok[:, None, None] & g_ok[None, :, None])
            x8 = tl.load(x_ptrs, mask=g_ok[:, None, None], other=0.0)
            ld = n_ok[:, None] & g_ok[None, :]
            s = tl.load(s_ptrs, mask=ld, other=0.0)
            z = tl.load(z_ptrs, mask=ld, other=0.0)
        x8 = x8.to(tl.float32)
        p_ptrs += BLOCK_G * WORDS
        x_ptrs += BLOCK_K
        s_ptrs += BLOCK_G
        z_ptrs += BLOCK_G
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_octets(x8, BLOCK_G, WORDS)
        x_sum = tl.sum((x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7), 1)  # [groups], for the zero-points
        if HALF_MATH:  # 16-bit activations: packed float16 pairs (1: PTX on CUDA, 2: emulated on the CPU)
            up, down = _pow2_scales(x8)
            xa, xb, xc, xd = _x_half2(x0, x1, x2, x3, x4, x5, x6, x7, up[:, None], HALF_MATH == 1)
            q_x = tl.sum(_word_dot(wd, xa[None], xb[None], xc[None], xd[None], HALF_MATH == 1), 2) * down[None, :]
        else:
            lo = wd | exp_bits
            hi = (wd >> 16) | exp_bits
            qx = _nibble(lo, 0) * x0[None]  # sum_i q_i x_i, one FFMA per weight
            qx += _nibble(lo, 1) * x1[None]
            qx += _nibble(lo, 2) * x2[None]
            qx += _nibble(lo, 3) * x3[None]
            qx += _nibble(hi, 0) * x4[None]
            qx += _nibble(hi, 1) * x5[None]
            qx += _nibble(hi, 2) * x6[None]
            qx += _nibble(hi, 3) * x7[None]
            q_x = tl.sum(qx, 2)
        # sum_k (q - z) s x: the scale once per group
        acc += s.to(tl.float32) * (q_x - z.to(tl.float32) * x_sum[None, :])
    _store_rows(tl.sum(acc, 1), offs_n, n_ok, out_ptr, ws_ptr, cnt_ptr, N, SPLIT_K)


@triton.jit
def _w4_gemv_any_group(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_zn,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Any even group size (per-weight scale loads): correct, not tuned; power-of-two groups use ``_w4_gemv``."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    offs_j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + offs_j
        j_ok = j < K // 2
        ld = n_ok[:, None] & j_ok[None, :]
        pk = tl.load(p_ptr + n64[:, None] * stride_pn + j[None, :], mask=ld, other=0).to(tl.int32)
        x_even = tl.load(x_ptr + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
        g = (2 * j) // GROUP  # any even group size: both nibbles of a byte share a group
        s = tl.load(s_ptr + n64[:, None] * stride_sn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n64[:, None] * stride_zn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        lo = ((pk & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23
        hi = (((pk >> 4) & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23
        qx = lo * x_even[None, :] + hi * x_odd[None, :]
        acc += tl.sum(s * (qx - z * (x_even + x_odd)[None, :]), 1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# --- autotuning (CUDA) ----------------------------------------------------------------------------------------
def _gemv_configs(tiles, prefetch: bool = False) -> list:
    """Every tile x split x load pipeline (with ``prefetch``, also plain loads prefetched a step ahead)."""
    c = SPLITK_CANDIDATES
    pipelines = [{"LOAD_STAGES": st} | ({"PREFETCH": False} if prefetch else {}) for st in c.load_stages]
    pipelines += [{"LOAD_STAGES": 1, "PREFETCH": True}] if prefetch else []
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, **p}, num_warps=w, num_stages=1)
            for n, k, w in tiles for s in c.splits for p in pipelines]


def prune_splitk(configs: list, n: int, k: int, group: int | None, sms: int) -> list:
    """The candidates worth timing for ``[N, K]`` on ``sms`` SMs: splits that keep the grid under
    ``max_ctas_per_sm`` programs per SM and give each split >= 2 steps; per tile no split plus the two largest that
    qualify. int4 tiles hold whole groups: a group longer than a tile's step widens the step to one group and
    narrows the tile to keep its bytes."""
    by_tile: dict = {}
    for c in configs:
        bn, bk, s = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if group and bk < group:
            bn, bk = max(8, bn * bk // group), group
            c = triton.Config(dict(c.kwargs, BLOCK_N=bn, BLOCK_K=bk), num_warps=c.num_warps,
                              num_stages=c.num_stages, maxnreg=c.maxnreg)
        if s > 1 and (triton.cdiv(n, bn) * s > SPLITK_CANDIDATES.max_ctas_per_sm * sms or triton.cdiv(k, s) < 2 * bk):
            continue
        variant = (s, c.kwargs["LOAD_STAGES"], c.kwargs.get("PREFETCH"), c.maxnreg)
        by_tile.setdefault((bn, bk, c.num_warps), {})[variant] = c
    kept = []
    for cs in by_tile.values():
        splits = sorted({s for s, *_ in cs})
        chosen = {1, *splits[-2:]}
        kept += [c for (s, *_), c in cs.items() if s in chosen]
    return kept or configs[:1]


def _prune_gemv(configs, named_args, **kwargs):
    """The autotuner's hook for ``prune_splitk``."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    return prune_splitk(configs, named_args["N"], named_args["K"], group, num_sms(named_args["x_ptr"].device))


def _even(args: dict) -> bool:
    """Every program of the GEMV has whole steps and real rows (N a multiple of BLOCK_N, K of BLOCK_K x SPLIT_K,
    whole aligned words), so it runs without masks: at LLM shapes, always."""
    return (args["N"] % args["BLOCK_N"] == 0 and args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0
            and args.get("WORDS_ALIGNED", True))


_w8_gemv_tuned = triton.autotune(_gemv_configs(SPLITK_CANDIDATES.w8_tiles), key=["N", "K"], do_bench=cold_l2_bench,
                                 prune_configs_by={"early_config_prune": _prune_gemv})(
    triton.heuristics({"EVEN": _even})(_w8_gemv))
_w4_gemv_tuned = triton.autotune(_gemv_configs(SPLITK_CANDIDATES.w4_tiles, prefetch=True), key=["N", "K", "GROUP"],
                                 do_bench=cold_l2_bench, prune_configs_by={"early_config_prune": _prune_gemv})(
    triton.heuristics({"EVEN": _even})(_w4_gemv))


# --- workspace and launch -----------------------------------------------------------------------------------
_SPLIT_BUFFERS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED_BUFFERS: list = []  # outgrown workspaces stay allocated: a captured CUDA graph may still point at them


def _split_buffers(device: torch.device, n: int, splits: int = MAX_SPLIT_K) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace of ``device``: float32 partials (at least ``[splits * n]``) and int32 arrival counters
    ``[n']``, ``n' >= n`` (zero between launches: each launch's last split resets its own).

    One per device, shared by every GEMV launched on it (the stationary GEMVs' too), so GEMVs must not run
    concurrently on two streams of one device. Made (or grown) on the first call that needs more: make that call
    before CUDA-graph capture (the warm-up that autotunes); an outgrown workspace is kept, since graphs captured
    earlier still use it.
    """
    key = str(device)
    bufs = _SPLIT_BUFFERS.get(key)
    if bufs is None or bufs[1].numel() < n or bufs[0].numel() < splits * n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the GEMV split-K workspace for N={n} x {splits} splits does not exist yet and "
                               "cannot be allocated during CUDA-graph capture; call the layer once before "
                               "capturing (warm-up)")
        size = next_pow2(max(n, bufs[1].numel() if bufs else 0))
        floats = max(MAX_SPLIT_K * size, next_pow2(splits * n), bufs[0].numel() if bufs else 0)
        if bufs is not None:
            _RETIRED_BUFFERS.append(bufs)
        bufs = (torch.empty(floats, dtype=torch.float32, device=device),
                torch.zeros(size, dtype=torch.int32, device=device))
        _SPLIT_BUFFERS[key] = bufs
    return bufs


def splitk_gemv(x2: torch.Tensor, n: int, bits: int, args: tuple, w_strides: tuple, meta: dict,
                tile: SplitKTile | None) -> torch.Tensor:
    """One row ``x2`` ``[1, K]`` through ``_w8_gemv`` (``bits=8``) or ``_w4_gemv``: ``args`` the weight tensors,
    ``w_strides`` the strides and constants after ``N, K``, ``meta`` the constexprs beside the tile; ``tile`` a fixed
    launch, or None for the autotuner (CUDA). Returns ``[1, N]``."""
    kernel, tuned = (_w8_gemv, _w8_gemv_tuned) if bits == 8 else (_w4_gemv, _w4_gemv_tuned)
    k = x2.shape[1]
    out = torch.empty(1, n, dtype=x2.dtype, device=x2.device)
    ws, cnt = _split_buffers(x2.device, n)
    ptrs = (x2, *args, out, ws, cnt, n, k, *w_strides)
    if tile is None:
        if x2.device.type != "cuda":
            raise ValueError("the split-K GEMV's autotuner needs CUDA; pass a SplitKTile in the tuning on the CPU")
        tuned[lambda c: (triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])](*ptrs, **meta)
        return out
    if not 1 <= tile.split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k={tile.split_k} must be in 1..{MAX_SPLIT_K}")
    fixed = dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT_K=tile.split_k, LOAD_STAGES=tile.load_stages)
    if bits == 4:
        fixed.update(BLOCK_K=max(tile.block_k, meta["GROUP"]), PREFETCH=tile.prefetch)
    fixed["EVEN"] = _even(dict(meta, **fixed, N=n, K=k))
    kernel[(triton.cdiv(n, tile.block_n), tile.split_k)](*ptrs, **meta, **fixed, num_warps=tile.num_warps,
                                                         num_stages=1)
    return out


def any_group_gemv(x2: torch.Tensor, p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int) -> torch.Tensor:
    """One row ``x2`` ``[1, K]`` against int4 weights of any even group size (``_w4_gemv_any_group``)."""
    n, k = p.shape[0], x2.shape[1]
    out = torch.empty(1, n, dtype=x2.dtype, device=x2.device)
    _w4_gemv_any_group[(triton.cdiv(n, ANY_GROUP_TILE["BLOCK_N"]),)](
        x2, p, s, z, out, n, k, p.stride(0), s.stride(0), z.stride(0), GROUP=group, **ANY_GROUP_TILE)
    return out
