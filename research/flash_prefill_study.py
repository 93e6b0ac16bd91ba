"""What holds labkit's flash prefill back against SDPA's cuDNN backend on Hopper, change by change?

Issue 42 item 3 asks for >= 0.95x SDPA-cuDNN at batch 4, 32/8 heads, 4096 tokens, head dim 128, causal, bf16, or a
measured account of what holds the kernel back. This script times a ladder of kernel variants at that shape, each
checked first against the torch reference (``flash_attention_ref``, float32; relative error ``||out - ref|| /
||ref||``, bound 1e-2), against SDPA's cuDNN and flash backends timed the same way in the same run
(``labkit.bench.time_fn``: ``triton.testing.do_bench`` medians, CUDA events, L2 flushed before each call).

The ladder (a copy of the product kernel below, each change behind one constexpr switch, cumulative):

* ``v0``  the product kernel as it is (``labkit.kernels.flash_attention``, its own autotuner);
* ``v0c`` this file's copy with every switch off, at v0's chosen tile (checks that the copy is the product kernel:
  it drops only the attention-mask and packed-GQA paths, which are compiled out at this shape anyway);
* ``v1``  the softmax scale folded into one FMA: ``m = max(m, rowmax(qk) * scale)``, ``p = exp2(qk * scale - m)``
  (as in Triton's fused-attention tutorial) instead of scaling the whole tile, then subtracting;
* ``v2``  K loaded as ``[BLOCK_N, D]`` rows and transposed in the dot (``tl.trans``) instead of loaded transposed;
* ``v3``  tensor descriptors (TMA on Hopper) for the Q, K, V loads and the O store (``tl.make_tensor_descriptor``,
  one ``[rows, D]`` descriptor per matrix of the program's batch and head, built on the device: rows past the
  sequence read as zeros and are not written, any batch / head strides);
* ``v4``  the fastest of v1-v3 retuned over a wider space (BLOCK_M 128, BLOCK_N 64/128, 4/8 warps, 2-4 stages,
  minus tiles whose Q + pipelined K/V buffers exceed shared memory); v1-v3 run at v0's tile, so that each row
  measures one code change;
* ``v5``  the query-tile index moved to the slowest grid axis (longest causal tiles of *all* heads first, an LPT
  order), where v0 orders longest-first within each head only;
* ``v6``  Triton's automatic warp specialisation (``tl.range(warp_specialize=True)``: a producer warp issues the TMA
  loads, the rest compute) on the TMA kernel. Compiled offline for sm_90 (Triton 3.6.0 and 3.9.0), the pass
  crashes on a specialised loop followed by a second loop -- the exact causal split -- and specialises nothing at
  8 warps; so v6 walks every visible key tile in one loop, each tile masked, at 4 warps, and ``v6c`` is the same
  loop and tile unspecialised (its control). The record says whether the kernel really holds ``ttg.warp_specialize``;
* probes (wrong output by design, never candidates), at the best tile: ``no-exp`` (softmax without its two
  ``exp2``: the MUFU's share) and ``mma-only`` (no softmax at all: the two matmuls, loads and masks), which
  bracket how much of the time the softmax holds.

Every timed row records its tile, registers, spills and shared memory; the record (``--out``, default
``research/records/<gpu>/flash_prefill_study_<commit>.json``) holds the environment, the command, every tile's
timing samples and the table. The run stops tuning past ``--budget-s`` seconds (default 110: the GPU run is to
take under 2 minutes with compilation) and records what it skipped.

    PYTHONPATH=. python research/flash_prefill_study.py                  # on an H100/H200
    PYTHONPATH=. python research/flash_prefill_study.py --device cpu     # the interpreter check, tiny shape
    PYTHONPATH=. python research/flash_prefill_study.py --compile-only   # sm_90 compiles without a GPU (~40 s)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

import labkit  # noqa: F401  (first: on a CPU-only host it sets TRITON_INTERPRET before triton is imported)

if __name__ == "__main__" and "--compile-only" in sys.argv:  # kernels compiled for sm_90 here, not interpreted
    os.environ.pop("TRITON_INTERPRET", None)
# isort: split
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import labkit.kernels.flash_attention as product  # noqa: E402
from labkit.evaluate import relative_error  # noqa: E402

GPU_SHAPE = (4, 32, 8, 4096, 4096, 128)  # batch, query heads, KV heads, queries, keys, head dim
CPU_SHAPE = (1, 4, 2, 70, 70, 32)  # irregular: a partial last tile, two query heads per KV head
CPU_TILE = (32, 16, 4, 1)  # BLOCK_M, BLOCK_N, warps, stages: the diagonal band spans two key tiles
CPU_WIDE_TILE = (16, 32, 4, 1)  # v4's CPU stand-in: key tiles wider than query tiles
TOL = 1e-2  # float16 / bfloat16 (DESIGN.md)
SMEM_BYTES = 227 * 1024  # sm_90's shared memory per block
WIDE = [(128, n, w, s) for n in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
WS_TILES = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2)]  # Hopper warp specialisation: 4 warps only


class Flags(NamedTuple):
    """The switches of ``_study_fwd``: all off is the product kernel. (A NamedTuple, not a dataclass: the tests load
    this file without registering it as a module.)"""

    fold_scale: bool = False  # v1
    k_rows: bool = False  # v2
    tma: bool = False  # v3
    lpt: bool = False  # v5
    single_loop: bool = False  # v6 (control): no off-diagonal / diagonal split, every tile masked
    ws: bool = False  # v6: needs single_loop (Triton's sm_90 WS pass fails on a WS loop followed by another)
    probe: int = 0  # 1: no exp2 (timing only), 2: no softmax (timing only)


@triton.jit
def _study_tiles(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kn, stride_vn, q_pos, offs_d,
                 lo, hi, kv_len, diag, qk_scale, CAUSAL_MASK: tl.constexpr, BOUNDARY: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FOLD_SCALE: tl.constexpr, K_ROWS: tl.constexpr,
                 TMA: tl.constexpr, WS: tl.constexpr, PROBE: tl.constexpr):
    """The product's ``_attn_tiles`` (key tiles ``[lo, hi)`` folded into the running acc, l, m of one query
    tile), with each change of the ladder behind its switch."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):  # v6: WS; range() when off
        cols = start_n + offs_n
        if TMA:  # v3: one bulk copy of a [BLOCK_N, D] tile (rows past kv_len: zeros)
            kt = tl.trans(desc_k.load([start_n, 0]))
        elif K_ROWS:  # v2: K as stored (rows of D), transposed as a dot operand
            if BOUNDARY:
                k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                            mask=(cols[:, None] < kv_len) & d_ok[None, :], other=0.0)
            else:
                k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            kt = tl.trans(k)
        else:  # v0: K loaded transposed, [D, BLOCK_N]
            if BOUNDARY:
                kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None],
                             mask=d_ok[:, None] & (cols[None, :] < kv_len), other=0.0)
            else:
                kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        qk = tl.dot(q, kt)
        if PROBE == 2:  # probe: no softmax at all (masked scores zeroed), only the matmuls, loads and masks
            if CAUSAL_MASK:
                qk = tl.where(q_pos[:, None] + diag >= cols[None, :], qk, 0.0)
            if BOUNDARY:
                qk = tl.where(cols[None, :] < kv_len, qk, 0.0)
            p = qk
        else:
            if not FOLD_SCALE:
                qk = qk * qk_scale  # v0: the whole tile scaled (log2 units) before the max
            if CAUSAL_MASK:
                qk = tl.where(q_pos[:, None] + diag >= cols[None, :], qk, -float("inf"))
            if BOUNDARY:
                qk = tl.where(cols[None, :] < kv_len, qk, -float("inf"))
            if FOLD_SCALE:  # v1: scale the row maxima only, then one FMA per score (scale > 0: max commutes)
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                s = qk * qk_scale - m_new[:, None]
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                s = qk - m_new[:, None]
            if PROBE == 1:  # probe: the same work without the two exp2 (MUFU); the output is garbage
                p = s
                alpha = m_i - m_new
            else:
                p = tl.math.exp2(s)
                alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        if TMA:
            v = desc_v.load([start_n, 0])
        elif BOUNDARY:
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                        mask=(cols[:, None] < kv_len) & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        if PROBE == 2:
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_i


@triton.jit
def _study_fwd(q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, q_len, kv_len, n_heads, group,
               stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               FOLD_SCALE: tl.constexpr, K_ROWS: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr,
               SINGLE_LOOP: tl.constexpr, WS: tl.constexpr, PROBE: tl.constexpr):
    """The product's ``_flash_fwd`` for one query head per program (no mask, no packed GQA: both compiled out
    at prefill shapes), HEAD_DIM a power of two."""
    if LPT:  # v5: query tiles on the slow grid axis, longest first across every head
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
        bh = tl.program_id(0)
    else:  # v0: heads on the slow axis, longest first within each head
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    kvh = h // group
    q_pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = q_pos < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    b64, h64, kvh64 = b.to(tl.int64), h.to(tl.int64), kvh.to(tl.int64)
    k_base = k_ptr + b64 * stride_kb + kvh64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + kvh64 * stride_vh
    q_base = q_ptr + b64 * stride_qb + h64 * stride_qh
    if TMA:  # v3: one [rows, D] descriptor per matrix of this program's (batch, head), built on the device:
        # rows past its own sequence read as zeros and are not written, whatever the other strides
        desc_q = tl.make_tensor_descriptor(q_base, shape=[q_len, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        desc_k = tl.make_tensor_descriptor(k_base, shape=[kv_len, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(v_base, shape=[kv_len, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        q = desc_q.load([pid_m * BLOCK_M, 0])
    else:
        desc_k = k_ptr  # placeholders: the TMA branches are compiled out
        desc_v = v_ptr
        q = tl.load(q_base + q_pos[:, None] * stride_qm + offs_d[None, :], mask=q_ok, other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    diag = kv_len - q_len  # causal, bottom-right: query i sees keys <= i + diag
    q_lo = pid_m * BLOCK_M
    if CAUSAL:  # the loop split exactly: tiles every row sees (no mask), then the diagonal band (masked)
        full_hi = tl.maximum((q_lo + diag + 1) // BLOCK_N * BLOCK_N, 0)
        band_hi = tl.minimum(q_lo + BLOCK_M + diag, kv_len)
    else:
        full_hi = kv_len // BLOCK_N * BLOCK_N
        band_hi = kv_len
    if SINGLE_LOOP:  # v6: one loop over every visible key tile, each masked (what Hopper's auto-WS can take)
        acc, l_i, m_i = _study_tiles(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kn,
                                     stride_vn, q_pos, offs_d, 0, band_hi, kv_len, diag, qk_scale, CAUSAL, True,
                                     HEAD_DIM, BLOCK_N, FOLD_SCALE, K_ROWS, TMA, WS, PROBE)
    else:
        acc, l_i, m_i = _study_tiles(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kn,
                                     stride_vn, q_pos, offs_d, 0, full_hi, kv_len, diag, qk_scale, False, False,
                                     HEAD_DIM, BLOCK_N, FOLD_SCALE, K_ROWS, TMA, WS, PROBE)  # WS: --compile-only's case
        acc, l_i, m_i = _study_tiles(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, stride_kn,
                                     stride_vn, q_pos, offs_d, full_hi, band_hi, kv_len, diag, qk_scale, CAUSAL, True,
                                     HEAD_DIM, BLOCK_N, FOLD_SCALE, K_ROWS, TMA, False, PROBE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)
    o_base = o_ptr + b64 * stride_ob + h64 * stride_oh
    if TMA:
        desc_o = tl.make_tensor_descriptor(o_base, shape=[q_len, HEAD_DIM], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        desc_o.store([q_lo, 0], out)
    else:
        tl.store(o_base + q_pos[:, None] * stride_om + offs_d[None, :], out, mask=q_ok)


def _tma_workspace(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # device-side descriptors: 128 B per program


def study_attention(q, k, v, flags: Flags, tile: tuple, causal: bool = True):
    """``softmax(q k^T / sqrt(d)) v`` by ``_study_fwd`` with ``flags`` at ``tile`` = (BLOCK_M, BLOCK_N, warps,
    stages); returns ``(out [B, H, S, D], compiled kernel or None)``, out a view of ``[B, S, H, D]`` as the
    product returns it."""
    b, h, s, d = q.shape
    t = k.shape[2]
    if d & (d - 1) or d < 16 or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the study kernel takes a power-of-two head dim >= 16 in float16/bfloat16; got d={d}, "
                         f"{q.dtype}")
    if flags.ws and not flags.single_loop:
        raise ValueError("ws=True needs single_loop=True: Triton's sm_90 warp-specialisation pass fails (3.6, 3.9) "
                         "on a specialised loop followed by another loop, as the split causal loop is")
    if flags.tma and q.is_cuda:
        triton.set_allocator(_tma_workspace)
    out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
    bm, bn, warps, stages = tile
    grid = (b * h, triton.cdiv(s, bm)) if flags.lpt else (triton.cdiv(s, bm), b * h)
    kernel = _study_fwd[grid](
        q, k, v, out, d ** -0.5 * product.LOG2E, s, t, h, h // k.shape[1], *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], out.stride(0), out.stride(2), out.stride(1), CAUSAL=causal, HEAD_DIM=d, BLOCK_M=bm,
        BLOCK_N=bn, FOLD_SCALE=flags.fold_scale, K_ROWS=flags.k_rows, TMA=flags.tma, LPT=flags.lpt,
        SINGLE_LOOP=flags.single_loop, WS=flags.ws, PROBE=flags.probe, num_warps=warps, num_stages=stages)
    return out.transpose(1, 2), kernel


def fits_smem(tile: tuple, d: int) -> bool:
    """Q plus ``stages`` K and V buffers (2 bytes an element) within sm_90's shared memory."""
    bm, bn, _, stages = tile
    return 2 * d * (bm + 2 * stages * bn) <= SMEM_BYTES


def _inputs(shape, dtype, device):
    b, h, hk, s, t, d = shape
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*x, generator=g).to(dtype).to(device) for x in ((b, h, s, d), (b, hk, t, d), (b, hk, t, d))]


def _reference(q, k, v):
    """float32 reference, one batch at a time (a [H, S, T] score matrix of 2 GiB at the GPU shape)."""
    return torch.cat([product.flash_attention_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=True).float()
                      if q.is_cuda else product.flash_attention_ref(q[i:i + 1].double(), k[i:i + 1].double(),
                                                            v[i:i + 1].double(), causal=True)
                      for i in range(q.shape[0])])


def _errors(out, ref) -> dict:
    return {"rel_err": relative_error(out, ref), "max_abs_err": (out.double() - ref.double()).abs().max().item()}


def _kernel_info(kernel) -> dict:
    """Registers, spills, shared memory and whether Triton warp-specialised the kernel (compiled kernels only)."""
    if kernel is None or not hasattr(kernel, "asm"):
        return {}
    info = {"ws_applied": "ttg.warp_specialize" in kernel.asm.get("ttgir", "")}
    for key in ("n_regs", "n_spills"):
        info[key] = getattr(kernel, key, None)
    info["shared_bytes"] = getattr(kernel.metadata, "shared", None)
    return info


class Study:
    """One run: the inputs, the reference, the clock, the rows."""

    def __init__(self, device: torch.device, budget_s: float, iters: int):
        self.device, self.budget_s, self.iters, self.t0 = device, budget_s, iters, time.monotonic()
        self.gpu = device.type == "cuda"
        shape = GPU_SHAPE if self.gpu else CPU_SHAPE
        dtype = torch.bfloat16 if self.gpu else torch.float16  # the interpreter's tl.dot: not bf16
        self.shape, self.dtype = shape, dtype
        self.q, self.k, self.v = _inputs(shape, dtype, device)
        self.ref = _reference(self.q, self.k, self.v)
        b, h, _, s, t, d = shape
        self.flops = 4 * b * h * s * t * d / 2  # causal: half the square
        self.rows: list[dict] = []
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over_budget(self, what: str) -> bool:
        if self.elapsed() > self.budget_s:
            self.skipped.append(f"{what}: past the {self.budget_s:.0f} s budget at {self.elapsed():.0f} s")
            print(f"skip {what}: time budget", flush=True)
            return True
        return False

    def time_us(self, fn, iters: int) -> tuple[float, list[float]]:
        from labkit.bench import time_fn

        tm = time_fn(fn, self.device, warmup=3, iters=iters)
        return tm.median_us, [1e6 * x for x in tm.samples_s]

    def run_one(self, fn, probe: bool = False, iters: int | None = None) -> dict:
        """Check ``fn()`` against the reference, then time it (a wrong candidate is not timed; on the CPU the
        checked call is the timed one)."""
        row: dict = {}
        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():  # a probe's garbage (inf - inf) under the interpreter's numpy
                warnings.simplefilter("ignore", RuntimeWarning)
                out = fn()
            kernel = out[1] if isinstance(out, tuple) else None
            out = out[0] if isinstance(out, tuple) else out
            if self.gpu:
                torch.cuda.synchronize()
            row.update(first_call_s=time.monotonic() - t0, **_errors(out, self.ref), **_kernel_info(kernel))
            if not probe and not row["rel_err"] < TOL:
                row["error"] = f"rel_err {row['rel_err']:.3g} over {TOL}"
                return row
            if self.gpu:
                row["us"], row["samples_us"] = self.time_us(fn, iters or self.iters)
            else:
                row["us"], row["samples_us"] = row["first_call_s"] * 1e6, []
        except Exception as e:  # noqa: BLE001 - a tile the compiler refuses (shared memory, ...): record, go on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        return row

    def tune(self, name: str, flags: Flags, tiles: list[tuple], probe: bool = False) -> dict:
        """``flags`` at each tile (a short timing each), then the fastest timed again with ``iters`` reps."""
        tried = []
        for tile in tiles:
            if self.over_budget(f"{name} {tile}"):
                break
            fn = lambda tile=tile: study_attention(self.q, self.k, self.v, flags, tile)  # noqa: E731
            r = self.run_one(fn, probe, iters=max(5, self.iters // 4) if len(tiles) > 1 and self.gpu else None)
            tried.append(dict(tile=list(tile), **{k: x for k, x in r.items() if k != "samples_us"}))
            print(f"  {name} {tile}: {r.get('us', float('nan')):.1f} us {r.get('error', '')}", flush=True)
        ok = [r for r in tried if "us" in r]
        row = dict(name=name, kind="probe" if probe else "variant", flags=flags._asdict(), tiles=tried)
        if not ok:
            row["error"] = "no tile ran" if tried else "skipped: time budget"
            return row
        best = min(ok, key=lambda r: r["us"])
        tile = tuple(best["tile"])
        final = self.run_one(lambda: study_attention(self.q, self.k, self.v, flags, tile), probe) \
            if len(ok) > 1 and self.gpu else dict(best, samples_us=[])
        row.update(tile=list(tile), **{k: x for k, x in final.items() if k != "tile"})
        return row


def _gpu_slug() -> str:
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    m = re.search(r"\b([a-z]\d{2,3}[a-z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def baselines(st: Study) -> list[dict]:
    """SDPA's cuDNN and flash backends, each called with ``enable_gqa=True`` and with K/V expanded to every query
    head beforehand (not timed), as a user without GQA support would; the faster form is the baseline."""
    import torch.nn.functional as F

    if not st.gpu:
        return [dict(name="sdpa", kind="baseline", backend="default", form="gqa",
                     **st.run_one(lambda: F.scaled_dot_product_attention(st.q, st.k, st.v, is_causal=True,
                                                                          enable_gqa=True)))]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = st.q.shape[1] // st.k.shape[1]
    k_x, v_x = st.k.repeat_interleave(group, 1), st.v.repeat_interleave(group, 1)
    rows = []
    for backend_name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for form, kk, vv, gqa in (("gqa", st.k, st.v, True), ("expanded", k_x, v_x, False)):
            def run(backend=backend, kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(st.q, kk, vv, is_causal=True, enable_gqa=gqa)
            r = dict(name=f"sdpa_{backend_name}_{form}", kind="baseline", backend=backend_name, form=form,
                     **st.run_one(run))
            print(f"{r['name']}: {r.get('us', float('nan')):.1f} us {r.get('error', '')}", flush=True)
            rows.append(r)
    return rows


def ladder(st: Study) -> list[dict]:
    """v0 ... v6 and the probes, in order; each later step builds on the measured winner of the earlier ones."""
    rows = [dict(name="v0 product", kind="variant",
                 **st.run_one(lambda: product.flash_attention(st.q, st.k, st.v, causal=True)))]
    tile, tile0 = CPU_TILE, (product.CPU_BLOCK_M, product.CPU_BLOCK_N, 4, 1)  # the study's; the product's on a CPU
    if st.gpu:
        c = getattr(product._flash_fwd_tuned, "best_config", None)
        tile = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) if c else (128, 64, 8, 3)
        tile0 = tile
    rows[0]["tile"] = list(tile0)
    print(f"v0 product {tile0}: {rows[0].get('us', float('nan')):.1f} us {rows[0].get('error', '')}", flush=True)
    steps = [("v0c copy", Flags()), ("v1 fold scale", Flags(fold_scale=True)),
             ("v2 K rows", Flags(fold_scale=True, k_rows=True)),
             ("v3 TMA", Flags(fold_scale=True, k_rows=True, tma=True))]
    for name, flags in steps:
        rows.append(st.tune(name, flags, [tile]))
    timed = [r for r in rows[2:] if "us" in r] or [rows[1]]
    best = min(timed, key=lambda r: r.get("us", float("inf")))
    flags = Flags(**best["flags"])
    wide = [t for t in WIDE if fits_smem(t, st.shape[-1])] if st.gpu else [CPU_WIDE_TILE]
    rows.append(dict(st.tune("v4 wide tune", flags, wide), based_on=best["name"]))
    v4 = rows[-1]
    tile4 = tuple(v4.get("tile", tile))
    rows.append(st.tune("v5 LPT grid", flags._replace(lpt=True), [tile4]))
    top = min([r for r in (v4, rows[-1]) if "us" in r] or [v4], key=lambda r: r.get("us", float("inf")))
    top_flags, top_tile = Flags(**top["flags"]), tuple(top.get("tile", tile4))
    rows.append(st.tune("probe no-exp", top_flags._replace(probe=1), [top_tile], probe=True))
    rows.append(st.tune("probe mma-only", top_flags._replace(probe=2), [top_tile], probe=True))
    ws_tiles = [t for t in WS_TILES if fits_smem(t, st.shape[-1])] if st.gpu else [CPU_TILE]
    ws_flags = top_flags._replace(tma=True, k_rows=True, single_loop=True, ws=True)
    rows.append(st.tune("v6 warp-specialize", ws_flags, ws_tiles))
    ws_tile = tuple(rows[-1].get("tile", ws_tiles[0]))  # its control: the same loop and tile, not specialised
    rows.append(dict(st.tune("v6c single loop, no WS", ws_flags._replace(ws=False), [ws_tile]), control_of="v6"))
    return rows


def table(st: Study, base: list[dict], rows: list[dict]) -> list[dict]:
    """Each row's microseconds, TFLOP/s and ratio to the faster form of each SDPA backend (times of theirs over
    ours: above 1 is faster than the backend)."""
    def fastest(backend):
        ok = [r["us"] for r in base if r.get("backend") == backend and "us" in r]
        return min(ok) if ok else None

    ref = {b: fastest(b) for b in ("cudnn", "flash", "default")}
    out = []
    for r in base + rows:
        us = r.get("us")
        out.append(dict(name=r["name"], kind=r["kind"], us=us, tflop_s=st.flops / us / 1e6 if us and st.gpu else None,
                        x_cudnn=ref["cudnn"] / us if us and ref["cudnn"] else None,
                        x_flash=ref["flash"] / us if us and ref["flash"] else None, rel_err=r.get("rel_err"),
                        max_abs_err=r.get("max_abs_err"), tile=r.get("tile"), error=r.get("error")))
    return out


def print_table(rows: list[dict], gpu: bool) -> None:
    f = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
    print(f"\n{'variant':<26}{'us' if gpu else 'us (interp)':>12}{'TFLOP/s':>9}{'x cuDNN':>9}{'x flash':>9}"
          f"{'rel err':>10}{'max abs':>10}  tile / note")
    for r in rows:
        note = r["error"] or (str(tuple(r["tile"])) if r["tile"] else "")
        print(f"{r['name']:<26}{f(r['us'], '.1f'):>12}{f(r['tflop_s'], '.1f'):>9}{f(r['x_cudnn'], '.3f'):>9}"
              f"{f(r['x_flash'], '.3f'):>9}{f(r['rel_err'], '.2e'):>10}{f(r['max_abs_err'], '.2e'):>10}  {note}"
              f"{'  (probe)' * (r['kind'] == 'probe')}")


def run(device: torch.device, budget_s: float = 110.0, iters: int = 40) -> dict:
    st = Study(device, budget_s, iters)
    base = baselines(st)
    rows = ladder(st)
    tab = table(st, base, rows)
    print_table(tab, st.gpu)
    b, h, hk, s, t, d = st.shape
    return dict(shape=dict(batch=b, heads=h, kv_heads=hk, queries=s, keys=t, head_dim=d, causal=True,
                           dtype=str(st.dtype).replace("torch.", "")),
                flops=st.flops, tolerance=TOL, timing="do_bench median, CUDA events, L2 flushed" if st.gpu else
                "interpreter wall time of one call (not a figure)", iters=iters, baselines=base, variants=rows,
                table=tab, skipped=st.skipped, wall_s=st.elapsed())


def cpu_check() -> list[dict]:
    """Every variant under the interpreter at the tiny irregular shape: the rows of ``run`` on the CPU."""
    return run(torch.device("cpu"))["variants"]


def compile_report() -> list[dict]:
    """Each rung compiled for sm_90 by the installed Triton without a GPU (ptxas ships with it), at the GPU shape's
    specialisation: registers and spill bytes (``cuobjdump``), shared memory, whether warp-specialised, or the
    compiler's error -- including the two forms of warp specialisation v6 does not use."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(_study_fwd, JITFunction):
        raise RuntimeError("the kernels were set up for Triton's interpreter: run this file as a script with "
                           "--compile-only")
    b, h, hk, s, t, d = GPU_SHAPE
    q, kv, o = (torch.empty(*x, device="meta").stride()[:3] for x in ((b, h, s, d), (b, hk, t, d), (b, s, h, d)))
    ints = dict(q_len=s, kv_len=t, n_heads=h, group=h // hk, stride_qb=q[0], stride_qh=q[1], stride_qm=q[2],
                stride_kb=kv[0], stride_kh=kv[1], stride_kn=kv[2], stride_vb=kv[0], stride_vh=kv[1], stride_vn=kv[2],
                stride_ob=o[0], stride_oh=o[2], stride_om=o[1])  # as a launch specialises them (divisible by 16)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    ladder_flags = Flags(fold_scale=True, k_rows=True, tma=True)
    cases = [("v0c copy", Flags(), (128, 64, 8, 3)), ("v1 fold scale", Flags(fold_scale=True), (128, 64, 8, 3)),
             ("v2 K rows", Flags(fold_scale=True, k_rows=True), (128, 64, 8, 3)),
             *[("v3 TMA", ladder_flags, tile) for tile in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3))],
             ("probe no-exp", ladder_flags._replace(probe=1), (128, 64, 8, 3)),
             ("probe mma-only", ladder_flags._replace(probe=2), (128, 64, 8, 3)),
             *[("v6 warp-specialize", ladder_flags._replace(single_loop=True, ws=True), tile) for tile in WS_TILES],
             ("v6c single loop, no WS", ladder_flags._replace(single_loop=True), WS_TILES[0]),
             ("WS at 8 warps", ladder_flags._replace(single_loop=True, ws=True), (128, 64, 8, 2)),
             ("WS on the split loop", ladder_flags._replace(ws=True), WS_TILES[0])]
    rows = []
    for name, flags, (bm, bn, warps, stages) in cases:
        consts = dict(CAUSAL=True, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, FOLD_SCALE=flags.fold_scale,
                      K_ROWS=flags.k_rows, TMA=flags.tma, LPT=flags.lpt, SINGLE_LOOP=flags.single_loop, WS=flags.ws,
                      PROBE=flags.probe)
        args = _study_fwd.arg_names
        sig = {a: "constexpr" if a in consts else "fp32" if a == "qk_scale" else "*bf16" if a.endswith("_ptr")
               else "i32" for a in args}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args)
                 if a.endswith("_ptr") or ints.get(a, 1) % 16 == 0}
        row = dict(name=name, flags=flags._asdict(), tile=[bm, bn, warps, stages])
        try:
            kernel = triton.compile(ASTSource(fn=_study_fwd, signature=sig, constexprs=consts, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps, "num_stages": stages})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                       text=True).stdout
            res = dict(re.findall(r"(REG|LOCAL):(\d+)", usage))
            row.update(registers=int(res.get("REG", -1)), spill_bytes=int(res.get("LOCAL", -1)),
                       shared_bytes=kernel.metadata.shared, ws_applied="ttg.warp_specialize" in kernel.asm["ttgir"])
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the finding
            row["error"] = f"{type(e).__name__}: {e}"[-600:]
        print(f"{name:<24}{str(tuple(row['tile'])):<18}" + (row.get("error") or
              f"{row['registers']} regs, {row['spill_bytes']} B spilled, {row['shared_bytes']} B shared, "
              f"warp-specialised: {row['ws_applied']}"), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cpu: the interpreter check at a tiny shape (no figures)")
    ap.add_argument("--out", default=None, help="the record's path (default research/records/<gpu>/"
                                                "flash_prefill_study_<commit>.json)")
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop tuning past this many seconds")
    ap.add_argument("--iters", type=int, default=40, help="timed calls of each final measurement (>= 20)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile each rung for sm_90 without a GPU: registers, spills, shared memory, WS")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.compile_only else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu to check the script on the interpreter)")
        return 1
    if args.iters < 20:
        ap.error(f"--iters={args.iters}: the medians need at least 20 timed calls")
    from labkit.bench import _jsonable, environment, git_commit

    command = "python research/flash_prefill_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.monotonic()
    if args.compile_only:
        data = dict(command=command.strip(), target="cuda sm_90 (compiled, not run)", compiled=compile_report(),
                    wall_s=time.monotonic() - t0)
    else:
        data = dict(command=command.strip(), **run(device, args.budget_s, args.iters))
    commit = git_commit()
    stem = f"flash_prefill_compile_triton{triton.__version__}" if args.compile_only else "flash_prefill_study"
    name = f"{stem}_{commit[:7]}{'-dirty' if commit.endswith('-dirty') else ''}.json"
    path = Path(args.out) if args.out else Path(__file__).resolve().parent / "records" / _gpu_slug() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(environment(), triton=triton.__version__)
    path.write_text(json.dumps({"env": env, "data": data}, indent=1, default=_jsonable))
    print(f"wrote {path} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
