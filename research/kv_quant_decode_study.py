"""Why does paged decode attention over an int8 KV cache run only 1.13x the bf16 cache, not the 1.7x its bytes allow?

Issue 42 item 2. At batch 16, context 4096, 32 query / 8 KV heads of 128, 16-token blocks, an H100 took 96.7 us
with the bf16 cache (2.78 TB/s) and 85.5 us with the int8 one (1.62 TB/s of its bytes); taking the int8 ->
float16 conversion off I2F (PRMT/LOP3/HSUB2) moved 1.11x to 1.13x, so conversion ALU does not bind. One GPU run
times a ladder of variants, each a copy of the product kernel here (product code is only called, never changed),
each checked against ``paged_attention_ref`` on the dequantised cache before it is timed (probes excepted):

* ``v0``  the product: bf16 cache, int8 cache, fp8 (float8_e4m3fn) cache, autotuned; and this script's copy of the
  int8 kernel with the autotuner's tile (the copy must time as the product does for the ladder to mean anything);
* ``v1``  PROBE: the copy with no scale loads (scale 1: wrong values, timing only) -- the most (a) can give;
* ``v2``  (a) the scales of tile i+1 loaded during tile i (and their block-table entries), carried in the loop;
* ``v3``  (a) the scales loaded before K, every load of a tile (scales, K, V) issued before any math;
  ``v3hm`` the same over head-major scale pools (``[blocks, kv_heads, block_size]``: a 16-token block's scales of
  one head are 64 contiguous bytes instead of 16 words 32 bytes apart), a layout probe;
* ``v4``  (b)/(c) the product int8 kernel with a forced tile: BLOCK_N 64/128/256, warps, stages up to 6, and a
  128-register cap (occupancy: compiled for sm_90 on a CPU under Triton 3.9, int8 at 64/4w/3s took 185 registers
  against bf16's 122, and every K/V/block-table/scale load was already an async copy a stage ahead);
* ``v5``  (b) the product int8 (and bf16) kernel with 2x and 4x ``auto_num_splits``' context ranges;
* ``v6``  the best scale order of v0-copy/v2/v3/v3hm with the best v4 tiles and v5 split factors; also fp8 with it.

Contexts 1024 and 16384 check the products, the probe and v6's pick. Timing: CUDA-graph replays
(``labkit.kernels.common.graph_bench``, median), each call over enough copies of the cache (``pools``) to read at
least 2.5x the L2 size, so K and V come from DRAM.

    LABKIT_GIT_COMMIT=<sha> PYTHONPATH=. python research/kv_quant_decode_study.py --out $OUT/kvq.json
    python research/kv_quant_decode_study.py --device cpu      # the checks, tiny, on the interpreter (no timings)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

# isort: off
import labkit  # noqa: F401  (first: on a CPU-only host it sets TRITON_INTERPRET before triton is imported)
# isort: on
import torch
import triton
import triton.language as tl

import labkit.kernels.paged_attention as pa
from labkit.kernels.paged_attention import LOG2E, _block_slots, _kv_tile
from labkit.kernels.quantized_matmul.ptx import kv_as_16bit

SHAPE = dict(seqs=16, heads=32, kv_heads=8, head_dim=128, block_size=16)
MAIN_CONTEXT = 4096
CHECK_CONTEXTS = (1024, 16384)
TOL = 2e-2  # relative error against the float32 reference on the dequantised cache (the product test's 1e-2 x2)
SCALES = {"product": 0, "none": 1, "prefetch": 2, "first": 3}  # the copy's scale-load orders (SCALE_MODE)
# more stages at 64 tokens: an int8 tile is half a bf16 one's bytes, so the same stages keep half the bytes in flight
V4_TILES = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
            for n, w, s in ((64, 4, 4), (64, 4, 5), (64, 4, 6), (128, 4, 3), (128, 8, 3), (256, 8, 3))]
# a register cap: compiled for sm_90 on a CPU (Triton 3.9), the int8 kernel at 64/4w/3s took 185 registers against
# bf16's 122 (2 programs an SM against 4 by registers); capped at 128, 4 fit (spills, if any, are in the record)
V4_TILES += [dict(BLOCK_N=64, num_warps=4, num_stages=s, maxnreg=128) for s in (3, 4)]
SPLIT_FACTORS = (2, 4)


# --- the copy of the product kernel, with the scale-load order as a constexpr ----------------------------------
@triton.jit
def _study_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, part_acc_ptr, part_ml_ptr,
                  k_scale_ptr, v_scale_ptr, qk_scale, group, n_heads, n_splits,
                  stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_sb, stride_st, stride_sh, stride_bt,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, SCALE_MODE: tl.constexpr, PRECISION: tl.constexpr, PTX: tl.constexpr):
    """``pa._paged_attn_kernel``'s split path (KV_QUANT, general loop) with the scale loads placed by
    ``SCALE_MODE``: 0 as the product (after K and V, before the math), 1 none (PROBE: scale 1), 2 one tile ahead
    (carried in the loop), 3 before K."""
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, BLOCK_G)
    heads = kvh * group + g
    h_ok = g < group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    kv_head_off = kvh.to(tl.int64)
    row_off = seq * stride_bt
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if SCALE_MODE == 2:  # the first tile's scales before the loop
        tok0 = start + offs_n
        ok0 = tok0 < end
        b0, i0 = _block_slots(block_tables_ptr, row_off, tok0, ok0, BLOCK_SIZE)
        slot0 = b0 * stride_sb + i0 * stride_st + kv_head_off * stride_sh
        ks_next = tl.load(k_scale_ptr + slot0, mask=ok0, other=0.0)
        vs_next = tl.load(v_scale_ptr + slot0, mask=ok0, other=0.0)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        t_ok = tok < end
        blk, in_blk = _block_slots(block_tables_ptr, row_off, tok, t_ok, BLOCK_SIZE)
        slot = blk * stride_sb + in_blk * stride_st + kv_head_off * stride_sh
        if SCALE_MODE == 3:
            ks = tl.load(k_scale_ptr + slot, mask=t_ok, other=0.0)
            vs = tl.load(v_scale_ptr + slot, mask=t_ok, other=0.0)
        ld_mask = t_ok[:, None] & d_ok[None, :]
        k = _kv_tile(k_ptr, blk, in_blk, kv_head_off, stride_kb, stride_kt, stride_kh, offs_d, ld_mask)
        v = _kv_tile(v_ptr, blk, in_blk, kv_head_off, stride_vb, stride_vt, stride_vh, offs_d, ld_mask)
        if SCALE_MODE == 0:
            ks = tl.load(k_scale_ptr + slot, mask=t_ok, other=0.0)
            vs = tl.load(v_scale_ptr + slot, mask=t_ok, other=0.0)
        if SCALE_MODE == 1:
            ks = tl.full([BLOCK_N], 1.0, tl.float32)
            vs = tl.full([BLOCK_N], 1.0, tl.float32)
        if SCALE_MODE == 2:  # this tile's scales came with the last one; the next tile's go out now
            ks = ks_next
            vs = vs_next
            tok_n = tok + BLOCK_N
            ok_n = tok_n < end
            b_n, i_n = _block_slots(block_tables_ptr, row_off, tok_n, ok_n, BLOCK_SIZE)
            slot_n = b_n * stride_sb + i_n * stride_st + kv_head_off * stride_sh
            ks_next = tl.load(k_scale_ptr + slot_n, mask=ok_n, other=0.0)
            vs_next = tl.load(v_scale_ptr + slot_n, mask=ok_n, other=0.0)
        qk = tl.dot(q, tl.trans(kv_as_16bit(k, q.dtype, PTX)), input_precision=PRECISION) * (ks * qk_scale)[None, :]
        qk = tl.where(t_ok[None, :], qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot((p * vs[None, :]).to(q.dtype), kv_as_16bit(v, q.dtype, PTX), acc * alpha[:, None],
                     input_precision=PRECISION)
        m_i = m_new
    row = (seq * n_heads + heads) * n_splits + split
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + row * 2, m_i, mask=h_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_ok)


def study_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scales: str = "product",
                    num_splits: int = 2, tile: dict | None = None, ptx: bool | None = None) -> torch.Tensor:
    """The copy's decode attention over an int8/fp8 paged cache, merged by the product's ``_paged_attn_reduce``.
    ``scales``: a key of ``SCALES``; ``tile``: ``BLOCK_N`` (and on CUDA ``num_warps``, ``num_stages``);
    ``ptx``: the inline-PTX int8 -> float16 step (default: on CUDA; the interpreter runs no PTX)."""
    if scales not in SCALES:
        raise ValueError(f"scales={scales!r}; allowed: {sorted(SCALES)}")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tile = dict(tile or {"BLOCK_N": 32})
    if q.device.type != "cuda":
        tile = {"BLOCK_N": tile["BLOCK_N"]}
    ptx = (q.device.type == "cuda" and torch.version.hip is None) if ptx is None else ptx
    f32 = dict(dtype=torch.float32, device=q.device)
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32)
    part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, **f32)
    out = torch.empty_like(q)
    _study_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_ml, k_scale, v_scale,
        head_dim ** -0.5 * LOG2E, num_heads // num_kv_heads, num_heads, num_splits, q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *k_scale.stride(), block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=max(16, pa.next_pow2(head_dim)),
        BLOCK_G=max(16, pa.next_pow2(num_heads // num_kv_heads)), SCALE_MODE=SCALES[scales],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PTX=ptx, **tile)
    pa._paged_attn_reduce[(num_seqs, num_heads)](part_acc, part_ml, out, num_heads, num_splits, out.stride(0),
                                                 out.stride(1), HEAD_DIM=head_dim, BLOCK_D=pa.next_pow2(head_dim),
                                                 BLOCK_SPLITS=pa.next_pow2(num_splits))
    return out


def head_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` ``[blocks, block_size, kv_heads]`` stored as ``[blocks, kv_heads, block_size]`` (same view)."""
    return scale.permute(0, 2, 1).contiguous().permute(0, 2, 1)


# --- inputs, references, timing ---------------------------------------------------------------------------------
class Case:
    """One context's inputs: ``pools`` copies of the bf16 (float16 on a CPU), int8 and fp8 caches (and their
    scales), one query batch and block table, the references on each dequantised cache."""

    def __init__(self, context: int, device: torch.device, shape: dict = SHAPE, pools: int | None = None,
                 lens: list[int] | None = None):
        from labkit.experiments.kernels.cases import _paged_inputs
        from labkit.kvcache.quant import dequantize_kv, kv_format, quantize_kv

        s = shape
        self.context, self.device = context, device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's tl.dot: not bf16
        dims = (s["seqs"], s["heads"], s["kv_heads"], s["head_dim"], s["block_size"], context)
        self.q, k, v, self.tables, self.lens = _paged_inputs(dims, dtype, device)
        if lens is not None:  # irregular contexts (the CPU test): each at most ``context``
            self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.elems = 2 * int(self.lens.sum()) * s["kv_heads"] * s["head_dim"]  # K and V elements read
        self.bytes = {"bf16": self.elems * 2, "int8": self.elems + self.elems // s["head_dim"] * 4}
        self.bytes["fp8"] = self.bytes["int8"]
        if pools is None:  # enough copies that a call reads 2.5x the L2 (cuda) from DRAM
            l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
            pools = {f: max(1, math.ceil(2.5 * l2 / nb)) for f, nb in self.bytes.items()}
        else:
            pools = dict.fromkeys(self.bytes, pools)
        self.pools = {"bf16": [(k, v, None, None)]}
        q32 = self.q.float()
        self.ref = {"bf16": pa.paged_attention_ref(q32, k.float(), v.float(), self.tables, self.lens)}
        for name in ("int8", "fp8"):
            (kq, ks), (vq, vs) = quantize_kv(k, kv_format(name)), quantize_kv(v, kv_format(name))
            self.pools[name] = [(kq, vq, ks, vs)]
            self.ref[name] = pa.paged_attention_ref(q32, dequantize_kv(kq, ks, torch.float32),
                                                    dequantize_kv(vq, vs, torch.float32), self.tables, self.lens)
        del k, v
        for name, n in pools.items():  # further copies: the same values in other memory
            first = self.pools[name][0]
            self.pools[name] += [tuple(None if t is None else t.clone() for t in first) for _ in range(n - 1)]
        self.auto_splits = pa.auto_num_splits(s["seqs"], s["kv_heads"], self.tables.shape[1] * s["block_size"],
                                              device)


def product_call(case: Case, fmt: str, pool: tuple, num_splits=None, tile=None):
    k, v, ks, vs = pool[:4]
    if tile is None:
        return pa.paged_attention(case.q, k, v, case.tables, case.lens, num_splits=num_splits, k_scale=ks,
                                  v_scale=vs)
    return pa._launch(case.q, k, v, case.tables, case.lens, None, num_splits, ks, vs, "", tile)


def copy_call(case: Case, fmt: str, pool: tuple, scales="product", num_splits=None, tile=None, layout="token"):
    k, v, ks, vs = pool[:4]
    if layout == "head":
        ks, vs = pool[4], pool[5]
    return study_attention(case.q, k, v, ks, vs, case.tables, case.lens, scales=scales,
                           num_splits=num_splits or case.auto_splits, tile=tile)


def with_head_major(case: Case, fmt: str) -> None:
    """Add head-major copies of each pool's scales (``copy_call(layout="head")`` reads them)."""
    case.pools[fmt] = [p[:4] + (head_major(p[2]), head_major(p[3])) for p in case.pools[fmt]]


def autotuned_tile(call) -> dict | None:
    """Run ``call`` and return the tile the product's autotuner picked for it (None: it picked none new)."""
    before = dict(pa._paged_attn_tuned.cache)
    call()
    new = [c for key, c in pa._paged_attn_tuned.cache.items() if key not in before]
    c = new[-1] if new else None  # none new: the key was tuned before (not in this script's order of calls)
    return None if c is None else dict(BLOCK_N=c.kwargs["BLOCK_N"], num_warps=c.num_warps,
                                       num_stages=c.num_stages)


def _time_us(case: Case, fn, fmt: str) -> dict:
    """Microseconds of one call (median of CUDA-graph replays over every pool of ``fmt``), with the 20/80 %
    quantiles; on a CPU no timing."""
    if case.device.type != "cuda":
        return {}
    from labkit.kernels.common import graph_bench

    pools = case.pools[fmt]

    def run_all():
        for p in pools:
            fn(p)

    med, lo, hi = graph_bench(run_all)
    n = len(pools)
    return {"us": med * 1e3 / n, "us_q20": lo * 1e3 / n, "us_q80": hi * 1e3 / n, "pools": n}


def measure(case: Case, rows: list, variant: str, fmt: str, fn, probe: bool = False, **info) -> dict:
    """Check ``fn`` (a pool -> output) against the reference on ``fmt``'s dequantised cache, then time it; append
    and return the row. A compile error or a failed check is recorded, not raised (the ladder goes on)."""
    from labkit.evaluate import relative_error

    row = dict(context=case.context, variant=variant, format=fmt, probe=probe, **info)
    try:
        out = fn(case.pools[fmt][0])
        row["rel_err"] = relative_error(out, case.ref[fmt])
        row["ok"] = probe or row["rel_err"] < TOL
        row.update(_time_us(case, fn, fmt))
        if "us" in row:
            row["GB/s"] = case.bytes[fmt] / row["us"] / 1e3
    except Exception as e:  # a tile the compiler refuses (shared memory, registers): recorded
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    rows.append(row)
    _print_row(row, rows)
    return row


def _bf16_us(rows: list, context: int) -> float | None:
    return next((r["us"] for r in rows if r["context"] == context and r["variant"] == "v0 product bf16"
                 and "us" in r), None)


def _print_row(row: dict, rows: list) -> None:
    base = _bf16_us(rows, row["context"])
    if "error" in row:
        print(f"{row['context']:>6} {row['variant']:<44} ERROR {row['error'][:120]}", flush=True)
        return
    us = row.get("us")
    x = f"{base / us:5.2f}x" if us and base else "  -   "
    flag = "PROBE" if row["probe"] else ("ok" if row["ok"] else "FAIL")
    timing = f"{us:8.2f} us {row['GB/s']:7.0f} GB/s" if us else f"{'-':>11} {'-':>12}"
    print(f"{row['context']:>6} {row['variant']:<44} {timing} {x} rel_err {row['rel_err']:.2e} {flag}",
          flush=True)


def _fastest(rows, pred) -> dict | None:
    ok = [r for r in rows if pred(r) and r.get("ok") and not r["probe"] and "us" in r]
    return min(ok, key=lambda r: r["us"]) if ok else None


# --- the ladder ---------------------------------------------------------------------------------------------------
def ladder(case: Case, rows: list, cpu_tile: dict | None = None) -> dict:
    """v0-v6 at one context; returns v6's pick (scale order, layout, tile, split factor)."""
    tiles = {}
    for fmt in ("bf16", "int8", "fp8"):
        tiles[fmt] = autotuned_tile(lambda f=fmt: product_call(case, f, case.pools[f][0])) \
            if case.device.type == "cuda" else None
        measure(case, rows, f"v0 product {fmt}", fmt, lambda p, f=fmt: product_call(case, f, p),
                num_splits=case.auto_splits, tile=tiles[fmt])
    t8 = tiles["int8"] or cpu_tile or {"BLOCK_N": 32}
    with_head_major(case, "int8")
    order = [("v0 copy int8 (product scale order)", "product", "token"), ("v1 PROBE no scale loads", "none", "token"),
             ("v2 scales prefetched a tile ahead", "prefetch", "token"),
             ("v3 scales before K, all loads first", "first", "token"),
             ("v3hm v3 over head-major scale pools", "first", "head")]
    for variant, scales, layout in order:
        measure(case, rows, variant, "int8", lambda p, s=scales, lay=layout: copy_call(case, "int8", p, s, None, t8,
                                                                                       lay),
                probe=scales == "none", scales=scales, layout=layout, tile=t8, num_splits=case.auto_splits)
    for tile in (V4_TILES if case.device.type == "cuda" else []):
        cap = f"/{tile['maxnreg']}r" if "maxnreg" in tile else ""
        measure(case, rows, f"v4 product int8 tile {tile['BLOCK_N']}/{tile['num_warps']}w/{tile['num_stages']}s{cap}",
                "int8", lambda p, t=tile: product_call(case, "int8", p, tile=t), tile=tile,
                num_splits=case.auto_splits)
    for f in SPLIT_FACTORS:
        n = case.auto_splits * f
        for fmt in ("int8", "bf16"):
            measure(case, rows, f"v5 product {fmt} splits x{f} ({n})", fmt,
                    lambda p, n=n, fm=fmt: product_call(case, fm, p, num_splits=n), num_splits=n, split_factor=f)
    # v6: the best non-probe scale order and layout, the best two tiles, every split factor
    here = [r for r in rows if r["context"] == case.context]
    best_order = _fastest(here, lambda r: r["variant"].startswith(("v0 copy", "v2", "v3")))
    scales, layout = (best_order["scales"], best_order["layout"]) if best_order else ("product", "token")
    ranked = sorted((r for r in here if r["variant"].startswith("v4") and r.get("ok") and "us" in r),
                    key=lambda r: r["us"])
    cand_tiles = [t8] + [r["tile"] for r in ranked[:2] if r["tile"] != t8]
    best = None
    for tile in cand_tiles:
        for f in (1, *SPLIT_FACTORS):
            cap = f"/{tile['maxnreg']}r" if "maxnreg" in tile else ""
            r = measure(case, rows, f"v6 {scales}/{layout} tile {tile['BLOCK_N']}/{tile.get('num_warps', '-')}w/"
                        f"{tile.get('num_stages', '-')}s{cap} splits x{f}", "int8",
                        lambda p, t=tile, f=f: copy_call(case, "int8", p, scales, case.auto_splits * f, t, layout),
                        scales=scales, layout=layout, tile=tile, num_splits=case.auto_splits * f, split_factor=f)
            if r.get("ok") and "us" in r and (best is None or r["us"] < best["us"]):
                best = r
    pick = dict(scales=scales, layout=layout, tile=(best or {}).get("tile", t8),
                split_factor=(best or {}).get("split_factor", 1))
    fp8_layout = "token"  # fp8 with v6's order, tile and splits (token-major scales: the product's layout)
    measure(case, rows, "v6 fp8 with v6's pick (token-major scales)", "fp8",
            lambda p: copy_call(case, "fp8", p, pick["scales"], case.auto_splits * pick["split_factor"],
                                pick["tile"], fp8_layout), **pick)
    return pick


def check_context(case: Case, rows: list, pick: dict) -> None:
    """At another context: the products, the probe and v6's pick."""
    tiles = {}
    for fmt in ("bf16", "int8", "fp8"):
        tiles[fmt] = autotuned_tile(lambda f=fmt: product_call(case, f, case.pools[f][0]))
        measure(case, rows, f"v0 product {fmt}", fmt, lambda p, f=fmt: product_call(case, f, p),
                num_splits=case.auto_splits, tile=tiles[fmt])
    if pick["layout"] == "head":
        with_head_major(case, "int8")
    measure(case, rows, "v1 PROBE no scale loads", "int8",
            lambda p: copy_call(case, "int8", p, "none", None, tiles["int8"]), probe=True, tile=tiles["int8"])
    n = case.auto_splits * pick["split_factor"]
    measure(case, rows, "v6 pick", "int8",
            lambda p: copy_call(case, "int8", p, pick["scales"], n, pick["tile"], pick["layout"]), **pick)


def _short(commit: str) -> str:
    return commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")


def compiled_stats(jit_fn) -> list[dict]:
    """Registers, spills, shared memory, warps and stages of every binary ``jit_fn`` has compiled in this process
    (read from Triton's JIT cache; empty where this Triton keeps it elsewhere): occupancy is the suspect when an
    int8 tile keeps half a bf16 tile's bytes in flight."""
    out = []
    try:
        for cache in getattr(jit_fn, "device_caches", {}).values():
            for k in cache[0].values():
                md = k.metadata
                consts = getattr(getattr(k, "src", None), "constants", None) or {}
                out.append({"num_warps": getattr(md, "num_warps", None), "num_stages": getattr(md, "num_stages", None),
                            "shared": getattr(md, "shared", None), "n_regs": getattr(k, "n_regs", None),
                            "n_spills": getattr(k, "n_spills", None),
                            "constants": {str(a): str(b) for a, b in dict(consts).items()}})
    except Exception as e:  # another Triton's cache layout: the timings stand without it
        out.append({"error": f"{type(e).__name__}: {e}"[:200]})
    return out


def _gpu_slug() -> str:
    from labkit.data import machine_class

    return machine_class(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    from labkit.bench import environment, git_commit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the record's path (default research/records/<gpu>/kv_quant_decode_study_"
                                  "<commit>.json)")
    ap.add_argument("--device", default="cuda", help="cpu: the checks at a tiny shape on the interpreter")
    ap.add_argument("--contexts", type=int, nargs="+", help="check contexts (default 1024 16384)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu to run the checks on the interpreter)")
        return 1
    t_start = time.perf_counter()
    rows: list[dict] = []
    out = Path(args.out) if args.out else (Path(__file__).resolve().parent / "records" / _gpu_slug()
                                           / f"kv_quant_decode_study_{_short(git_commit())}.json")
    command = "python research/kv_quant_decode_study.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def write(pick: dict | None, done: list) -> None:  # after each context: a run cut off keeps what it measured
        record = {"env": environment(), "data": {
            "question": __doc__.splitlines()[0], "shape": SHAPE, "main_context": MAIN_CONTEXT, "tolerance": TOL,
            "command": command, "contexts_done": done, "v6_pick": pick,
            "compiled": {"product": compiled_stats(pa._paged_attn_kernel), "copy": compiled_stats(_study_kernel)},
            "seconds": time.perf_counter() - t_start, "rows": rows}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {out} ({record['data']['seconds']:.0f} s so far)", flush=True)

    if device.type == "cuda":
        print(f"{'ctx':>6} {'variant':<44} {'time':>11} {'of its bytes':>12}  x bf16  rel err", flush=True)
        main_case = Case(MAIN_CONTEXT, device)
        pick = ladder(main_case, rows)
        done = [MAIN_CONTEXT]
        write(pick, done)
        del main_case
        torch.cuda.empty_cache()
        for ctx in args.contexts or CHECK_CONTEXTS:
            case = Case(ctx, device)
            check_context(case, rows, pick)
            done.append(ctx)
            write(pick, done)
            del case
            torch.cuda.empty_cache()
    else:
        pick = ladder(Case(70, device, TINY_SHAPE, pools=1, lens=TINY_LENS), rows, cpu_tile={"BLOCK_N": 16})
        write(pick, [70])
    return 0 if all(r.get("ok") or "error" in r for r in rows) else 2


TINY_SHAPE = dict(seqs=3, heads=4, kv_heads=2, head_dim=32, block_size=16)
TINY_LENS = [1, 37, 70]

if __name__ == "__main__":
    raise SystemExit(main())
