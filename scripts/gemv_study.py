"""Every GEMV tile, split and load-pipeline candidate timed the way a decode step runs it, at the 8B shapes.

The autotuner times each candidate once, alone, with ``do_bench`` (an L2 flush that leaves the cache full of dirty
lines before every call); a decode step runs the GEMVs back to back inside a CUDA graph, each on weights that are
not in L2. This times every candidate that way: a graph of launches that cycle through enough copies of the
weights to exceed L2 several times, replayed, per launch. Beside them: cuBLAS at bf16 on the same shape and the
same rotation, and an empty Triton kernel (what one graph node costs before any work).

    python scripts/gemv_study.py --out /tmp/h200            # sweep: records/gemv_study.json
    python scripts/gemv_study.py --best /tmp/h200/records/gemv_study.json   # each shape's best, once (for ncu)
    python scripts/gemv_study.py --kinds w8 w8xs --experiments step --out /tmp/h200   # int8: split-K vs stationary
    python scripts/gemv_study.py --kinds read w4xs --baseline-only --out /tmp/h200   # int4 against a bare read

``read`` times a kernel that only reads as many bytes as the int4 weights (and XORs them, so nothing is
optimised away): the floor a kernel of that size reaches on this machine, launch and tail included, which the
copy bandwidth of a large buffer overstates.

Prints, per shape and kernel, the best candidate and the autotuner's pick, in us and as a fraction of the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from labkit.bench import write_record  # noqa: E402
from labkit.hardware import measure_copy_bandwidth  # noqa: E402
from labkit.kernels import quantized_matmul as qm  # noqa: E402
from labkit.kernels.common import cold_l2_bench, graph_replay_ms  # noqa: E402
from labkit.kernels.stream_read import READ_TILES, stream_read, stream_read_ref  # noqa: E402

# (N, K) of the 8B decode step's linears: the engine merges q/k/v and gate/up; Hugging Face's model does not
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "gate_or_up": (14336, 4096), "k_or_v": (1024, 4096)}
GROUP = 128
ROTATE_BYTES = 400e6  # > 8x the H200's 50 MB L2
# the autotuners' tiles (int8: and a few more around them) (BLOCK_N, BLOCK_K, warps); the int4 tiles around
# qm.W4_TILES were swept in records/gemv_study_w4_4c16124.json, as was a register prefetch (no gain)
W8_TILES = tuple(dict.fromkeys(qm.W8_TILES + ((128, 64, 4), (64, 128, 4), (32, 512, 8), (128, 128, 4))))
W4_TILES = qm.W4_TILES
SPLITS = (1, 2, 4, 8, 16)
STAGES = (1, 3)
MAXNREG = (64, 96)  # register caps for the int4 kernels (ncu: ~128 registers, 4 warps per scheduler, before)


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0)


def _read_candidates(n: int, k: int) -> list[dict]:
    """``stream_read`` over the int4 weights' bytes: the blocks and warps of its ``READ_TILES`` (2-8 KB a step),
    1-8 steps a program (all of a program's loads in flight at once: the loop is unrolled)."""
    return [{"BLOCK": b, "ITERS": it, "num_warps": w} for b, _, w in READ_TILES for it in (1, 2, 4, 8)]


_FUSED_INPUTS: dict = {}


def _fused_input(key: tuple, make):
    """A fused variant's extra input, made on the first (eager) call only: made inside a captured launch, its
    fill or RNG kernel would be timed with the GEMV (as at 4895153 and bdcfbc2: records gemv_study_fused_*)."""
    if key not in _FUSED_INPUTS:
        _FUSED_INPUTS[key] = make()
    return _FUSED_INPUTS[key]


def launch_w4_xs(x, w: tuple, n: int, k: int, cfg: dict):
    """``qm.w4_gemv_xs`` (stationary activations) on one row ``x`` and weights ``w = (packed, scales, zeros)``
    with the tile ``cfg`` (whole tiles only); the wrapper allocates its output, as in a decode step. ``cfg["FUSE"]``
    (``--experiments fused``): ``"norm"``, the GEMV normalises ``x`` first (an RMSNorm weight of ones); ``"residual"``,
    it adds a residual row to its output."""
    cfg = dict(cfg)
    fuse = cfg.pop("FUSE", None)
    tile = qm.xs_tile(n, k, GROUP, x.device, cfg)
    if tile is None:
        raise ValueError(f"no whole x-stationary tiles of {cfg} in N={n}, K={k}")
    extra = {}
    if fuse == "norm":
        extra["norm"] = (_fused_input(("norm", k), lambda: torch.ones(k, device=x.device, dtype=x.dtype)), 1e-5)
    elif fuse == "residual":
        extra["residual"] = _fused_input(("res", n), lambda: torch.randn(1, n, device=x.device, dtype=x.dtype))
    return qm.w4_gemv_xs(x, w[0].view(torch.int32), w[1], w[2], GROUP, tile, **extra)


def launch_w8_xs(x, w: tuple, n: int, k: int, cfg: dict):
    """``qm.w8_gemv_xs`` (the stationary int8 GEMV) on one row ``x`` and weights ``w = (qweight, scale)`` with the
    tile ``cfg`` (whole tiles only)."""
    tile = qm.xs_tile(n, k, 4, x.device, cfg, bits=8)
    if tile is None:
        raise ValueError(f"no whole x-stationary tiles of {cfg} in N={n}, K={k}")
    return qm.w8_gemv_xs(x, w[0].view(torch.int32), w[1], tile)


def _xs8_candidates(n: int, k: int) -> list[dict]:
    """The stationary int8 GEMV (``w8xs``, untimed before this): labkit's tiles (``XS8_TILE``, and
    ``XS8_WHOLE_K_TILE`` where K <= 4096) and neighbours of them -- the int4 tiles' bytes per row block or twice
    them, 1-4 warps, and the float32 path (``HALF_MATH`` 0) of labkit's tile -- each at the row steps labkit's rule
    picks and one either side. One-warp programs have fewer threads per row to reduce across: sm_90 code at 2 x
    2048 needs 2.9 loop instructions per weight, 8 x 512 on 2 warps 3.3 (``scripts/sass_report.py --kernel w8xs``)."""
    tiles = [dict(qm.XS8_TILE), dict(qm.XS8_TILE, HALF_MATH=0), dict(qm.XS8_TILE, BLOCK_N=4, BLOCK_K=1024),
             dict(qm.XS8_TILE, BLOCK_N=16), dict(qm.XS8_TILE, BLOCK_N=16, num_warps=4),
             dict(qm.XS8_TILE, BLOCK_N=2, BLOCK_K=2048, num_warps=1),
             dict(qm.XS8_TILE, BLOCK_N=2, BLOCK_K=1024, num_warps=1)]
    if k <= 4096:
        tiles += [dict(qm.XS8_WHOLE_K_TILE, BLOCK_K=k), dict(qm.XS8_WHOLE_K_TILE, BLOCK_N=4, BLOCK_K=k)]
    out = []
    for t in tiles:
        base = qm.xs_tile(n, k, 4, torch.device("cuda"), t, bits=8)
        if base is None:
            continue
        for steps in (base["ROW_STEPS"] // 2, base["ROW_STEPS"], base["ROW_STEPS"] * 2):
            if steps >= 1 and n % (base["BLOCK_N"] * steps) == 0:
                out.append(dict(_launch_config(base), ROW_STEPS=steps, **({"HALF_MATH": 0} if "HALF_MATH" in t
                                                                           else {})))
    return out


def _xs_candidates(n: int, k: int, narrow: bool = False) -> list[dict]:
    """Slices of 512-1024 activations, 8-32 rows per step, 1-32 steps per program, the next step prefetched;
    grids of 1-32 programs per SM of 132. (At ded9987 and 2748180 prefetching gained 7-20%, two steps ahead
    nothing more, and the best grids had 5.8-7.8 programs per SM: records/gemv_study_xs_2748180.json.)
    ``narrow``: only labkit's tile, with the row steps its rule picks and one either side, each with the first
    row block's loads issued before (``WEIGHTS_FIRST``) or after the slice's preparation."""
    if narrow:
        base = qm.xs_tile(n, k, GROUP, torch.device("cuda"))
        if base is None:
            return []
        # a quarter of the rule's row steps: ~4x its programs, 22-44 warps per SM, resident since the 2-D weight
        # loads (68-80 registers under Triton 3.6, was 128: at most 16 warps per SM before)
        steps = [s for s in (base["ROW_STEPS"] // 4, base["ROW_STEPS"] // 2, base["ROW_STEPS"], base["ROW_STEPS"] * 2)
                 if s >= 1 and n % (base["BLOCK_N"] * s) == 0]
        return [{"BLOCK_N": base["BLOCK_N"], "BLOCK_K": base["BLOCK_K"], "ROW_STEPS": st, "PREFETCH": 1,
                 "num_warps": base["num_warps"], "WEIGHTS_FIRST": wf} for st in steps for wf in (False, True)]
    out = []
    for bk, bn, w in ((512, 16, 2), (1024, 8, 2), (1024, 16, 4), (512, 32, 4)):
        for steps in (1, 2, 4, 8, 16, 32):
            grid = (k // bk) * (n // (bn * steps))
            if k % bk or n % (bn * steps) or not 132 <= grid <= 32 * 132:
                continue
            out.append({"BLOCK_N": bn, "BLOCK_K": bk, "ROW_STEPS": steps, "PREFETCH": 1, "num_warps": w})
    return out


def _launch_config(tile: dict) -> dict:
    """An ``xs_tile`` result reduced to the keys a candidate names (the rest ``xs_tile`` derives again)."""
    return {key: tile[key] for key in ("BLOCK_N", "BLOCK_K", "ROW_STEPS", "PREFETCH", "WEIGHTS_FIRST", "num_warps",
                                       "PAIR_WORDS") if key in tile}


def _xs_experiments(n: int, k: int) -> list[dict]:
    """labkit's tile as the wrapper launches it, then with programmatic dependent launch (``PDL``: the next
    launch released at the start, the first weight loads issued before waiting for the kernel ahead; at 0a9fcfd
    and b39937c the wrapper used it under capture), without the last slice's reduction (``REDUCE`` False: wrong
    sums, for the time the reduction's tail costs), and whole-K programs (4 rows a step, 4 warps; the best of a
    whole-K sweep at a078452) with PDL."""
    base = qm.xs_tile(n, k, GROUP, torch.device("cuda"))
    if base is None:
        return []
    base = _launch_config(base)
    out = [base, dict(base, PDL=True), dict(base, PDL=True, REDUCE=False)]
    if k <= 4096:
        for steps in (1, 2, 4, 8, 16):
            if n % (4 * steps) == 0 and n // (4 * steps) >= 132:
                out.append({"BLOCK_N": 4, "BLOCK_K": k, "ROW_STEPS": steps, "PREFETCH": 1, "WEIGHTS_FIRST": True,
                            "num_warps": 4, "PDL": True})
    return out


def _split_and_whole_tiles(n: int, k: int) -> list[dict]:
    """labkit's split tile and, where K <= 4096, its whole-K tile at ``[N, K]`` (those that fit)."""
    tiles = [qm.xs_tile(n, k, GROUP, torch.device("cuda"), qm.XS_TILE),
             qm.xs_tile(n, k, GROUP, torch.device("cuda"), dict(qm.XS_WHOLE_K_TILE, BLOCK_K=k)) if k <= 4096 else None]
    return [t for t in tiles if t is not None]


def _step_candidates(n: int, k: int) -> list[dict]:
    """The split tile and (where K <= 4096) the whole-K tile, each launched plainly and with PDL: for
    ``--experiments step``, where every GEMV follows a small kernel that writes its activations, as in a decode
    step (an RMSNorm before qkv and gate_up, attention before o, SwiGLU before down)."""
    out = []
    for t in _split_and_whole_tiles(n, k):
        base = _launch_config(t)
        if base not in out:
            out += [base, dict(base, PDL=True)]
            # and more programs: half and a quarter of the rule's row steps (more warps per SM than the 16 that
            # 128 registers allowed before the 2-D weight loads)
            out += [dict(base, ROW_STEPS=base["ROW_STEPS"] // d) for d in (2, 4) if base["ROW_STEPS"] // d >= 1]
    return out


def _pair_candidates(n: int, k: int) -> list[dict]:
    """The split tile and (where K <= 4096) the whole-K tile at the rule's row steps and half of them, each with
    and without ``PAIR_WORDS`` (two words' products in the same float16 lanes: 2.72 -> 2.42 loop instructions
    per weight on sm_90, results/cpu/records/sass_xs_pair_words.json), after a kernel that writes the activations:
    for ``--experiments pairs``."""
    out = []
    for t in _split_and_whole_tiles(n, k):
        base = _launch_config(t)
        for steps in dict.fromkeys((base["ROW_STEPS"], max(1, base["ROW_STEPS"] // 2))):
            out += [dict(base, ROW_STEPS=steps, PAIR_WORDS=pair) for pair in (False, True)]
    return out


def _tagged_candidates(n: int, k: int) -> list[dict]:
    """labkit's split tile with the counted reduction (its default), with ``TAGGED`` (the last slice of each row
    chunk waits for its peers' partials: no fence, no counter, one memory round trip instead of three) and with
    no reduction at all (``REDUCE`` False: wrong sums, the floor any reduction can reach), and ``TAGGED`` with the
    loads pipelined (``LOOP_STAGES`` 3, the ``stages`` experiment's middle); then the whole-K tile where K <= 4096
    (no reduction to make). Each after a kernel that writes the activations: for ``--experiments tagged``."""
    tiles = _split_and_whole_tiles(n, k)
    split = _launch_config(tiles[0])
    return [split, dict(split, TAGGED=True), dict(split, REDUCE=False),
            dict(split, TAGGED=True, PREFETCH=0, LOOP_STAGES=3)] + [_launch_config(t) for t in tiles[1:]]


def _stage_candidates(n: int, k: int) -> list[dict]:
    """labkit's split and whole-K tiles as they are (the next row block's loads in registers), then with the
    loads left to Triton's pipeliner (``PREFETCH`` 0, ``LOOP_STAGES`` 2-4: up to three blocks in flight through
    shared memory, fewer registers), at half, once and twice the rule's row steps; and the whole-K tile with the
    RMSNorm inside, as it is and at 3 stages (96 registers -> 64 on sm_90, which may let qkv take it): for
    ``--experiments stages``, each after a kernel that writes the activations."""
    out = []
    for t in _split_and_whole_tiles(n, k):
        base = _launch_config(t)
        out.append(base)
        rs = base["ROW_STEPS"]
        for steps in dict.fromkeys((max(1, rs // 2), rs, 2 * rs)):
            if n % (base["BLOCK_N"] * steps) == 0:
                out += [dict(base, ROW_STEPS=steps, PREFETCH=0, LOOP_STAGES=st) for st in (2, 3, 4)]
        if base["BLOCK_K"] == k:
            out += [dict(base, FUSE="norm"), dict(base, FUSE="norm", PREFETCH=0, LOOP_STAGES=3)]
    return out


def _pair_tile_candidates(n: int, k: int) -> list[dict]:
    """Split tiles around labkit's, all with ``PAIR_WORDS`` (fewer instructions per weight may move the best tile
    or warps per SM): 8-32 rows a block, 512-1024 activations a slice, 1-4 warps, at the row steps that give 12-32
    warps per SM of 132 (registers allow ~28), each after a kernel that writes the activations: for
    ``--experiments pairtiles``."""
    tiles = [(16, 512, 2), (16, 512, 4), (8, 512, 1), (8, 512, 2), (32, 512, 2), (32, 512, 4), (16, 1024, 2),
             (16, 1024, 4), (8, 1024, 2)]
    out = []
    for bn, bk, w in tiles:
        if k % bk:
            continue
        for steps in (1, 2, 4, 8, 16):
            per_sm = (k // bk) * (n // (bn * steps)) * w / 132
            if n % (bn * steps) == 0 and 12 <= per_sm <= 32:
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "ROW_STEPS": steps, "PREFETCH": 1, "WEIGHTS_FIRST": True,
                            "num_warps": w, "PAIR_WORDS": True})
    return out


def _fused_candidates(n: int, k: int) -> list[dict]:
    """The split tile and (where K <= 4096) the whole-K tile, each plain, with the RMSNorm in its prologue and with
    the residual add in its store: for ``--experiments fused``,
    each GEMV after a kernel that writes its activations, as in a decode step (``rel_err`` is against the plain
    product)."""
    return [dict(_launch_config(t), **fuse) for t in _split_and_whole_tiles(n, k)
            for fuse in ({}, {"FUSE": "norm"}, {"FUSE": "residual"})]


def _tile_candidates(n: int, k: int) -> list[dict]:
    """Stationary tiles beyond labkit's, all with PDL and the first loads early: 1-2 warps a
    program with 1024-2048 activations a slice, and programs that own the whole of K (no cross-program reduction;
    1 warp: no cross-warp reduction either), each at the row steps that give 2-16 programs per SM of 132."""
    tiles = [(16, 512, 2), (4, 1024, 1), (8, 1024, 1), (8, 1024, 2), (2, 2048, 1), (4, 2048, 1), (4, 2048, 2),
             (1, 4096, 1), (2, 4096, 1), (2, 4096, 2), (4, 4096, 4)]
    out = []
    for bn, bk, w in tiles:
        if k % bk:
            continue
        for steps in (1, 2, 4, 8, 16, 32):
            per_sm = (k // bk) * (n // (bn * steps)) / 132
            if n % (bn * steps) == 0 and 2 <= per_sm <= 16:
                out.append({"BLOCK_N": bn, "BLOCK_K": bk, "ROW_STEPS": steps, "PREFETCH": 1, "WEIGHTS_FIRST": True,
                            "num_warps": w, "PDL": True})
    return out


def _tagged8_candidates() -> list[dict]:
    """labkit's int8 split tile counted, ``TAGGED`` and unreduced: for ``--kinds w8xs --experiments tagged``."""
    return [dict(qm.XS8_TILE), dict(qm.XS8_TILE, TAGGED=True), dict(qm.XS8_TILE, REDUCE=False)]


# w4xs candidates of each --experiments value, and those timed after a kernel that writes their activations
XS_EXPERIMENTS = {"pdl": _xs_experiments, "tiles": _tile_candidates, "step": _step_candidates,
                  "fused": _fused_candidates, "pairs": _pair_candidates, "pairtiles": _pair_tile_candidates,
                  "tagged": _tagged_candidates, "stages": _stage_candidates}
AFTER_A_WRITER = ("step", "fused", "pairs", "pairtiles", "tagged", "stages")


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


def _launcher(kind: str, x, ws, n: int, k: int, cfg: dict | None):
    """A function of one weight set that launches ``kind`` once (``cfg``: a fixed candidate; None: the public
    wrapper, i.e. the autotuner's pick, or cuBLAS for bf16)."""
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    wsb, cnt = qm._split_buffers(x.device, n)
    if kind == "bf16":
        return lambda w: F.linear(x, w[0])
    if kind == "w4xs":
        return lambda w: launch_w4_xs(x, w, n, k, cfg)
    if kind == "read":
        words = ws[0][0].numel()
        programs = triton.cdiv(words, cfg["BLOCK"] * cfg["ITERS"])
        sums = torch.empty(programs, device=x.device, dtype=torch.int32)
        return lambda w: stream_read(w[0], cfg["BLOCK"], cfg["ITERS"], cfg["num_warps"], out=sums)
    if kind == "w8xs":
        return lambda w: launch_w8_xs(x, w, n, k, cfg)
    if cfg is None:
        if kind == "w8":
            return lambda w: qm.w8a16_matmul(x, *w)
        return lambda w: qm.w4a16_matmul(x, *w, GROUP)
    meta = {key: cfg[key] for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "LOAD_STAGES", "PREFETCH") if key in cfg}
    opts = {"num_warps": cfg["num_warps"], "num_stages": 1}
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    grid = (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])
    even = qm._even(dict(meta, N=n, K=k))
    if kind == "w8":
        def launch(w):
            qm._w8_gemv[grid](x, w[0].view(torch.uint8), w[1], out, wsb, cnt, n, k, k, 0xFF, 0xFF00, **meta,
                              WORDS_ALIGNED=True, EVEN=even, **opts)
            return out
    else:
        def launch(w):
            qm._w4_gemv[grid](x, w[0].view(torch.int32), w[1], w[2], out, wsb, cnt, n, k, k // 8, k // GROUP,
                              k // GROUP, 0x4F000000, GROUP=GROUP, **meta, EVEN=even, HALF_MATH=1, **opts)
            return out
    return launch


def graph_us(launch, sets: list, reps: int = 10) -> list[float]:
    """Per-launch microseconds of ``launch(w)`` cycling over ``sets`` inside one CUDA graph (>= 32 launches),
    one sample per replay."""
    per = max(1, math.ceil(32 / len(sets)))
    return [ms * 1e3 / len(sets) for ms in graph_replay_ms(lambda: [launch(w) for w in sets], per, reps)]


def _candidates(tiles, n: int, k: int, kind: str) -> list[dict]:
    """Every tile x split x load pipeline; the int4 kernels also with plain loads under each register cap
    (``maxnreg``: more warps per SM if the code fits)."""
    out = []
    for bn, bk, w in tiles:
        if kind != "w8" and bk < GROUP:
            continue
        for sp in SPLITS:
            steps = k / sp / bk
            if sp > 1 and (steps < 1 or triton.cdiv(n, bn) * sp > 8 * 132):
                continue
            base = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sp, "num_warps": w} | (
                {"PREFETCH": False} if kind == "w4" else {})
            out += [dict(base, LOAD_STAGES=st) for st in STAGES]
            if kind != "w8":
                out += [dict(base, LOAD_STAGES=1, maxnreg=r) for r in MAXNREG]
    return out


def copy_bandwidth(dev) -> float:
    """The notebooks' ceiling (``labkit.hardware.measure_copy_bandwidth``: 2 GiB float32 copies timed with events,
    bytes read + written), after ~0.3 s of copies: an idle GPU starts at low clocks. (Timed as graph replays of
    2 GiB uint8 copies, as this script did up to e66a969, it read 2.7 TB/s on the H200, where the notebooks'
    ceiling and a copy of RMSNorm's 268 MB read 4.2-4.3.)"""
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(300):
        b.copy_(a)
    del a, b
    return measure_copy_bandwidth(dev)


def sweep(shapes: dict, dev, out: str | None = None, kinds=("bf16", "w8", "w4"), baseline_only: bool = False,
          experiments: str | None = None) -> dict:
    """Time every candidate of every shape; with ``out``, rewrite the record after each shape (a run cut short
    keeps what it finished)."""
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    bw = copy_bandwidth(dev)
    empty_out = torch.empty(1, device=dev, dtype=torch.int32)
    empty = graph_us(lambda w: _empty[(1,)](empty_out), [None] * 32)
    rows = []
    for name, (n, k) in shapes.items():
        xk = torch.randn(1, k, device=dev, dtype=torch.bfloat16) if k != x.shape[1] else x
        for kind in kinds:
            nbytes = _nbytes(kind, n, k)
            sets = _weights(kind, n, k, _copies(nbytes), dev)
            qm._split_buffers(dev, n)
            ref = None if kind == "read" else F.linear(xk.float(), _dequant(kind, sets[0], n, k))
            if kind == "w4" and baseline_only:  # the in-register kernel's best at these shapes (e66a969's sweep)
                todo = [{"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": sp, "LOAD_STAGES": 1, "PREFETCH": False,
                         "num_warps": 2} for sp in (1, 4)] + [
                        {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "LOAD_STAGES": 1, "PREFETCH": False,
                         "num_warps": 4}]
            elif kind == "w8xs" and experiments == "tagged":
                todo = _tagged8_candidates()
            elif kind == "w8xs":
                todo = _xs8_candidates(n, k)
            elif kind == "read":
                todo = _read_candidates(n, k)
            elif kind == "w8" and baseline_only:  # the autotuner's pick only (the wrapper), as a step runs it
                todo = [None]
            elif kind == "w4xs" and experiments:
                todo = XS_EXPERIMENTS[experiments](n, k)
            elif kind == "w4xs":
                todo = _xs_candidates(n, k, narrow=baseline_only)
            else:
                todo = [None] + ([] if kind == "bf16" else
                                 _candidates(W8_TILES if kind == "w8" else W4_TILES, n, k, kind))
            for cfg in tqdm(todo, desc=f"{name} {kind}", mininterval=5):
                launch = _launcher(kind, xk, sets, n, k, cfg)
                try:
                    if kind == "read":  # every word read: the programs' XORs give the whole buffer's
                        err = float(stream_read_ref(launch(sets[0])) != stream_read_ref(sets[0][0]))
                    else:
                        got = launch(sets[0]).float()
                        err = ((got - ref).norm() / ref.norm()).item()
                    # a kernel that writes the activations before every GEMV
                    if experiments in AFTER_A_WRITER:
                        src = xk.clone()
                        t = graph_us(lambda w, f=launch, a=src, b=xk: (torch.mul(a, 1.0, out=b), f(w)), sets)
                    else:
                        t = graph_us(launch, sets)
                    cold = cold_l2_bench(lambda f=launch, w=sets[0]: f(w), (0.5,))[0] * 1e3
                except Exception as e:  # a candidate that does not compile or launch is recorded, not fatal
                    rows.append({"shape": name, "N": n, "K": k, "kind": kind, "config": cfg, "error": str(e)[:200]})
                    continue
                pick = _picked(kind) if cfg is None and kind != "bf16" else None
                med = sorted(t)[len(t) // 2]
                rows.append({"shape": name, "N": n, "K": k, "kind": kind, "config": cfg or "wrapper",
                             "autotuned": pick, "us": t, "median_us": med, "cold_l2_us": cold, "bytes": nbytes,
                             "bw_frac": nbytes / (med * 1e-6) / bw, "rel_err": err})
            del sets
            torch.cuda.empty_cache()
        data = {"copy_bw_bytes_per_s": bw, "empty_kernel_graph_us": empty, "rotate_bytes": ROTATE_BYTES,
                "rows": rows}
        if out:
            print("wrote", write_record("gemv_study", data, out_dir=out), flush=True)
    return data


def _dequant(kind: str, w: tuple, n: int, k: int) -> torch.Tensor:
    from labkit.quant.packing import dequantize_int4, dequantize_int8

    if kind in ("w8", "w8xs"):
        return dequantize_int8(w[0], w[1], torch.float32)
    if kind in ("w4", "w4xs"):
        return dequantize_int4(w[0], w[1].float(), w[2].float(), GROUP)
    return w[0].float()


def _picked(kind: str):
    tuned = qm._w8_gemv_tuned if kind == "w8" else qm._w4_gemv_tuned
    best = getattr(tuned, "best_config", None)
    return None if best is None else dict(best.kwargs, num_warps=best.num_warps)


def summarise(data: dict) -> None:
    bw = data["copy_bw_bytes_per_s"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; empty kernel in a graph "
          f"{sorted(data['empty_kernel_graph_us'])[5]:.2f} us/launch")
    by = {}
    for r in data["rows"]:
        if "median_us" in r:
            by.setdefault((r["shape"], r["kind"]), []).append(r)
    print(f"{'shape':<11}{'kind':<6}{'floor us':>9}{'wrapper':>9}{'best':>8}  best config")
    for (shape, kind), rs in by.items():
        floor = rs[0]["bytes"] / bw * 1e6
        wrap = next((r for r in rs if r["config"] == "wrapper"), None)
        cands = [r for r in rs if r["config"] != "wrapper"] or rs
        best = min(cands, key=lambda r: r["median_us"])
        cfg = best["config"] if isinstance(best["config"], str) else " ".join(
            f"{v}" for v in best["config"].values())
        print(f"{shape:<11}{kind:<6}{floor:9.2f}{wrap['median_us'] if wrap else float('nan'):9.2f}"
              f"{best['median_us']:8.2f}  {cfg}  (autotuner: {wrap and wrap.get('autotuned')})")


def run_best(path: str, dev) -> None:
    """Launch each shape's best candidate twice (for a profiler such as ncu to catch)."""
    data = json.loads(Path(path).read_text())["data"]
    best = {}
    for r in data["rows"]:
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
                    help="int4: time only the split-K kernel's best configs and, for w4xs, labkit's tile around "
                         "its row-step rule; int8 (w8): only the autotuner's pick")
    ap.add_argument("--experiments", nargs="?", const="pdl", choices=tuple(XS_EXPERIMENTS),
                    help="w4xs: labkit's tile with programmatic dependent launch and without its reduction (pdl), "
                         "or other slices, warps and whole-K programs, all with PDL (tiles), or the split and whole-K "
                         "tiles with and without PDL, each GEMV after a kernel that writes its activations (step), "
                         "or those tiles plain, with the RMSNorm inside and with the residual add inside (fused), "
                         "or at the rule's and half its row steps with and without PAIR_WORDS (pairs), or split "
                         "tiles of other rows, slices and warps, all with PAIR_WORDS (pairtiles), or the split tile "
                         "with its counted reduction, the TAGGED one and none (tagged; w8xs: the int8 split tile the "
                         "same way), or the tiles with their loads pipelined through shared memory, LOOP_STAGES 2-4 "
                         "(stages)")
    ap.add_argument("--best", help="a gemv_study.json: launch each shape's best candidate (for ncu)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_study needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if args.best:
        run_best(args.best, dev)
        return 0
    data = sweep({s: SHAPES[s] for s in args.shapes}, dev, args.out, args.kinds, args.baseline_only, args.experiments)
    summarise(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
