"""Does the int8/fp8 decode-attention kernel reach its bytes' rate with the cache tile as the MMA's first operand?

Issue 42 item 2. The product kernel (``labkit.kernels.paged_attention``) multiplies ``q`` ``[G, D]`` (G = 4 query
heads of one KV head, padded to 16 rows) by the converted K tile's transpose, and P by the converted V tile: the
cache tile is always the *second* operand. With 16 rows Triton emits ``mma.sync`` (the M = 16 form), and a
converted second operand goes register -> shared -> register before the MMA reads it. On an H100 at 0518b54 the
int8 cache ran 1.12x bf16 (bar 1.7x) and no rung of ``research/kv_quant_decode_study.py`` (scale loads, tiles,
stages, register caps, splits) passed 1.15x: the per-token work that half the bytes does not shrink binds.

This script transposes the products, the "swap AB" of small-batch GEMMs: scores^T = K q^T (``[N, G]``) and
out^T = V^T P^T, so the cache tile is the first operand with M = BLOCK_N >= 64 rows -- the form Hopper's
``wgmma`` takes from registers, right after the conversion, with the small ``q`` / ``P`` as the shared-memory
operand -- and the online softmax runs down columns. Rungs, each checked against ``paged_attention_ref`` on the
dequantised cache before it is timed:

* ``product``  the product kernel on the bf16, int8 and fp8 caches (autotuned), the baseline;
* ``swap``     the transposed kernel on each cache (bf16 too: the control for the transposition itself);
* ``swap-i8q`` int8 only: K q^T as an int8 x int8 -> int32 product, ``q`` quantised per head in the kernel
  (``s_q = max|q| / 127``), so K is never converted (SageAttention's int8 QK^T); V as in ``swap``.

each at the tiles in ``TILES``. Same shape and timing as the ladder (batch 16, 32 / 8 heads of 128, 16-token
blocks, contexts 1k / 4k / 16k; CUDA-graph replays over enough cache copies to read 2.5x the L2 from DRAM).

    LABKIT_GIT_COMMIT=<sha> PYTHONPATH=. python research/kv_attn_operand_order.py --out $OUT/kv_swap.json
    python research/kv_attn_operand_order.py --device cpu --out /tmp/kv_swap.json   # the checks on the interpreter
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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
from labkit.kernels.paged_attention import LOG2E, _block_slots
from labkit.kernels.quantized_matmul.ptx import kv_as_16bit


def _sibling(name: str):
    """The study ``research/<name>.py`` beside this one, imported by its path (research/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"research_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ladder = _sibling("kv_quant_decode_study")  # its case (caches, references), checks and timing, shared
TINY_LENS, TINY_SHAPE, TOL, Case = _ladder.TINY_LENS, _ladder.TINY_SHAPE, _ladder.TOL, _ladder.Case
autotuned_tile, measure, product_call = _ladder.autotuned_tile, _ladder.measure, _ladder.product_call

CONTEXTS = (4096, 1024, 16384)
TILES = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in ((64, 4, 3), (64, 4, 4), (128, 4, 3),
                                                                     (128, 8, 3))]
MODES = {"swap": 0, "swap-i8q": 1}


@triton.jit
def _kv_tile_t(pool_ptr, blk, in_blk, head_off, stride_b, stride_t, stride_h, offs_d, mask):
    """``[head_dim, tokens]`` of one KV head (the transposed tile) from ``[num_blocks, block_size, kv_heads, D]``."""
    return tl.load(pool_ptr + blk[None, :] * stride_b + in_blk[None, :] * stride_t + head_off * stride_h
                   + offs_d[:, None], mask=mask, other=0.0)


@triton.jit
def _swap_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, part_acc_ptr, part_ml_ptr,
                 k_scale_ptr, v_scale_ptr, qk_scale, group, n_heads, n_splits,
                 stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_sb, stride_st, stride_sh, stride_bt,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, KV_QUANT: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr,
                 PTX: tl.constexpr):
    """The product's split path (general loop) with both products transposed: the running max, sum and output
    are per column (query head); ``acc`` is ``[D, G]``. ``MODE`` 1: int8 K against an int8 ``q``."""
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
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [G, D]
    if MODE == 1:  # per-head int8 q: q ~ qi * s_q
        s_q = tl.max(tl.abs(q.to(tl.float32)), 1) / 127.0
        s_q = tl.where(s_q == 0.0, 1.0, s_q)
        q_op = tl.floor(q.to(tl.float32) / s_q[:, None] + 0.5).to(tl.int8)
        mul = tl.float16 if q.dtype == tl.bfloat16 else q.dtype
    else:
        mul = tl.float16 if (KV_QUANT and q.dtype == tl.bfloat16) else q.dtype
        q_op = q.to(mul)
    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        t_ok = tok < end
        blk, in_blk = _block_slots(block_tables_ptr, row_off, tok, t_ok, BLOCK_SIZE)
        k = tl.load(k_ptr + blk[:, None] * stride_kb + in_blk[:, None] * stride_kt + kv_head_off * stride_kh
                    + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        vt = _kv_tile_t(v_ptr, blk, in_blk, kv_head_off, stride_vb, stride_vt, stride_vh, offs_d,
                        d_ok[:, None] & t_ok[None, :])  # [D, N]
        if KV_QUANT:
            slot = blk * stride_sb + in_blk * stride_st + kv_head_off * stride_sh
            ks = tl.load(k_scale_ptr + slot, mask=t_ok, other=0.0)
            vs = tl.load(v_scale_ptr + slot, mask=t_ok, other=0.0)
            if MODE == 1:
                st = tl.dot(k, tl.trans(q_op), out_dtype=tl.int32).to(tl.float32) * (ks * qk_scale)[:, None] \
                    * s_q[None, :]
            else:
                st = tl.dot(kv_as_16bit(k, mul, PTX), tl.trans(q_op), input_precision=PRECISION) \
                    * (ks * qk_scale)[:, None]
        else:
            st = tl.dot(k, tl.trans(q_op), input_precision=PRECISION) * qk_scale
        st = tl.where(t_ok[:, None], st, -float("inf"))  # [N, G]
        m_new = tl.maximum(m_i, tl.max(st, 0))
        pt = tl.math.exp2(st - m_new[None, :])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(pt, 0)
        if KV_QUANT:  # (vq * s)^T p^T = vq^T (s * p^T)
            acc = tl.dot(kv_as_16bit(vt, mul, PTX), (pt * vs[:, None]).to(mul), acc * alpha[None, :],
                         input_precision=PRECISION)
        else:
            acc = tl.dot(vt, pt.to(vt.dtype), acc * alpha[None, :], input_precision=PRECISION)
        m_i = m_new
    row = (seq * n_heads + heads) * n_splits + split
    tl.store(part_acc_ptr + row[None, :] * HEAD_DIM + offs_d[:, None], acc, mask=d_ok[:, None] & h_ok[None, :])
    tl.store(part_ml_ptr + row * 2, m_i, mask=h_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_ok)


def swap_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, mode: str = "swap",
                   num_splits: int = 2, tile: dict | None = None) -> torch.Tensor:
    """The transposed decode attention over a paged cache (bf16/fp16, int8 or fp8 with scales), merged by the
    product's ``_paged_attn_reduce``. ``mode``: a key of ``MODES`` (``swap-i8q`` needs an int8 cache)."""
    if mode not in MODES or (mode == "swap-i8q" and k_cache.dtype != torch.int8):
        raise ValueError(f"mode={mode!r} with a {k_cache.dtype} cache; allowed: {sorted(MODES)} (swap-i8q: int8)")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tile = dict(tile or {"BLOCK_N": 32})
    if q.device.type != "cuda":
        tile = {"BLOCK_N": tile["BLOCK_N"]}
    quant = k_scale is not None
    f32 = dict(dtype=torch.float32, device=q.device)
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, **f32)
    part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, **f32)
    out = torch.empty_like(q)
    ks, vs = (k_scale, v_scale) if quant else (out, out)
    _swap_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_ml, ks, vs,
        head_dim ** -0.5 * LOG2E, num_heads // num_kv_heads, num_heads, num_splits, q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *(k_scale.stride() if quant else (0, 0, 0)),
        block_tables.stride(0), BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=max(16, pa.next_pow2(head_dim)),
        BLOCK_G=max(16, pa.next_pow2(num_heads // num_kv_heads)), KV_QUANT=quant, MODE=MODES[mode],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PTX=q.device.type == "cuda", **tile)
    pa._paged_attn_reduce[(num_seqs, num_heads)](part_acc, part_ml, out, num_heads, num_splits, out.stride(0),
                                                 out.stride(1), HEAD_DIM=head_dim, BLOCK_D=pa.next_pow2(head_dim),
                                                 BLOCK_SPLITS=pa.next_pow2(num_splits))
    return out


def rungs(case: Case, rows: list, tiles: list[dict]) -> None:
    """Every rung at one context, products first (their bf16 row is every ratio's base)."""
    for fmt in ("bf16", "int8", "fp8"):
        tile = autotuned_tile(lambda f=fmt: product_call(case, f, case.pools[f][0])) \
            if case.device.type == "cuda" else None
        measure(case, rows, f"product {fmt}", fmt, lambda p, f=fmt: product_call(case, f, p),
                num_splits=case.auto_splits, tile=tile)
    for mode, fmts in (("swap", ("bf16", "int8", "fp8")), ("swap-i8q", ("int8",))):
        for fmt in fmts:
            for tile in tiles:
                name = f"{mode} {fmt} {tile['BLOCK_N']}/{tile.get('num_warps', '-')}w/{tile.get('num_stages', '-')}s"
                measure(case, rows, name, fmt,
                        lambda p, m=mode, t=tile: swap_attention(case.q, *p[:2], p[2], p[3], case.tables, case.lens,
                                                                 m, case.auto_splits, t),
                        mode=mode, tile=tile, num_splits=case.auto_splits)


def main(argv: list[str] | None = None) -> int:
    from labkit.bench import environment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the record's path (JSON)")
    ap.add_argument("--device", default="cuda", help="cpu: the checks at a tiny shape on the interpreter")
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu to run the checks on the interpreter)")
        return 1
    t_start, rows = time.perf_counter(), []
    out = Path(args.out)
    contexts = args.contexts if device.type == "cuda" else [70]
    for ctx in contexts:
        if device.type == "cuda":
            case, tiles = Case(ctx, device), TILES
        else:
            case, tiles = Case(ctx, device, TINY_SHAPE, pools=1, lens=TINY_LENS), [{"BLOCK_N": 16}]
        rungs(case, rows, tiles)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": environment(), "data": {
            "question": __doc__.splitlines()[0], "command": "python research/kv_attn_operand_order.py "
            + " ".join(argv if argv is not None else sys.argv[1:]), "contexts_done": contexts[:contexts.index(ctx) + 1],
            "seconds": time.perf_counter() - t_start, "rows": rows}}, indent=1, default=str))
        print(f"wrote {out} ({time.perf_counter() - t_start:.0f} s so far)", flush=True)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0 if all(r.get("ok") or "error" in r for r in rows) else 2


if __name__ == "__main__":
    raise SystemExit(main())
