"""Every RMSNorm launch configuration timed at the issue's size, beside a copy of the same bytes.

``kernels.rmsnorm_bw_frac`` asks for 0.90 of copy bandwidth at [16384, 4096] bf16 (268 MB read + written). This
times each of the autotuner's candidates (rows per program, warps) as CUDA-graph replays, plain and with the
fused residual, next to ``out.copy_(x)`` on the same tensors (the same bytes, no arithmetic). (At e66a969 it also
timed persistent configs -- a few programs per SM striding over the rows, with and without the next block's
loads pipelined: 74-90 us against 69.8 for the best plain one; records/rmsnorm_study.json.)

    python research/rmsnorm_study.py --out /tmp/h200        # records/rmsnorm_study.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from labkit.bench import write_record
from labkit.hardware import measure_copy_bandwidth
from labkit.kernels import rms_norm as rn
from labkit.kernels.common import graph_replay_ms

# beyond the autotuner's candidates (which include streaming stores since ded9987's run): 32 warps
EXTRA_CONFIGS = [triton.Config({"ROWS": r}, num_warps=32) for r in (2, 8)]


def _median(t: list[float]) -> float:
    return sorted(t)[len(t) // 2]


def graph_us(launch, sets: list, reps: int = 10) -> list[float]:
    """Per-launch microseconds of ``launch(w)`` over ``sets`` inside one CUDA graph (>= 32 launches), one sample per
    replay (as research/gemv_study.py times the GEMVs)."""
    per = max(1, -(-32 // len(sets)))
    return [ms * 1e3 / len(sets) for ms in graph_replay_ms(lambda: [launch(w) for w in sets], per, reps)]


def copy_bandwidth(dev) -> float:
    """The notebooks' ceiling (``labkit.hardware.measure_copy_bandwidth``) after ~0.3 s of copies (an idle GPU starts
    at low clocks)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(300):
        b.copy_(a)
    del a, b
    return measure_copy_bandwidth(dev)


def autotuner_picks(rows: int, cols: int, dev, trials: int = 2) -> list[dict]:
    """What the autotuner picks at this size with each timing method: Triton's ``do_bench`` (an L2 flush that
    leaves dirty lines), ``cold_l2_bench`` (clean lines, the GEMVs' autotuner) and ``graph_bench``."""
    from labkit.kernels.common import cold_l2_bench, graph_bench

    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(cols, device=dev, dtype=torch.bfloat16)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    picks = []
    for name, bench in (("do_bench", None), ("cold_l2_bench", cold_l2_bench), ("graph_bench", graph_bench)):
        for trial in range(trials):
            tuned = triton.autotune(rn._CONFIGS, key=["n_cols", "ROWS_KEY", "HAS_RESIDUAL"], do_bench=bench,
                                    prune_configs_by={"early_config_prune": rn._prune})(rn._rms_norm_kernel)
            for residual in (False, True):
                tuned[rn._grid(rows)](x, r, w, out, res_out, rows, cols, cols, cols, cols, cols, 1e-5, 1 << 20,
                                      HAS_RESIDUAL=residual, BLOCK=cols)
                c = tuned.best_config  # set by every call: this call's pick
                picks.append({"bench": name, "trial": trial, "residual": residual,
                              "config": dict(c.kwargs, num_warps=c.num_warps)})
    return picks


def harnesses(rows: int, cols: int, dev) -> list[dict]:
    """The same work timed by notebook 03's harness (``labkit.bench.time_fn``: ``do_bench_cudagraph``) and by this
    script's ``graph_us``: the public wrapper (autotuned pick, a fresh output per call), a direct launch of the
    pick into one output buffer, and a copy of the same bytes."""
    from labkit.bench import time_fn

    x, w = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16), torch.randn(cols, device=dev,
                                                                                   dtype=torch.bfloat16)
    out = torch.empty_like(x)
    rn.rms_norm(x, w, 1e-5)
    pick = rn._rms_norm_tuned.best_config

    def direct():
        rn._rms_norm_kernel[rn._grid(rows)(pick.kwargs)](x, x, w, out, out, rows, cols, cols, cols, cols, cols, 1e-5,
                                                        1 << 20, HAS_RESIDUAL=False, BLOCK=cols, **pick.kwargs,
                                                        num_warps=pick.num_warps)
    found = []
    for name, f in (("wrapper", lambda: rn.rms_norm(x, w, 1e-5)), ("direct", direct), ("copy", lambda: out.copy_(x))):
        for _ in range(2):
            nb = [t * 1e6 for t in time_fn(f, dev, iters=20, cuda_graph=True).samples_s]
            st = graph_us(lambda _, f=f: f(), [None], reps=10)
            found.append({"fn": name, "config": dict(pick.kwargs, num_warps=pick.num_warps),
                          "notebook_harness_us": nb, "graph_us": st,
                          "notebook_median_us": _median(nb), "graph_us_median": _median(st)})
    return found


def sweep(rows: int, cols: int, dev) -> dict:
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.randn(cols, device=dev, dtype=torch.bfloat16)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    bw = copy_bandwidth(dev)
    plain_bytes, fused_bytes = 2 * x.numel() * 2 + 2 * cols, 4 * x.numel() * 2 + 2 * cols
    copy = graph_us(lambda _: out.copy_(x), [None], reps=10)
    rows_out = [{"impl": "copy_same_bytes", "us": copy, "median_us": _median(copy), "bytes": 2 * x.numel() * 2}]
    ref = rn.rms_norm_ref(x.float(), w.float(), 1e-5)
    for c in rn._CONFIGS + EXTRA_CONFIGS:
        cache = c.kwargs.get("STORE_CACHE", "")
        for residual in (False, True):
            def launch(_, c=c, residual=residual):
                rn._rms_norm_kernel[rn._grid(rows)(c.kwargs)](
                    x, r, w, out, res_out, rows, cols, cols, cols, cols, cols, 1e-5, 1 << 20,
                    HAS_RESIDUAL=residual, BLOCK=cols, **c.kwargs, num_warps=c.num_warps)
            try:
                t = graph_us(launch, [None], reps=10)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded
                rows_out.append({"config": dict(c.kwargs, num_warps=c.num_warps, store=cache), "residual": residual,
                                 "error": str(e)[:200]})
                continue
            nbytes = fused_bytes if residual else plain_bytes
            err = None if residual else ((out.float() - ref).norm() / ref.norm()).item()
            rows_out.append({"impl": "triton", "config": dict(c.kwargs, num_warps=c.num_warps, store=cache),
                             "residual": residual, "us": t, "median_us": _median(t), "bytes": nbytes,
                             "bw_frac": nbytes / (_median(t) * 1e-6) / bw, "rel_err": err})
    return {"shape": [rows, cols], "dtype": "bfloat16", "copy_bw_bytes_per_s": bw, "rows": rows_out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for records/rmsnorm_study.json")
    ap.add_argument("--shape", type=int, nargs=2, default=(16384, 4096))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rmsnorm_study needs a CUDA device", file=sys.stderr)
        return 2
    data = sweep(*args.shape, torch.device("cuda"))
    data["harnesses"] = harnesses(*args.shape, torch.device("cuda"))
    for h in data["harnesses"]:
        print(f"{h['fn']:<8} notebook harness {h['notebook_median_us']:7.2f} us, "
              f"graph_us {h['graph_us_median']:7.2f} us  {h['config']}")
    data["autotuner_picks"] = autotuner_picks(*args.shape, torch.device("cuda"))
    for p in data["autotuner_picks"]:
        print(f"autotuner with {p['bench']:<14} trial {p['trial']} residual={p['residual']!s:<5} {p['config']}")
    bw = data["copy_bw_bytes_per_s"]
    cp = data["rows"][0]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; copy of the same bytes {cp['median_us']:.1f} us "
          f"({cp['bytes'] / cp['median_us'] / 1e6 / bw:.3f})")
    for r in sorted((r for r in data["rows"][1:] if "median_us" in r), key=lambda r: (r["residual"], r["median_us"])):
        print(f"residual={r['residual']!s:<5} {r['median_us']:8.2f} us  {r['bw_frac']:.3f}  {r['config']}")
    if args.out:
        print("wrote", write_record("rmsnorm_study", data, out_dir=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
