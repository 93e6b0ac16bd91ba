"""The GPU run of quantisation at serving batches, in stages that each leave their records behind.

    python scripts/quant_peers.py gemm --out DIR [--budget 110 --timing 50 --budget-175b 25 --timing-175b 30]
        every path of every weight format on one 8B layer, then one 175B layer
        (labkit.experiments.quantization.format_gemm):
        DIR/records/format_gemm.json (rewritten after each layer shape) and DIR/records/quant_dispatch.json (the
        engine's kernel table, from the 8B rows)
    python scripts/quant_peers.py figures --out DIR
        the figures of whatever DIR/records holds: the per-format GEMM figures (quant.<fmt>_best/labkit_gemm_...),
        the engine's decode steps of `bench decode --formats ... --name quant_decode` (quant.<fmt>_decode_speedup_b*),
        and the 175B plan with these kernels against labkit's own (plan.gpus_175b_<w>, plan.kernel_175b_<w>,
        plan.gpus_175b_<w>_labkit), into DIR/figures.json

`scripts/gpu_quant_peers.sh` runs both around `bench decode` in one device call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import labkit  # noqa: F401  (before anything imports triton)


def gemm(out: Path, budget: float, timing: float, budget_175b: float, timing_175b: float) -> int:
    from labkit.bench import write_record
    from labkit.experiments.quantization import format_gemm

    t0 = time.perf_counter()

    def keep(partial: dict, before: dict | None = None) -> None:  # rewritten after every batch: a stop keeps them
        if before is not None:
            partial = dict(partial, presets=before["presets"] + partial["presets"],
                           rows=before["rows"] + partial["rows"])
        write_record("format_gemm", partial, out_dir=out)

    data = format_gemm.measure(presets=("llama-3-8b",), budget_s=budget, timing_s=timing, checkpoint=keep)
    print(f"8B layer measured in {time.perf_counter() - t0:.0f} s", flush=True)
    format_gemm.write_records(data, out_dir=out)  # and the engine's kernel table, from the 8B rows
    big = format_gemm.measure(presets=("gpt3-175b",), budget_s=budget_175b, timing_s=timing_175b,
                              batches=tuple(data["batches"]), checkpoint=lambda d: keep(d, data))
    data = dict(data, presets=data["presets"] + big["presets"], rows=data["rows"] + big["rows"],
                seconds=data["seconds"] + big["seconds"])
    paths = format_gemm.write_records(data, out_dir=out)
    print(f"both layers measured in {time.perf_counter() - t0:.0f} s: {paths}", flush=True)
    return 0


def figures(out: Path) -> int:
    from labkit.bench import record_figure, write_record
    from labkit.experiments.batching.decode_figures import quant_decode_figures
    from labkit.experiments.capstone import plan_figures
    from labkit.experiments.quantization import format_gemm
    from labkit.plan import SCENARIO_175B, recommend

    rec_dir = out / "records"
    gemm_path = rec_dir / "format_gemm.json"
    fresh = None
    if gemm_path.exists():
        fresh = json.loads(gemm_path.read_text())["data"]
        for name, e in format_gemm.figures(fresh, gemm_path, out_dir=out).items():
            print(f"{name} = {e['value']}")
    decode = rec_dir / f"{format_gemm.DECODE_RECORD}.json"
    if decode.exists():
        rows = json.loads(decode.read_text())["data"]["rows"]
        for name, e in quant_decode_figures(rows, decode, out).items():
            print(f"{name} = {e['value']:.3f}  ({e['note']})")
    rec = recommend(SCENARIO_175B, format_gemm=fresh)
    plan_rec = rec_dir / "quant_plan.json"
    rows = plan_figures(rec)
    write_record("quant_plan", {"calibration": rec.cal.source, "machine": rec.cal.machine, "layout": rec.layout,
                                "by_weights": {w: p.to_dict() for w, p in rec.by_weights.items()},
                                "figures": [dict(zip(("name", "value", "unit", "note"), r)) for r in rows]},
                 out_dir=out)
    for name, value, unit, why in rows:
        record_figure(name, value, unit, plan_rec, out_dir=out, machine=rec.cal.machine, note=why)
        print(f"{name} = {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gemm")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--budget", type=float, default=110, help="seconds for building and checking the 8B layer's paths")
    g.add_argument("--timing", type=float, default=50, help="seconds for timing them, after")
    g.add_argument("--budget-175b", type=float, default=25, help="seconds for building and checking the 175B layer's")
    g.add_argument("--timing-175b", type=float, default=30, help="seconds for timing them")
    f = sub.add_parser("figures")
    f.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "gemm":
        return gemm(args.out, args.budget, args.timing, args.budget_175b, args.timing_175b)
    return figures(args.out)


if __name__ == "__main__":
    sys.exit(main())
