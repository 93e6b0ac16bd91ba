"""Every GEMV launch candidate timed the way a decode step runs it, at the 8B shapes.

The autotuner times each candidate once, alone, with ``do_bench`` (an L2 flush that leaves the cache full of dirty
lines before every call); a decode step runs the GEMVs back to back inside a CUDA graph, each on weights that are
not in L2. This times every candidate that way: a graph of launches that cycle through enough copies of the
weights to exceed L2 several times, replayed, per launch. Beside them: cuBLAS at bf16 on the same shape and the
same rotation, and an empty Triton kernel (what one graph node costs before any work). Every candidate is a
product kernel with its tile passed as tuning data (``labkit.kernels.quantized_matmul.QuantTuning``).

Kinds: ``bf16`` (cuBLAS), ``w8`` / ``w4`` (the split-K GEMVs: tile x split x load pipeline, and the autotuner's
pick), ``w4xs`` / ``w8xs`` (the stationary GEMVs: tiles and row steps), ``read`` (a kernel that only reads as many
bytes as the int4 weights and XORs them: the floor a kernel of that size reaches on this machine, launch and tail
included, which the copy bandwidth of a large buffer overstates). ``--experiments`` (w4xs): ``pdl`` (labkit's tile
plain and as a programmatic dependent launch, and whole-K programs), ``tiles`` (other slices, warps and whole-K
programs, with PDL), ``step`` (the split and whole-K tiles plain and with PDL, and at half and a quarter of the
rule's row steps), ``fused`` (those tiles plain, with the RMSNorm inside and with the residual add inside),
``splittiles`` (split tiles of other rows, slices and warps); ``step``, ``fused`` and ``splittiles`` time each GEMV
after a kernel that writes its activations, as in a decode step.

    python research/gemv_study.py --out /tmp/h200            # sweep: records/gemv_study.json
    python research/gemv_study.py --best /tmp/h200/records/gemv_study.json   # each shape's best, once (for ncu)
    python research/gemv_study.py --kinds w8 w8xs --baseline-only --out /tmp/h200   # int8: split-K vs stationary
    python research/gemv_study.py --kinds read w4xs --baseline-only --out /tmp/h200   # int4 against a bare read

Variants the product kernels no longer have (the cross-slice reduction skipped, the TAGGED reduction, loads left
to Triton's pipeliner, unpaired words, the first loads after the slice's preparation, the int8 float32 path,
register caps) were timed by earlier versions of this script; their records are in results/h200/records/ and
research/README.md says where the code is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm.auto import tqdm

from labkit.bench import write_record
from labkit.experiments.kernels.stream_read import READ_TILES, stream_read, stream_read_ref
from labkit.hardware import measure_copy_bandwidth
from labkit.kernels.common import cold_l2_bench, graph_replay_ms
from labkit.kernels.quantized_matmul import (
    HOPPER,
    SplitKTile,
    StationaryTile,
    dequantize_int4,
    dequantize_int8,
    splitk,
    stationary_plan,
    w4a16_matmul,
    w8a16_matmul,
)
from labkit.kernels.quantized_matmul.stationary import w8_gemv_xs
from labkit.kernels.quantized_matmul.tuning import SPLITK_CANDIDATES

# (N, K) of the 8B decode step's linears: the engine merges q/k/v and gate/up; Hugging Face's model does not
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "gate_or_up": (14336, 4096), "k_or_v": (1024, 4096)}
GROUP = 128
SMS = 132  # an H100's or H200's: the row steps of the candidates are chosen for it
ROTATE_BYTES = 400e6  # > 8x the H200's 50 MB L2
# the autotuners' tiles (int8: and a few more around them) (BLOCK_N, BLOCK_K, warps); the int4 tiles around
# them were swept in records/gemv_study_w4_4c16124.json
W8_TILES = tuple(dict.fromkeys(SPLITK_CANDIDATES.w8_tiles + ((128, 64, 4), (64, 128, 4), (32, 512, 8), (128, 128, 4))))
W4_TILES = SPLITK_CANDIDATES.w4_tiles
SPLITS = (1, 2, 4, 8, 16)
STAGES = (1, 3)


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0)


# --- candidates ------------------------------------------------------------------------------------------------
def _read_candidates(n: int, k: int) -> list[dict]:
    """``stream_read`` over the int4 weights' bytes: the blocks and warps of its ``READ_TILES`` (2-8 KB a step),
    1-8 steps a program (all of a program's loads in flight at once: the loop is unrolled)."""
    return [{"BLOCK": b, "ITERS": it, "num_warps": w} for b, _, w in READ_TILES for it in (1, 2, 4, 8)]


def _rule(bits: int, cfg: dict):
    """labkit's stationary rule with the one tile ``cfg`` names (``BLOCK_N``, ``BLOCK_K``, ``num_warps``,
    ``ROW_STEPS``; a ``BLOCK_K`` of K is a whole-K program)."""
    base = HOPPER.w4_stationary if bits == 4 else HOPPER.w8_stationary
    return replace(base, whole_k=None, split=StationaryTile(cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"],
                                                            cfg.get("ROW_STEPS")))


def _config(plan) -> dict:
    """A stationary plan as the candidate dict that names it."""
    return {"BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "ROW_STEPS": plan.row_steps,
            "num_warps": plan.num_warps}


def _labkit_tiles(n: int, k: int, bits: int = 4) -> list[dict]:
    """labkit's split tile and, where K <= 4096, its whole-K tile at ``[N, K]`` (those that fit), with the row
    steps its rule picks on ``SMS`` SMs."""
    rule = HOPPER.w4_stationary if bits == 4 else HOPPER.w8_stationary
    unit = GROUP if bits == 4 else 4
    plans = [stationary_plan(n, k, unit, replace(rule, whole_k=None), SMS)]
    if k <= rule.whole_k_max_k:
        plans.append(stationary_plan(n, k, unit, replace(rule, whole_k=None,
                                                         split=replace(rule.whole_k, block_k=k)), SMS))
    return [_config(p) for p in plans if p is not None]


def _default_tile(n: int, k: int) -> list[dict]:
    """The tile the int4 wrapper picks at ``[N, K]`` on ``SMS`` SMs (none where no stationary tile fits)."""
    plan = stationary_plan(n, k, GROUP, HOPPER.w4_stationary, SMS)
    return [] if plan is None else [_config(plan)]


def _xs_candidates(n: int, k: int, narrow: bool = False) -> list[dict]:
    """Slices of 512-1024 activations, 8-32 rows per step, 1-32 steps per program; grids of 1-32 programs per SM.
    ``narrow``: only labkit's tile, at a quarter, half, once and twice the row steps its rule picks."""
    if narrow:
        out = []
        for base in _default_tile(n, k):
            rs = base["ROW_STEPS"]
            out += [dict(base, ROW_STEPS=s) for s in (rs // 4, rs // 2, rs, rs * 2)
                    if s >= 1 and n % (base["BLOCK_N"] * s) == 0]
        return out
    out = []
    for bk, bn, w in ((512, 16, 2), (1024, 8, 2), (1024, 16, 4), (512, 32, 4)):
        for steps in (1, 2, 4, 8, 16, 32):
            grid = (k // bk) * (n // (bn * steps))
            if k % bk or n % (bn * steps) or not SMS <= grid <= 32 * SMS:
                continue
            out.append({"BLOCK_N": bn, "BLOCK_K": bk, "ROW_STEPS": steps, "num_warps": w})
    return out


def _xs8_candidates(n: int, k: int) -> list[dict]:
    """The stationary int8 GEMV: labkit's tiles and neighbours of them -- the int4 tiles' bytes per row block or
    twice them, 1-4 warps -- each at the row steps labkit's rule picks and one either side."""
    tiles = [(8, 512, 2), (4, 1024, 2), (16, 512, 2), (16, 512, 4), (2, 2048, 1), (2, 1024, 1)]
    if k <= 4096:
        tiles += [(2, k, 4), (4, k, 4)]
    out = []
    for bn, bk, w in tiles:
        base = stationary_plan(n, k, 4, _rule(8, {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}), SMS)
        if base is None:
            continue
        for steps in (base.row_steps // 2, base.row_steps, base.row_steps * 2):
            if steps >= 1 and n % (bn * steps) == 0:
                out.append(dict(_config(base), ROW_STEPS=steps))
    return out


def _pdl_candidates(n: int, k: int) -> list[dict]:
    """labkit's tile as the wrapper launches it and as a programmatic dependent launch (``PDL``: the next launch
    released at the start, the first weight loads issued before waiting for the kernel ahead), and whole-K programs
    (4 rows a step, 4 warps; the best of a whole-K sweep at a078452) with PDL."""
    out = [t for base in _default_tile(n, k) for t in (base, dict(base, PDL=True))]
    if k <= 4096:
        out += [{"BLOCK_N": 4, "BLOCK_K": k, "ROW_STEPS": s, "num_warps": 4, "PDL": True} for s in (1, 2, 4, 8, 16)
                if n % (4 * s) == 0 and n // (4 * s) >= SMS]
    return out


def _tile_candidates(n: int, k: int) -> list[dict]:
    """Stationary tiles beyond labkit's, all with PDL: 1-2 warps a program with 1024-2048 activations a slice, and
    programs that own the whole of K, each at the row steps that give 2-16 programs per SM."""
    tiles = [(16, 512, 2), (4, 1024, 1), (8, 1024, 1), (8, 1024, 2), (2, 2048, 1), (4, 2048, 1), (4, 2048, 2),
             (1, 4096, 1), (2, 4096, 1), (2, 4096, 2), (4, 4096, 4)]
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "ROW_STEPS": s, "num_warps": w, "PDL": True}
            for bn, bk, w in tiles if k % bk == 0 for s in (1, 2, 4, 8, 16, 32)
            if n % (bn * s) == 0 and 2 <= (k // bk) * (n // (bn * s)) / SMS <= 16]


def _step_candidates(n: int, k: int) -> list[dict]:
    """The split tile and (where K <= 4096) the whole-K tile, each launched plainly and with PDL, and at half and a
    quarter of the rule's row steps (more programs per SM)."""
    out = []
    for base in _labkit_tiles(n, k):
        out += [base, dict(base, PDL=True)]
        out += [dict(base, ROW_STEPS=base["ROW_STEPS"] // d) for d in (2, 4) if base["ROW_STEPS"] // d >= 1]
    return out


def _fused_candidates(n: int, k: int) -> list[dict]:
    """The split tile and (where K <= 4096) the whole-K tile, each plain, with the RMSNorm in its prologue and with
    the residual add in its store (``rel_err`` is against the plain product)."""
    return [dict(base, **fuse) for base in _labkit_tiles(n, k) for fuse in ({}, {"FUSE": "norm"},
                                                                              {"FUSE": "residual"})]


def _split_tile_candidates(n: int, k: int) -> list[dict]:
    """Split tiles around labkit's: 8-32 rows a block, 512-1024 activations a slice, 1-4 warps, at the row steps
    that give 12-32 warps per SM (registers allow ~28)."""
    tiles = [(16, 512, 2), (16, 512, 4), (8, 512, 1), (8, 512, 2), (32, 512, 2), (32, 512, 4), (16, 1024, 2),
             (16, 1024, 4), (8, 1024, 2)]
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "ROW_STEPS": s, "num_warps": w}
            for bn, bk, w in tiles if k % bk == 0 for s in (1, 2, 4, 8, 16)
            if n % (bn * s) == 0 and 12 <= (k // bk) * (n // (bn * s)) * w / SMS <= 32]


XS_EXPERIMENTS = {"pdl": _pdl_candidates, "tiles": _tile_candidates, "step": _step_candidates,
                  "fused": _fused_candidates, "splittiles": _split_tile_candidates}
AFTER_A_WRITER = ("step", "fused", "splittiles")


def _candidates(tiles, n: int, k: int, kind: str) -> list[dict]:
    """The split-K GEMV: every tile x split x load pipeline (int4: also prefetched a step ahead)."""
    out = []
    for bn, bk, w in tiles:
        if kind != "w8" and bk < GROUP:
            continue
        for sp in SPLITS:
            if sp > 1 and (k / sp / bk < 1 or triton.cdiv(n, bn) * sp > 8 * SMS):
                continue
            base = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": w}
            out += [dict(base, LOAD_STAGES=st) for st in STAGES]
            if kind == "w4":
                out.append(dict(base, LOAD_STAGES=1, PREFETCH=True))
    return out


# --- launches ---------------------------------------------------------------------------------------------------
_FUSED_INPUTS: dict = {}


def _fused_input(key: tuple, make):
    """A fused variant's extra input, made on the first (eager) call only: made inside a captured launch, its
    fill or RNG kernel would be timed with the GEMV (as at 4895153 and bdcfbc2: records gemv_study_fused_*)."""
    if key not in _FUSED_INPUTS:
        _FUSED_INPUTS[key] = make()
    return _FUSED_INPUTS[key]


def launch_xs(kind: str, x, w: tuple, n: int, k: int, cfg: dict):
    """The stationary GEMV (``w4xs``: ``w4a16_matmul``; ``w8xs``: ``w8a16_matmul`` with a neighbour, its launcher
    ``w8_gemv_xs`` for a bare product, which ``w8a16_matmul`` gives the split-K GEMV) on one row
    ``x`` with the tile ``cfg`` as tuning data (``PDL``: ``pdl="overlap"``; ``FUSE``: ``"norm"``, an RMSNorm weight of
    ones, or ``"residual"``, a residual row)."""
    cfg = dict(cfg)
    fuse, pdl = cfg.pop("FUSE", None), "overlap" if cfg.pop("PDL", False) else ""
    bits = 4 if kind == "w4xs" else 8
    rule = _rule(bits, cfg)
    plan = stationary_plan(n, k, GROUP if bits == 4 else 4, rule, SMS)
    if plan is None:
        raise ValueError(f"no whole stationary tiles of {cfg} in N={n}, K={k}")
    tuning = replace(HOPPER, **{"w4_stationary" if bits == 4 else "w8_stationary": rule})
    extra = {}
    if fuse == "norm":
        extra["norm_weight"] = _fused_input(("norm", k), lambda: torch.ones(k, device=x.device, dtype=x.dtype))
    elif fuse == "residual":
        extra["residual"] = _fused_input(("res", n), lambda: torch.randn(1, n, device=x.device, dtype=x.dtype))
    if bits == 4:
        return w4a16_matmul(x, *w, GROUP, pdl=pdl, tuning=tuning, **extra)
    if extra or pdl:
        return w8a16_matmul(x, *w, pdl=pdl, tuning=tuning, **extra)
    return w8_gemv_xs(x.reshape(1, k), w[0].view(torch.int32), w[1], plan)


def launch_splitk(kind: str, x, w: tuple, n: int, k: int, cfg: dict | None):
    """The split-K GEMV with the fixed tile ``cfg`` (None: the autotuner's pick) -- always the split-K kernel, also
    where the public wrapper would take the stationary one."""
    tile = None if cfg is None else SplitKTile(cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"], cfg["LOAD_STAGES"],
                                               cfg.get("PREFETCH", False), cfg["num_warps"])
    if kind == "w8":
        return splitk.splitk_gemv(x, n, 8, (w[0].view(torch.uint8), w[1]), (k, 0xFF, 0xFF00),
                                  {"WORDS_ALIGNED": True}, tile)
    return splitk.splitk_gemv(x, n, 4, (w[0].view(torch.int32), w[1], w[2]), (k // 8, k // GROUP, k // GROUP,
                                                                             0x4F000000),
                              {"GROUP": GROUP, "HALF_MATH": 1 if x.device.type == "cuda" else 2}, tile)


def _launcher(kind: str, x, ws, n: int, k: int, cfg: dict | None):
    """A function of one weight set that launches ``kind`` once (``cfg``: a fixed candidate; None: the autotuner's
    pick, or cuBLAS for bf16)."""
    if kind == "bf16":
        return lambda w: F.linear(x, w[0])
    if kind in ("w4xs", "w8xs"):
        return lambda w: launch_xs(kind, x, w, n, k, cfg)
    if kind == "read":
        programs = triton.cdiv(ws[0][0].numel(), cfg["BLOCK"] * cfg["ITERS"])
        sums = torch.empty(programs, device=x.device, dtype=torch.int32)
        return lambda w: stream_read(w[0], cfg["BLOCK"], cfg["ITERS"], cfg["num_warps"], out=sums)
    if kind == "w8" and cfg is None:
        return lambda w: w8a16_matmul(x, *w)
    return lambda w: launch_splitk(kind, x, w, n, k, cfg)


def graph_us(launch, sets: list, reps: int = 10) -> list[float]:
    """Per-launch microseconds of ``launch(w)`` cycling over ``sets`` inside one CUDA graph (>= 32 launches),
    one sample per replay."""
    per = max(1, math.ceil(32 / len(sets)))
    return [ms * 1e3 / len(sets) for ms in graph_replay_ms(lambda: [launch(w) for w in sets], per, reps)]


def copy_bandwidth(dev) -> float:
    """The notebooks' ceiling (``labkit.hardware.measure_copy_bandwidth``), after ~0.3 s of copies: an idle GPU
    starts at low clocks."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(300):
        b.copy_(a)
    del a, b
    return measure_copy_bandwidth(dev)


def _copies(nbytes: int) -> int:
    return max(2, min(64, math.ceil(ROTATE_BYTES / nbytes)))


def _weights(kind: str, n: int, k: int, copies: int, dev) -> list[tuple]:
    """Random quantised weights (every bit pattern of the codes is valid), ``copies`` independent sets."""
    out = []
    for _ in range(copies):
        if kind in ("w8", "w8xs"):
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
            out.append((q, torch.rand(n, device=dev, dtype=torch.bfloat16) * 0.01 + 1e-3))
        elif kind == "read":
            out.append((torch.randint(-2**31, 2**31 - 1, (_nbytes(kind, n, k) // 4,), dtype=torch.int32,
                                      device=dev),))
        elif kind in ("w4", "w4xs"):
            p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
            s = torch.rand(n, k // GROUP, device=dev, dtype=torch.bfloat16) * 0.01 + 1e-3
            out.append((p, s, torch.rand_like(s) * 15))
        else:
            out.append((torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,))
    return out


def _nbytes(kind: str, n: int, k: int) -> int:
    w4 = n * k // 2 + 4 * n * k // GROUP
    return {"w8": n * k + 2 * n, "w8xs": n * k + 2 * n, "w4": w4, "w4xs": w4, "read": w4, "bf16": 2 * n * k}[kind]


def _dequant(kind: str, w: tuple) -> torch.Tensor:
    if kind in ("w8", "w8xs"):
        return dequantize_int8(w[0], w[1], torch.float32)
    if kind in ("w4", "w4xs"):
        return dequantize_int4(w[0], w[1].float(), w[2].float(), GROUP)
    return w[0].float()


def _todo(kind: str, n: int, k: int, baseline_only: bool, experiments: str | None) -> list:
    """The candidates of ``kind`` at ``[N, K]`` (None: the autotuner's pick or cuBLAS)."""
    if kind == "w4" and baseline_only:  # the split-K kernel's best at these shapes (e66a969's sweep)
        return [{"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": sp, "LOAD_STAGES": 1, "num_warps": 2} for sp in (1, 4)] + [
            {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "LOAD_STAGES": 1, "num_warps": 4}]
    if kind == "w8xs":
        return _xs8_candidates(n, k)
    if kind == "read":
        return _read_candidates(n, k)
    if kind == "w8" and baseline_only:  # the autotuner's pick only, as a step runs it
        return [None]
    if kind == "w4xs":
        return XS_EXPERIMENTS[experiments](n, k) if experiments else _xs_candidates(n, k, narrow=baseline_only)
    return [None] + ([] if kind == "bf16" else _candidates(W8_TILES if kind == "w8" else W4_TILES, n, k, kind))


def sweep(shapes: dict, dev, out: str | None = None, kinds=("bf16", "w8", "w4"), baseline_only: bool = False,
          experiments: str | None = None) -> dict:
    """Time every candidate of every shape; with ``out``, rewrite the record after each shape (a run cut short
    keeps what it finished)."""
    bw = copy_bandwidth(dev)
    empty_out = torch.empty(1, device=dev, dtype=torch.int32)
    empty = graph_us(lambda w: _empty[(1,)](empty_out), [None] * 32)
    rows = []
    for name, (n, k) in shapes.items():
        xk = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        for kind in kinds:
            nbytes = _nbytes(kind, n, k)
            sets = _weights(kind, n, k, _copies(nbytes), dev)
            ref = None if kind == "read" else F.linear(xk.float(), _dequant(kind, sets[0]))
            for cfg in tqdm(_todo(kind, n, k, baseline_only, experiments), desc=f"{name} {kind}", mininterval=5):
                launch = _launcher(kind, xk, sets, n, k, cfg)
                try:
                    if kind == "read":  # every word read: the programs' XORs give the whole buffer's
                        err = float(stream_read_ref(launch(sets[0])) != stream_read_ref(sets[0][0]))
                    else:
                        got = launch(sets[0]).float()
                        err = ((got - ref).norm() / ref.norm()).item()
                    if experiments in AFTER_A_WRITER and kind == "w4xs":  # a kernel that writes the activations
                        src = xk.clone()
                        t = graph_us(lambda w, f=launch, a=src, b=xk: (torch.mul(a, 1.0, out=b), f(w)), sets)
                    else:
                        t = graph_us(launch, sets)
                    cold = cold_l2_bench(lambda f=launch, w=sets[0]: f(w), (0.5,))[0] * 1e3
                except Exception as e:  # a candidate that does not compile or launch is recorded, not fatal
                    rows.append({"shape": name, "N": n, "K": k, "kind": kind, "config": cfg, "error": str(e)[:200]})
                    continue
                med = sorted(t)[len(t) // 2]
                rows.append({"shape": name, "N": n, "K": k, "kind": kind, "config": cfg or "wrapper",
                             "autotuned": _picked(kind) if cfg is None and kind != "bf16" else None, "us": t,
                             "median_us": med, "cold_l2_us": cold, "bytes": nbytes,
                             "bw_frac": nbytes / (med * 1e-6) / bw, "rel_err": err})
            del sets
            torch.cuda.empty_cache()
        data = {"copy_bw_bytes_per_s": bw, "empty_kernel_graph_us": empty, "rotate_bytes": ROTATE_BYTES,
                "rows": rows}
        if out:
            print("wrote", write_record("gemv_study", data, out_dir=out), flush=True)
    return data


def _picked(kind: str):
    tuned = splitk._w8_gemv_tuned if kind == "w8" else splitk._w4_gemv_tuned
    best = getattr(tuned, "best_config", None)
    return None if best is None else dict(best.kwargs, num_warps=best.num_warps)


def summarise(data: dict) -> None:
    bw = data["copy_bw_bytes_per_s"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; empty kernel in a graph "
          f"{sorted(data['empty_kernel_graph_us'])[5]:.2f} us/launch")
    by: dict = {}
    for r in data["rows"]:
        if "median_us" in r:
            by.setdefault((r["shape"], r["kind"]), []).append(r)
    print(f"{'shape':<11}{'kind':<6}{'floor us':>9}{'wrapper':>9}{'best':>8}  best config")
    for (shape, kind), rs in by.items():
        floor = rs[0]["bytes"] / bw * 1e6
        wrap = next((r for r in rs if r["config"] == "wrapper"), None)
        best = min([r for r in rs if r["config"] != "wrapper"] or rs, key=lambda r: r["median_us"])
        cfg = best["config"] if isinstance(best["config"], str) else " ".join(f"{v}" for v in best["config"].values())
        print(f"{shape:<11}{kind:<6}{floor:9.2f}{wrap['median_us'] if wrap else float('nan'):9.2f}"
              f"{best['median_us']:8.2f}  {cfg}  (autotuner: {wrap and wrap.get('autotuned')})")


def run_best(path: str, dev) -> None:
    """Launch each shape's best candidate twice (for a profiler such as ncu to catch)."""
    best = {}
    for r in json.loads(Path(path).read_text())["data"]["rows"]:
        if isinstance(r.get("config"), dict) and "median_us" in r and r["rel_err"] < 0.01:  # real sums only
            key = (r["shape"], r["kind"])
            if key not in best or r["median_us"] < best[key]["median_us"]:
                best[key] = r
    for (shape, kind), r in best.items():
        n, k = r["N"], r["K"]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        sets = _weights(kind, n, k, 2, dev)
        launch = _launcher(kind, x, sets, n, k, r["config"])
        for w in sets:
            launch(w)
        torch.cuda.synchronize()
        print(shape, kind, r["config"], f"{r['median_us']:.2f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for records/gemv_study.json")
    ap.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES)[:5])
    ap.add_argument("--kinds", nargs="+", choices=("bf16", "w8", "w4", "w4xs", "w8xs", "read"),
                    default=("bf16", "w8", "w4"))
    ap.add_argument("--baseline-only", action="store_true",
                    help="w4: only the split-K kernel's best configs; w4xs: labkit's tile around its row-step rule; "
                         "w8: only the autotuner's pick")
    ap.add_argument("--experiments", nargs="?", const="pdl", choices=tuple(XS_EXPERIMENTS),
                    help="w4xs candidates: " + ", ".join(XS_EXPERIMENTS) + " (see the module docstring)")
    ap.add_argument("--best", help="a gemv_study.json: launch each shape's best candidate (for ncu)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_study needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if args.best:
        run_best(args.best, dev)
        return 0
    summarise(sweep({s: SHAPES[s] for s in args.shapes}, dev, args.out, args.kinds, args.baseline_only,
                    args.experiments))
    return 0


if __name__ == "__main__":
    sys.exit(main())
