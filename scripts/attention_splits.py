"""How should decode attention cut a short context at batch 1: how many ranges, which tile, which merge?

The int4 8B engine step spends ~6.5 us a layer in the split attention kernel and ~1.6 us in its merge (plain
launches, results/h200/records/04_quantization.json) for ~2 MB of K and V: a floor of ~0.5 us. At batch 1 with a
513-token context ``auto_num_splits`` gave 8 ranges (``MIN_SPLIT_TOKENS`` was 64; a 528-slot table), which whole
64-token tiles round to 5 non-empty ranges of up to 128 tokens: 40 busy programs of 64 on 132 SMs, each walking two
tiles one after the other. Two measurements, both CUDA-graph replays:

* ``kernel``: ``paged_attention`` at the engine's shape -- one sequence, 32 query and 8 KV heads of 128, 16-token
  blocks -- over 48 distinct cache pools in turn (~100 MB, more than L2, so K and V come from DRAM as they do in a
  step): the default call (``short_range_tile``: one tile per range where ranges are short) and the autotuner's
  pick instead, and the default with the kernel's general loop instead of its one-tile path, each with the merge
  kernel and with the merge fused (``fused_merge``: the last range merges), then every (range count, tile,
  merge);
* ``engine``: the int4 llama-3-8b engine step (``runner_step``, notebook 04's) in turn, twice: ``MIN_SPLIT_TOKENS``
  64 with the autotuner (the policy before records/attention_splits_4aec4fc.json), 16 with the autotuner (after
  it: 2.193/2.219 -> 2.130/2.158 ms), 16 with ``short_range_tile`` through the kernel's general loop, then
  through its one-tile path (now the default), and that with ``fused_attention_merge``.

    python scripts/attention_splits.py --out /tmp/h200          # records/attention_splits.json
    python scripts/attention_splits.py --device cpu --preset tiny   # the script itself, quickly, on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import labkit.kernels.paged_attention as pa  # noqa: E402

CONTEXTS = (513, 2049)  # notebook 04's engine step (512 cached + 1) and a longer one
SPLITS = (16, 33, 64)
TILES = [dict(BLOCK_N=n, num_warps=4, num_stages=s) for n, s in itertools.product((16, 32, 64), (1, 2))]
POOLS = 48
ENGINE_VARIANTS = (  # (name, MIN_SPLIT_TOKENS, short-range tiles, one-tile path, ModelRunner options)
    ("min_split_64_autotuned", 64, False, False, {}),
    ("min_split_16_autotuned", 16, False, False, {}),
    ("min_split_16_short_tile_loop", 16, True, False, {}),
    ("min_split_16_short_tile", 16, True, True, {}),
    ("min_split_16_short_tile_fused_merge", 16, True, True, {"fused_attention_merge": True}),
)


@contextlib.contextmanager
def policy(min_split: int | None = None, short_tiles: bool = True, one_tile: bool = True):
    """``paged_attention``'s defaults changed for the duration: the shortest range, whether short ranges take
    ``short_range_tile`` (else the autotuner picks every tile, as before) and whether ranges of one tile take the
    kernel's ``ONE_TILE`` path (the block table read alongside the context length) or its general loop."""
    saved = pa.MIN_SPLIT_TOKENS, pa.short_range_tile, pa.ONE_TILE_RANGES
    pa.MIN_SPLIT_TOKENS = saved[0] if min_split is None else min_split
    pa.ONE_TILE_RANGES = one_tile
    if not short_tiles:
        pa.short_range_tile = lambda max_context, num_splits: None
    try:
        yield
    finally:
        pa.MIN_SPLIT_TOKENS, pa.short_range_tile, pa.ONE_TILE_RANGES = saved


def _run_all(q, pools, tables, lens, **kw) -> None:
    for k, v in pools:
        pa.paged_attention(q, k, v, tables, lens, **kw)


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
        out = pa.paged_attention(q, *pools[0], tables, lens, **kw)
        row["max_abs_diff_vs_one_pass"] = float((out.float() - ref.float()).abs().max())
        row["us"] = _bench_ms(partial(_run_all, q, pools, tables, lens, **kw)) * 1e3 / len(pools)
    except Exception as e:  # a tile the compiler refuses: record it, go on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _sweep_context(ctx: int, device, pools: int = POOLS, splits_tiles=None) -> list[dict]:
    """The defaults and every (range count, tile, merge) at one context: microseconds per call. ``splits_tiles``:
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
    rows = []
    for (tile, short_tiles, one_tile), fused in itertools.product(
            (("default", True, True), ("default_loop", True, False), ("autotuned", False, False)), (False, True)):
        with policy(short_tiles=short_tiles, one_tile=one_tile):
            rows.append(_time_row(dict(context=ctx, num_splits=auto, tile=tile, fused_merge=fused), *data,
                                  fused_merge=fused))
        print(f"ctx {ctx}: {rows[-1]['tile']} ({auto} ranges, fused_merge={fused}) {rows[-1].get('us', -1):.2f} us",
              flush=True)
    for (splits, tile), fused in itertools.product(splits_tiles or itertools.product(SPLITS, TILES), (False, True)):
        rows.append(_time_row(dict(context=ctx, num_splits=splits, tile=tile, fused_merge=fused), *data,
                              num_splits=splits, config=tile if device.type == "cuda" else None,
                              fused_merge=fused))
    for r in sorted((r for r in rows if "us" in r), key=lambda r: r["us"])[:8]:
        print(f"ctx {ctx}: {r['num_splits']:>2} ranges {r['tile']} fused_merge={r['fused_merge']}: {r['us']:.2f} us",
              flush=True)
    return rows


def kernel_sweep(device, preset: str) -> list[dict]:
    if device.type == "cuda":
        return [row for ctx in CONTEXTS for row in _sweep_context(ctx, device)]
    return _sweep_context(40, device, pools=2, splits_tiles=[(3, None)])  # the script's check on a CPU


def engine_ab(device, preset: str) -> list[dict]:
    import torch

    from labkit.bench import time_fn
    from labkit.experiments.batching import runner_step
    from labkit.models import random_model
    from labkit.quant import quantize

    gpu = device.type == "cuda"  # on a CPU: one layer, layers that dequantise, one rep (a check of the script)
    model = random_model(preset, device=device, dtype="bf16" if gpu else "fp16", seed=0, num_layers=None if gpu else 1)
    model = quantize(model, "int4", backend="triton" if gpu else "torch")
    rows = []
    for rep, (name, min_split, short_tiles, one_tile, options) in itertools.product(range(2 if gpu else 1),
                                                                                    ENGINE_VARIANTS):
        with policy(min_split, short_tiles, one_tile):
            step, runner = runner_step(model, "decode", 1, 512 if gpu else 40, **options)
            t = time_fn(step, device=device, warmup=2 if gpu else 0, iters=50 if gpu else 1)
            splits = pa.auto_num_splits(1, runner.num_kv_heads, runner.max_blocks * 16, device)
        rows.append(dict(rep=rep, variant=name, min_split_tokens=min_split, short_range_tiles=short_tiles,
                         one_tile=one_tile, runner_options=options, num_splits=splits, step_ms=t.median_ms,
                         samples_ms=[1e3 * x for x in t.samples_s]))
        print(f"engine step, {name} ({splits} ranges): {t.median_ms:.4f} ms", flush=True)
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
    data = {"command": "python scripts/attention_splits.py " + " ".join(argv or sys.argv[1:])}
    for part, fn in (("kernel", kernel_sweep), ("engine", engine_ab)):
        if part in args.parts:  # the record rewritten after each part: a part cut off at a time limit keeps the rest
            data[part] = fn(device, args.preset)
            print(f"wrote {write_record('attention_splits', data, args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
