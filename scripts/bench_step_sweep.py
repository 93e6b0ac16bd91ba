"""Measure decode and prefill step times of one GPU across batch, context and weight precision.

The planner (``labkit.plan``) is calibrated and validated against these: every configuration of a model that fits
on one GPU. ``--runner engine`` (the default) times labkit's serving engine, the software the planner's layouts
would run: its ``ModelRunner`` on the paged cache with the Triton kernels, decode steps replayed from a CUDA graph
per batch, prefill as one eager forward (``labkit.experiments.batching.runner_step``). ``--runner hf`` times the
Hugging Face model instead: decode as CUDA-graph replays over its ``StaticCache``
(``labkit.experiments.decode_step``), prefill as one eager forward. Writes ``records/step_sweep.json`` under
``--out`` with every raw timing and the roofline prediction of each step, after each weight precision (a run
stopped early keeps what it measured).

    python scripts/bench_step_sweep.py --out results/h200 [--runner engine] [--preset llama-3-8b]
        [--weights bf16 int8 int4] [--batches 1 8 32 64] [--contexts 512 2048 8000]
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from tqdm.auto import tqdm

from labkit.bench import time_fn, write_record
from labkit.experiments.decode_step import time_decode_step
from labkit.hardware import detect, measure_ceilings, measured_hardware
from labkit.model import get_config, random_model
from labkit.roofline import roofline


def build(preset: str, weights: str):
    model = random_model(preset, device="cuda", dtype="bf16")
    if weights != "bf16":
        from labkit.quant import quantize

        model = quantize(model, weights, inplace=True)
    gc.collect()
    torch.cuda.empty_cache()
    return model


def _engine_time(model, phase: str, batch: int, ctx: int, iters: int):
    from labkit.experiments.batching import runner_step

    step, runner = runner_step(model, phase, batch, ctx)
    t = time_fn(step, warmup=2, iters=iters)
    del step, runner
    return t


def sweep_decode(model, spec, hw, weights: str, batches, contexts, iters: int, runner: str) -> list[dict]:
    rows = []
    for ctx in contexts:
        for b in batches:
            if runner == "engine":
                t = _engine_time(model, "decode", b, ctx, iters)
            else:
                t = time_decode_step(model, b, ctx, cuda_graph=True, iters=iters)
            pred = roofline(spec, hw, batch=b, context=ctx + 1, phase="decode", dtype=weights, kv_dtype="bf16")
            rows.append({"phase": "decode", "weights": weights, "batch": b, "context": ctx, "timing": t,
                         "median_s": t.median_s, "pred_s": pred.time_s, "pred_bytes": pred.bytes,
                         "pred_flops": pred.flops})
            tqdm.write(f"decode {weights} b={b:3d} ctx={ctx:5d}: {t.median_s * 1e3:8.3f} ms "
                       f"(roofline {pred.time_s * 1e3:.3f} ms, {pred.time_s / t.median_s:.2f} of floor)")
            gc.collect()
            torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def sweep_prefill(model, spec, hw, weights: str, contexts, iters: int, runner: str) -> list[dict]:
    rows = []
    for ctx in contexts:
        if runner == "engine":
            t = _engine_time(model, "prefill", 1, ctx, iters)
        else:
            ids = torch.randint(3, spec.vocab_size, (1, ctx), device="cuda")
            t = time_fn(lambda ids=ids: model(input_ids=ids, logits_to_keep=1, use_cache=False), warmup=2,
                        iters=iters)
        pred = roofline(spec, hw, batch=1, context=ctx, phase="prefill", dtype=weights)
        rows.append({"phase": "prefill", "weights": weights, "batch": 1, "context": ctx, "timing": t,
                     "median_s": t.median_s, "pred_s": pred.time_s, "pred_bytes": pred.bytes,
                     "pred_flops": pred.flops})
        tqdm.write(f"prefill {weights} ctx={ctx:5d}: {t.median_s * 1e3:8.3f} ms (roofline {pred.time_s * 1e3:.3f} ms)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8000])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--prefill-iters", type=int, default=5)
    ap.add_argument("--runner", choices=("engine", "hf"), default="engine")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_step_sweep measures GPU steps (CUDA graphs); no CUDA device is present", file=sys.stderr)
        return 2
    ceilings = measure_ceilings()
    hw = measured_hardware(ceilings, detect())
    spec = get_config(args.preset)
    rows = []
    for w in tqdm(args.weights, desc="weight precision"):
        model = build(args.preset, w)
        rows += sweep_decode(model, spec, hw, w, args.batches, args.contexts, args.iters, args.runner)
        rows += sweep_prefill(model, spec, hw, w, args.contexts, args.prefill_iters, args.runner)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        # rewritten after each precision, so a run stopped at a time limit keeps what it measured
        path = write_record("step_sweep", {"preset": args.preset, "runner": args.runner, "ceilings": ceilings,
                                           "rows": rows},
                            out_dir=args.out)
        tqdm.write(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
