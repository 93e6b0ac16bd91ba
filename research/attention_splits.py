"""How should decode attention cut a short context at batch 1: how many ranges, which tile?

The int4 8B engine step spends ~6.5 us a layer in the split attention kernel and ~1.6 us in its merge (plain
launches, results/h200/records/04_quantization.json) for ~2 MB of K and V: a floor of ~0.5 us. Two measurements,
both CUDA-graph replays:

* ``kernel``: ``paged_attention`` at the engine's shape -- one sequence, 32 query and 8 KV heads of 128, 16-token
  blocks -- over 48 distinct cache pools in turn (~100 MB, more than L2, so K and V come from DRAM as they do in a
  step): the default call (``auto_num_splits`` ranges; ``short_range_tile``: one tile per range where ranges are
  short), then every (range count, tile) passed as arguments (``num_splits``, ``config``);
* ``engine``: the int4 llama-3-8b engine step (``runner_step``, notebook 04's) with the default policy, twice.

Found (research/records/h200/attention_splits_4aec4fc.json): 33 ranges of >= 16 tokens took the engine step
2.193/2.219 -> 2.130/2.158 ms against 8 ranges of >= 64 (``auto_num_splits(min_split_tokens=)``, 16 since). The
variants that record also timed (the autotuner's tile for short ranges, the general loop for ranges of one tile,
the merge folded into the split kernel) were removed from the kernel or lost (the fused merge: 2.332 against
2.057 ms in notebook 04's A/B); research/README.md says where their code is.

    python research/attention_splits.py --out /tmp/h200          # records/attention_splits.json
    python research/attention_splits.py --device cpu --preset tiny   # the script itself, quickly, on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial

import labkit.kernels.paged_attention as pa

CONTEXTS = (513, 2049)  # notebook 04's engine step (512 cached + 1) and a longer one
SPLITS = (16, 33, 64)
TILES = [dict(BLOCK_N=n, num_warps=4, num_stages=s) for n, s in itertools.product((16, 32, 64), (1, 2))]
POOLS = 48


def _attention(q, k, v, tables, lens, num_splits=None, tile=None):
    """``paged_attention`` with the split kernel's ``tile`` (the product's takes its own: ``pa._launch``)."""
    return pa._launch(q, k, v, tables, lens, None, num_splits, None, None, "", tile)


def _run_all(q, pools, tables, lens, **kw) -> None:
    for k, v in pools:
        _attention(q, k, v, tables, lens, **kw)


def _bench_ms(fn) -> float:
    """Milliseconds of ``fn()``: CUDA-graph replays on a GPU, one call's wall time on a CPU (a check of the
    script, not a figure)."""
    import time

    import torch

    from labkit.kernels.common import graph_bench

    if torch.cuda.is_available():
        return graph_bench(fn)[0]
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _time_row(row: dict, q, pools, tables, lens, ref, **kw) -> dict:
    """``row`` with the microseconds per call of ``paged_attention(**kw)`` and its largest difference from the
    single-pass kernel (an error the compiler raises is recorded instead)."""
    try:
        out = _attention(q, *pools[0], tables, lens, **kw)
        row["max_abs_diff_vs_one_pass"] = float((out.float() - ref.float()).abs().max())
        row["us"] = _bench_ms(partial(_run_all, q, pools, tables, lens, **kw)) * 1e3 / len(pools)
    except Exception as e:  # a tile the compiler refuses: record it, go on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _sweep_context(ctx: int, device, pools: int = POOLS, splits_tiles=None) -> list[dict]:
    """The default and every (range count, tile) at one context: microseconds per call. ``splits_tiles``:
    the (range count, tile) pairs (default: every one of ``SPLITS`` x ``TILES``; tiles apply on CUDA only)."""
    import torch

    width = -(-ctx // 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's tl.dot: not bf16
    q = torch.randn(1, 32, 128, device=device, dtype=dtype)
    pools = [(torch.randn(width, 16, 8, 128, device=device, dtype=dtype),
              torch.randn(width, 16, 8, 128, device=device, dtype=dtype)) for _ in range(pools)]
    tables = torch.arange(width, device=device, dtype=torch.int32)[None]
    lens = torch.tensor([ctx], device=device, dtype=torch.int32)
    data = (q, pools, tables, lens, pa.paged_attention(q, *pools[0], tables, lens, num_splits=1))
    auto = pa.auto_num_splits(1, 8, width * 16, device)
    rows = [_time_row(dict(context=ctx, num_splits=auto, tile="default"), *data)]
    print(f"ctx {ctx}: default ({auto} ranges) {rows[-1].get('us', -1):.2f} us", flush=True)
    for splits, tile in splits_tiles or itertools.product(SPLITS, TILES):
        rows.append(_time_row(dict(context=ctx, num_splits=splits, tile=tile), *data, num_splits=splits,
                              tile=tile if device.type == "cuda" else None))
    for r in sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:8]:
        print(f"ctx {ctx}: {r['num_splits']:>2} ranges {r['tile']}: {r['us']:.2f} us", flush=True)
    return rows


def kernel_sweep(device, preset: str) -> list[dict]:
    if device.type == "cuda":
        return [row for ctx in CONTEXTS for row in _sweep_context(ctx, device)]
    return _sweep_context(40, device, pools=2, splits_tiles=[(3, None)])  # the script's check on a CPU


def engine_step(device, preset: str) -> list[dict]:
    import torch

    from labkit.bench import time_fn
    from labkit.experiments.batching import runner_step
    from labkit.model import random_model
    from labkit.quant import quantize

    gpu = device.type == "cuda"  # on a CPU: one layer, layers that dequantise, one rep (a check of the script)
    model = random_model(preset, device=device, dtype="bf16" if gpu else "fp16", seed=0, num_layers=None if gpu else 1)
    model = quantize(model, "int4", backend="triton" if gpu else "torch")
    rows = []
    for rep in range(2 if gpu else 1):
        step, runner = runner_step(model, "decode", 1, 512 if gpu else 40)
        t = time_fn(step, device=device, warmup=2 if gpu else 0, iters=50 if gpu else 1)
        splits = pa.auto_num_splits(1, runner.num_kv_heads, runner.max_blocks * 16, device)
        rows.append(dict(rep=rep, variant="default", num_splits=splits, step_ms=t.median_ms,
                         samples_ms=[1e3 * x for x in t.samples_s]))
        print(f"engine step ({splits} ranges): {t.median_ms:.4f} ms", flush=True)
        del step, runner
        if gpu:
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/local")
    ap.add_argument("--parts", nargs="+", default=["kernel", "engine"], choices=["kernel", "engine"])
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script (no figures)")
    ap.add_argument("--preset", default="llama-3-8b", help="the engine part's model shape (tiny on a CPU)")
    args = ap.parse_args(argv)
    import torch

    from labkit.bench import write_record

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu --preset tiny to check the script)")
        return 1
    data = {"command": "python research/attention_splits.py " + " ".join(argv or sys.argv[1:])}
    for part, fn in (("kernel", kernel_sweep), ("engine", engine_step)):
        if part in args.parts:  # the record rewritten after each part: a part cut off at a time limit keeps the rest
            data[part] = fn(device, args.preset)
            print(f"wrote {write_record('attention_splits', data, args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
