"""How many context ranges should decode attention cut a short context into at batch 1?

The int4 8B engine step spends ~6.5 us a layer in the split attention kernel and ~1.6 us in its merge (plain
launches, results/h200/records/04_quantization.json) for ~2 MB of K and V: a floor of ~0.5 us. At batch 1 with a
513-token context ``auto_num_splits`` gave 8 ranges (``MIN_SPLIT_TOKENS`` was 64; a 528-slot table), which whole
64-token tiles round to 5 non-empty ranges of up to 128 tokens: 40 busy programs of 64 on 132 SMs, each walking two
tiles one after the other. Two measurements, both CUDA-graph replays:

* ``kernel``: ``paged_attention`` (split kernel and merge) at the engine's shape -- one sequence, 32 query and 8
  KV heads of 128, 16-token blocks -- over 48 distinct cache pools in turn (~100 MB, more than L2, so K and V come
  from DRAM as they do in a step), for each range count and tile (``BLOCK_N``, warps, stages), and the autotuned
  default;
* ``engine``: the int4 llama-3-8b engine step (``runner_step``, notebook 04's) with ``MIN_SPLIT_TOKENS`` 64, 32
  and 16 (the default since records/attention_splits_4aec4fc.json: 2.193/2.219 -> 2.130/2.158 ms), in turn, twice.

    python scripts/attention_splits.py --out /tmp/h200          # records/attention_splits.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.kernels.paged_attention import auto_num_splits, paged_attention  # noqa: E402

CONTEXTS = (513, 2049)  # notebook 04's engine step (512 cached + 1) and a longer one
SPLITS = (1, 4, 8, 16, 33, 64)
TILES = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
         for n, w, s in itertools.product((16, 32, 64), (1, 2, 4), (1, 2))]
POOLS = 48
MIN_SPLIT = (64, 32, 16)


def _run_all(q, pools, tables, lens, **kw) -> None:
    for k, v in pools:
        paged_attention(q, k, v, tables, lens, **kw)


def _sweep_context(ctx: int, device) -> list[dict]:
    """Every (range count, tile) at one context, and the autotuned default: microseconds per call."""
    import torch

    from labkit.kernels.common import graph_bench

    width = -(-ctx // 16)
    q = torch.randn(1, 32, 128, device=device, dtype=torch.bfloat16)
    pools = [(torch.randn(width, 16, 8, 128, device=device, dtype=torch.bfloat16),
              torch.randn(width, 16, 8, 128, device=device, dtype=torch.bfloat16)) for _ in range(POOLS)]
    tables = torch.arange(width, device=device, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], device=device, dtype=torch.int32)
    ref = paged_attention(q, *pools[0], tables, lens, num_splits=1)
    auto = auto_num_splits(1, 8, width * 16, device)
    us = graph_bench(partial(_run_all, q, pools, tables, lens))[0] * 1e3 / POOLS
    rows = [dict(context=ctx, num_splits=auto, tile="autotuned", us=us)]
    print(f"ctx {ctx}: autotuned default ({auto} ranges) {us:.2f} us", flush=True)
    for splits, tile in itertools.product(SPLITS, TILES):
        row = dict(context=ctx, num_splits=splits, tile=tile)
        try:
            out = paged_attention(q, *pools[0], tables, lens, num_splits=splits, config=tile)
            row["max_abs_diff_vs_one_pass"] = float((out.float() - ref.float()).abs().max())
            fn = partial(_run_all, q, pools, tables, lens, num_splits=splits, config=tile)
            row["us"] = graph_bench(fn)[0] * 1e3 / POOLS
        except Exception as e:  # a tile the compiler refuses: record it, go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    for r in sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:5]:
        print(f"ctx {ctx}: {r['num_splits']:>2} ranges {r['tile']}: {r['us']:.2f} us", flush=True)
    return rows


def kernel_sweep(device) -> list[dict]:
    return [row for ctx in CONTEXTS for row in _sweep_context(ctx, device)]


def engine_ab(device) -> list[dict]:
    import torch

    import labkit.kernels.paged_attention as pa
    from labkit.bench import time_fn
    from labkit.engine.experiments import runner_step
    from labkit.models import random_model
    from labkit.quant import quantize

    model = quantize(random_model("llama-3-8b", device=device, dtype="bf16", seed=0), "int4")
    rows, default = [], pa.MIN_SPLIT_TOKENS
    try:
        for rep, min_split in itertools.product(range(2), MIN_SPLIT):
            pa.MIN_SPLIT_TOKENS = min_split
            step, runner = runner_step(model, "decode", 1, 512)
            t = time_fn(step, device=device, warmup=2, iters=50)
            ms = t.median_ms
            splits = pa.auto_num_splits(1, 8, runner.max_blocks * 16, device)
            rows.append(dict(rep=rep, min_split_tokens=min_split, num_splits=splits, step_ms=ms,
                             samples_ms=[1e3 * x for x in t.samples_s]))
            print(f"engine step, MIN_SPLIT_TOKENS {min_split} ({splits} ranges): {ms:.4f} ms", flush=True)
            del step, runner
            torch.cuda.empty_cache()
    finally:
        pa.MIN_SPLIT_TOKENS = default
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/local")
    ap.add_argument("--parts", nargs="+", default=["kernel", "engine"], choices=["kernel", "engine"])
    args = ap.parse_args(argv)
    import torch

    from labkit.bench import write_record

    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    device = torch.device("cuda")
    data = {"command": "python scripts/attention_splits.py " + " ".join(argv or sys.argv[1:])}
    for part, fn in (("kernel", kernel_sweep), ("engine", engine_ab)):
        if part in args.parts:  # the record rewritten after each part: a part cut off at a time limit keeps the rest
            data[part] = fn(device)
            print(f"wrote {write_record('attention_splits', data, args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
