"""Each weight format's kernels at serving batches, labkit's beside the ones a practitioner would reach for, in one run.

For one decoder layer's four linears (fused q/k/v, o, fused gate/up or the up projection, down) of the 8B and the
175B model, at ``BATCHES`` rows, every path of every format (``labkit.experiments.quantization.peers``) is timed
against cuBLAS bf16 (``F.linear``) in CUDA graphs, each cycling through enough copies of its weights that they are
read from memory, not from L2 (as notebook 03's GEMV study does).

Before it is timed, each path is checked on the timed shapes at every batch (``peers.check_path``: ``kernel_err``
within its format's bound, ``rel_err`` reported beside it). A path that cannot be built, fails its check or fails to
run is recorded with its error, never dropped; so is a path the time budgets left unbuilt or untimed.

``measure`` returns ``{"device", "rows", "presets", ...}``: a row per ``(preset, batch, path)`` with ``us`` (the four
linears' median), ``bf16_us`` (timed in the same run), ``status`` and both errors; ``write_records`` stores it as
``format_gemm`` (read by the planner: ``labkit.plan.calibration.kernel_paths``) and the engine's kernel table as
``quant_dispatch`` (``labkit.quant.dispatch``), and records the figures notebooks 04 and 08 quote (``figures``).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from labkit.experiments.quantization.peers import (
    BF16,
    TOLERANCE,
    _check,
    _error,
    build_path,
    build_rank,
    candidates,
    is_w8a8,
)
from labkit.model import get_config
from labkit.quant.peers import GEMLITE_SETUP, LABKIT_PATHS, LEGACY_NAMES

BATCHES = (1, 4, 8, 16, 32, 64, 128, 256)
"""Rows of the activation: decode batches from one sequence to a serving batch (the planner's batches among them)."""
PRESETS = ("llama-3-8b", "gpt3-175b")
"""Layer shapes measured: the 8B proxy's and the 175B model's."""
DECODE_RECORD = "quant_decode"
"""Record name of the engine's decode steps per format (``bench decode --formats ... --name quant_decode``)."""
HEADLINE_BATCH = 64
"""The serving batch notebook 04's and the capstone's figures quote (the 8B layer)."""


def layer_shapes(preset: str = "llama-3-8b") -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one decoder layer's linears: fused q/k/v, o, fused gate/up (the up
    projection alone for a non-gated MLP such as GPT-3's), down."""
    s = get_config(preset)
    kv = s.num_kv_heads * s.head_dim
    up = s.intermediate_size * (2 if s.gated_mlp else 1)
    return [(s.num_heads * s.head_dim + 2 * kv, s.hidden_size), (s.hidden_size, s.num_heads * s.head_dim),
            (up, s.hidden_size), (s.hidden_size, s.intermediate_size)]


def layer_params(preset: str) -> int:
    """Weights of one layer's linears (what the planner matches a tensor-parallel shard against)."""
    return sum(n * k for n, k in layer_shapes(preset))


def weight_copies(nbytes: int, device: torch.device) -> int:
    """Copies of a layer's weights that cycling through reads 4x the L2 before any repeats (one on the CPU)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(8, math.ceil(4 * l2 / max(nbytes, 1))))


def _format_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes one ``[n, k]`` weight holds in ``fmt`` with its scales (labkit's layouts; group 128 for int4)."""
    return {"bf16": 2 * n * k, "int8": n * k + 2 * n, "int4": n * k // 2 + 4 * n * k // 128,
            "fp8": n * k + 4 * n}[fmt]


def measure(presets: tuple[str, ...] = PRESETS, batches: tuple[int, ...] = BATCHES, iters: int = 20,
            budget_s: float = 300.0, timing_s: float | None = None, paths: tuple[str, ...] | None = None,
            seed: int = 0, progress: bool = True, device: str | None = None,
            checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Check and time every path (``candidates``, or ``paths``) of one layer's linears of each preset at each batch
    (module docstring). Paths are built and checked in ``BUILD_ORDER`` until ``budget_s`` seconds have passed since
    the start (the rest are rows saying so), then every built path is timed, batch by batch, for at most
    ``timing_s`` more (default ``budget_s / 2``; the rows left say so). ``checkpoint(data)`` is called with the rows
    so far after each batch (a caller that may be stopped writes them). On CUDA, in bf16; ``device="cpu"`` runs the
    same loop in float32 timed by wall clock (for tests of the loop, not for numbers)."""
    if device is None and not torch.cuda.is_available():
        raise RuntimeError("format_gemm.measure times GPU kernels (cuBLAS, tinygemm, Triton, FP8 tensor cores): it "
                           "needs CUDA; on the CPU notebooks read the committed results/<gpu>/records/format_gemm.json")
    dev = torch.device(device or "cuda")
    cands = candidates()
    names = [BF16, *sorted((n for n in (paths or cands) if n != BF16), key=build_rank)]
    start = time.perf_counter()
    timing_s = budget_s / 2 if timing_s is None else timing_s
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows: list[dict] = []

    def data(new=()):
        return {"device": name, "presets": list(presets), "batches": list(batches), "rows": rows + list(new),
                "tolerance": TOLERANCE, "seconds": time.perf_counter() - start,
                "budget_s": {"build": budget_s, "timing": timing_s}, "gemlite": dict(GEMLITE_SETUP),
                "note": "one decoder layer's four linears per preset, CUDA-graph replays, weights cycled past L2; us = "
                        "median of the four linears' sum; ratio to bf16 = bf16_us / us"}

    for preset in presets:
        rows += _measure_preset(preset, names, cands, batches, iters, (start, budget_s, timing_s), seed, progress,
                                dev, (lambda new: checkpoint(data(new))) if checkpoint else None)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return data()


def _measure_preset(preset, names, cands, batches, iters, budget, seed, progress, dev, checkpoint) -> list[dict]:
    from labkit.bench import time_fn

    start, budget_s, timing_s = budget

    shapes = layer_shapes(preset)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(seed)
    base = []
    for n, k in shapes:
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=dtype)
        lin.weight.data.normal_(0, 0.02, generator=gen)
        base.append(lin)
    xs = {b: [torch.randn(b, k, device=dev, dtype=dtype, generator=gen) for _, k in shapes] for b in batches}
    with torch.no_grad():  # the bf16 layers' products, every batch's rows stacked, per linear
        refs = [torch.cat([xs[b][i] for b in batches]).float() @ lin.weight.float().T for i, lin in enumerate(base)]
    built: dict[str, list] = {}
    status: dict[str, str] = {}
    checks: dict[tuple[str, int], dict] = {}
    for name in names:
        fmt = cands[name][0]
        copies = weight_copies(sum(_format_bytes(fmt, n, k) for n, k in shapes), dev)
        if time.perf_counter() - start > budget_s:
            status[name], built[name] = f"not built: the time budget ({budget_s:.0f} s) was spent", []
            continue
        try:
            first = [build_path(name, lin, {}) for lin in base]
        except Exception as e:  # a library missing, a shape its kernel refuses: recorded
            status[name], built[name] = "unavailable: " + _error(e), []
            continue
        status[name] = "ok"
        try:  # checked on the timed shapes at every batch (kernels change with the rows), before any timing
            per = [_check(fn, w, ref, [xs[b][i] for b in batches], fmt) for i, ((fn, w), ref) in
                   enumerate(zip(first, refs))]
            for j, b in enumerate(batches):
                checks[(name, b)] = {"kernel_err": max(p[j]["kernel_err"] for p in per),
                                     "rel_err": max(p[j]["rel_err"] for p in per), "ok": all(p[j]["ok"] for p in per)}
        except Exception as e:
            for b in batches:
                checks[(name, b)] = {"kernel_err": float("nan"), "rel_err": float("nan"), "ok": False,
                                     "error": "check failed: " + _error(e)}
        sets = [[fn for fn, _ in first]]
        del first
        try:
            for _ in range(copies - 1):  # more weight sets, so that a replay reads its weights from memory
                sets.append([build_path(name, _fresh(lin, gen), {})[0] for lin in base])
        except Exception as e:
            status[name] = "unavailable: " + _error(e)
        built[name] = sets
        if progress:
            print(f"{preset}: {name}: {status[name]}, {len(sets)} weight set(s), "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    del refs
    rows = []
    timing_start = time.perf_counter()
    for b in batches:
        times: dict[str, float] = {}
        for name in names:
            fmt = cands[name][0]
            row = {"preset": preset, "layer_params": layer_params(preset), "weights": fmt, "path": name,
                   "library": cands[name][1], "batch": b, "us": float("nan"), "bf16_us": float("nan"),
                   "weight_sets": len(built.get(name) or []),
                   "weight_bytes": sum(_format_bytes(fmt, n, k) for n, k in shapes)}
            chk = checks.get((name, b))
            if chk:
                row.update(kernel_err=chk["kernel_err"], rel_err=chk["rel_err"], tolerance=TOLERANCE[fmt])
            if status[name] != "ok":
                row["status"] = status[name]
            elif not chk["ok"]:
                row["status"] = chk.get("error") or (f"wrong: kernel_err {chk['kernel_err']:.3g} > "
                                                     f"{TOLERANCE[fmt]:g}; not timed")
            elif time.perf_counter() - timing_start > timing_s:
                row["status"] = f"not timed: the timing budget ({timing_s:.0f} s) was spent"
            else:
                try:
                    sets, turn = built[name], itertools.cycle(range(len(built[name])))

                    def step(sets=sets, turn=turn, x=xs[b]):
                        fns = sets[next(turn)]
                        return [fn(xi) for fn, xi in zip(fns, x)]
                    with torch.no_grad():
                        t = time_fn(step, device=dev, iters=iters, cuda_graph=dev.type == "cuda")
                    times[name] = row["us"] = t.median_s * 1e6
                    row["status"] = "ok"
                except Exception as e:  # e.g. a kernel that cannot be captured in a CUDA graph
                    row["status"] = "error: " + _error(e)
            rows.append(row)
        for r in rows:
            if r["batch"] == b:
                r["bf16_us"] = times.get(BF16, float("nan"))
        if progress and BF16 in times:
            print(f"{preset} batch {b}: " + ", ".join(f"{n}: {times[BF16] / t:.2f}x" for n, t in times.items()
                                                      if n != BF16), flush=True)
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def _fresh(lin: nn.Linear, gen: torch.Generator) -> nn.Linear:
    out = nn.Linear(lin.in_features, lin.out_features, bias=False, device=lin.weight.device, dtype=lin.weight.dtype)
    out.weight.data.normal_(0, 0.02, generator=gen)
    return out


# --- reading a measurement ----------------------------------------------------------------------------------------

BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / 128}
"""Bytes one weight costs in each format, scales included (int4: a bf16 scale and zero per 128 weights)."""


def path_name(name: str) -> str:
    """A record's path name in today's terms (``LEGACY_NAMES``)."""
    return LEGACY_NAMES.get(name, name)


def rows_of(data: dict, preset: str = "llama-3-8b") -> list[dict]:
    """The rows of ``preset`` (a record without presets is the 8B layer's), legacy names translated."""
    return [dict(r, path=path_name(r["path"])) for r in data["rows"] if r.get("preset", "llama-3-8b") == preset]


def ratios(data: dict, preset: str = "llama-3-8b") -> list[dict]:
    """``{weights, path, library, batch, speedup}`` of every timed path of ``preset``: bf16's time over the path's
    (above 1: faster than cuBLAS bf16)."""
    return [{"weights": r["weights"], "path": r["path"], "library": r.get("library", ""), "batch": r["batch"],
             "speedup": r["bf16_us"] / r["us"]}
            for r in rows_of(data, preset) if r.get("status", "ok") == "ok" and r["weights"] != "bf16"
            and _positive(r["us"]) and _positive(r["bf16_us"])]


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and v == v and 0 < v < float("inf")


def speedup_table(data: dict, preset: str = "llama-3-8b") -> list[dict]:
    """One row per path (``weights``, ``path``, ``library``) with its speed-up over bf16 at each batch measured
    (``None`` where it was not timed) and its status where it was never timed."""
    by = {}
    for r in rows_of(data, preset):
        if r["weights"] == "bf16":
            continue
        row = by.setdefault(r["path"], {"weights": r["weights"], "path": r["path"], "library": r.get("library", "")})
        ok = r.get("status", "ok") == "ok" and _positive(r["us"]) and _positive(r["bf16_us"])
        row[r["batch"]] = r["bf16_us"] / r["us"] if ok else None
        if not ok:
            row.setdefault("why not timed", r.get("status", ""))
    return list(by.values())


def roofline_speedup(fmt: str, batch: int, hw, w8a8: bool = False) -> float:
    """The datasheet's bound on a path's speed-up over bf16 at ``batch`` rows (one weight matrix, activations
    negligible): bf16 takes ``max(2 B / bandwidth, 2 batch FLOP / bf16 rate)`` per weight; the format ``max(bytes /
    bandwidth, 2 batch / rate)``, at bf16's rate for weight-only paths (they widen to 16 bits) and at the 8-bit
    rate (``hw.fp8_flops``) for ``w8a8`` paths. Few rows: the ratio of bytes; many rows: the ratio of rates."""
    t16 = max(2 / hw.mem_bandwidth, 2 * batch / hw.bf16_flops)
    rate = hw.fp8_flops if w8a8 and hw.fp8_flops else hw.bf16_flops
    return t16 / max(BYTES_PER_WEIGHT[fmt] / hw.mem_bandwidth, 2 * batch / rate)


def best_paths(data: dict, preset: str = "llama-3-8b", batch: int = HEADLINE_BATCH) -> dict[str, dict]:
    """Per format, the fastest path of ``preset`` at ``batch`` and labkit's own: ``{fmt: {best, best_speedup,
    labkit_speedup}}`` (speed-ups over bf16; None where a side was not timed)."""
    out = {}
    rs = [r for r in ratios(data, preset) if r["batch"] == batch]
    for fmt in ("int8", "int4", "fp8"):
        mine = [r for r in rs if r["weights"] == fmt]
        own = [r["speedup"] for r in mine if r["path"] == LABKIT_PATHS[fmt]]
        best = max(mine, key=lambda r: r["speedup"]) if mine else None
        out[fmt] = {"best": best["path"] if best else None, "best_speedup": best["speedup"] if best else None,
                    "labkit_speedup": own[0] if own else None}
    return out


def gemm_figures(data: dict, machine: str | None = None) -> list[dict]:
    """The figures of a measurement (all timed in one run, on the 8B layer), as ``{name, value, unit, note,
    derived}``: per format at ``HEADLINE_BATCH`` rows ``quant.{fmt}_best_gemm_speedup_b64`` (the fastest path over
    bf16), ``quant.{fmt}_best_path_b64`` (its name), ``quant.{fmt}_labkit_gemm_speedup_b64`` (labkit's own path) and
    ``quant.{fmt}_roofline_speedup_b64`` (the datasheet's bound for the best path's kind, derived; on the machines of
    ``labkit.hardware.KNOWN``); labkit's own path at one row and at 256, ``quant.{fmt}_labkit_gemm_speedup_b1`` /
    ``_b256``."""
    from labkit.data import machine_class
    from labkit.hardware import KNOWN

    machine = machine or data.get("device")
    hw = KNOWN.get(machine_class(machine)) if machine else None
    note = "one llama-3-8b layer's four linears, {b} rows, CUDA-graph replays, weights cycled past L2; over cuBLAS " \
           "bf16 timed in the same run"
    out = []

    def put(name, value, unit, why, derived=False):
        out.append({"name": name, "value": value, "unit": unit, "note": why, "derived": derived})

    b = HEADLINE_BATCH
    for fmt, p in best_paths(data, "llama-3-8b", b).items():
        if p["best"] is None:
            continue
        put(f"quant.{fmt}_best_gemm_speedup_b{b}", p["best_speedup"], "x over bf16",
            note.format(b=b) + f"; the fastest {fmt} path: {p['best']}")
        put(f"quant.{fmt}_best_path_b{b}", p["best"], "path", f"the fastest {fmt} path at {b} rows of every path "
            "measured")
        if p["labkit_speedup"] is not None:
            put(f"quant.{fmt}_labkit_gemm_speedup_b{b}", p["labkit_speedup"], "x over bf16",
                note.format(b=b) + f"; labkit's own path: {LABKIT_PATHS[fmt]}")
        if hw is not None:
            put(f"quant.{fmt}_roofline_speedup_b{b}", roofline_speedup(fmt, b, hw, is_w8a8(p["best"])), "x over bf16",
                f"{hw.name} datasheet: bytes per weight and the tensor-core rate of the best path's kind "
                f"({'8-bit' if is_w8a8(p['best']) else '16-bit'} multiplies)", derived=True)
    for rb in (1, 256):
        for fmt, p in best_paths(data, "llama-3-8b", rb).items():
            if p["labkit_speedup"] is not None:
                put(f"quant.{fmt}_labkit_gemm_speedup_b{rb}", p["labkit_speedup"], "x over bf16",
                    note.format(b=rb) + f"; labkit's own path: {LABKIT_PATHS[fmt]}")
    return out


def figures(data: dict, record, out_dir=None, machine: str | None = None) -> dict:
    """Record ``gemm_figures`` (notebook 04's and the capstone's figures of a measurement) in the run's figures,
    under ``machine`` (default: the measurement's device); returns the entries by name."""
    from labkit.bench import record_figure

    machine = machine or data.get("device")
    return {f["name"]: record_figure(f["name"], f["value"], f["unit"], record, out_dir=out_dir, machine=machine,
                                     note=f["note"], derived=f["derived"]) for f in gemm_figures(data, machine)}


def plot_speedups(data: dict, preset: str = "llama-3-8b", hw=None, axes=None, title: str = ""):
    """Speed-up over bf16 against batch, one panel per format (int8, int4, FP8), a line per path that was timed;
    with ``hw`` the datasheet's bound (``roofline_speedup``) dashed: weight-only and, where the format has 8-bit
    activation paths, W8A8. Returns the figure."""
    import matplotlib.pyplot as plt

    table = speedup_table(data, preset)
    if axes is None:
        fig, axes = plt.subplots(1, 3, figsize=(15, 6.2), sharey=True)
    else:
        fig = axes[0].figure
    batches = sorted({r["batch"] for r in rows_of(data, preset)})
    for ax, fmt in zip(axes, ("int8", "int4", "fp8")):
        for row in (r for r in table if r["weights"] == fmt):
            pts = [(b, row[b]) for b in batches if row.get(b)]
            if not pts:
                continue
            own = row["path"] == LABKIT_PATHS[fmt]
            ax.plot(*zip(*pts), "o-" if own else ".-", lw=2.6 if own else 1.3, label=row["path"],
                    color="black" if own else None)
        if hw is not None:  # the datasheet's bound: dashed for 16-bit multiplies, dotted for 8-bit (W8A8)
            for w8a8 in [False] + ([True] if fmt != "int4" else []):
                ax.plot(batches, [roofline_speedup(fmt, b, hw, w8a8) for b in batches], ":" if w8a8 else "--",
                        color="gray", lw=1.2, label=f"roofline, {'W8A8' if w8a8 else 'weight-only'} ({hw.name})")
        ax.axhline(1, color="red", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="rows (batch)", title=f"{fmt} weights", ylim=(0.2, 5))
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    axes[0].set_ylabel("speed-up over cuBLAS bf16 (one layer's linears)")
    yt = [0.25, 0.5, 1, 2, 4]
    axes[0].set_yticks(yt, [f"{v:g}x" for v in yt])
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def write_records(data: dict, out_dir=None) -> dict:
    """Write ``format_gemm`` (the measurement) and ``quant_dispatch`` (the engine's kernel table, from the 8B layer's
    rows) under ``out_dir``'s records, and record ``figures``; returns their paths."""
    from labkit.bench import write_record
    from labkit.quant.dispatch import TABLE_NAME, table_from_rows

    gemm = write_record("format_gemm", data, out_dir=out_dir)
    table = table_from_rows(data["rows"], data["device"], source=str(gemm), preset="llama-3-8b")
    disp = write_record(TABLE_NAME, table.to_dict(), out_dir=out_dir)
    figures(data, gemm, out_dir=out_dir)
    return {"format_gemm": gemm, "quant_dispatch": disp}


def run_format_gemm(profile: str, out_dir=None, presets: tuple[str, ...] = PRESETS, budget_s: float = 150.0,
                    timing_s: float = 80.0) -> tuple[Path, dict] | None:
    """This run's ``format_gemm`` record (its path and data), the one notebooks 04, 06 and 08 read: under the
    ``gpu`` profile it is measured now (``measure`` of ``presets`` within ``budget_s`` + ``timing_s``, then
    ``write_records``) unless the run already holds one covering ``presets``, which is reused; under the ``cpu``
    and ``ci`` profiles the run's record if one exists, else None (read the committed GPU records instead)."""
    from labkit.bench import output_dir
    from labkit.checks import check_choice

    check_choice("profile", profile, ("ci", "cpu", "gpu"))
    fresh = Path(out_dir or output_dir()) / "records" / "format_gemm.json"
    held = json.loads(fresh.read_text())["data"] if fresh.exists() else None
    if profile == "gpu" and (held is None or not set(presets) <= set(held.get("presets", ()))):
        write_records(measure(presets=presets, budget_s=budget_s, timing_s=timing_s), out_dir=out_dir)
        held = json.loads(fresh.read_text())["data"]
    return (fresh, held) if held is not None else None
