"""Benchmarks of labkit's Triton kernels against torch eager, ``torch.compile``, SDPA and bitsandbytes.

Each case times every implementation on the same inputs, the same way (``labkit.bench.time_fn``: CUDA-event
medians with L2 flushed, or CUDA-graph replays for launches of tens of microseconds, on both sides; the GEMVs
cycle through several weight sets so that no implementation is timed out of the L2 cache), and
reports achieved bandwidth (memory-bound kernels) or FLOP/s (attention) as a fraction of the ceilings
measured on the same device. The cases are in ``cases`` (memory-bound kernels, attention) and ``gemv``;
``headline_figures`` turns the rows at the issue's sizes into the ``kernels.*`` figures. ``python -m labkit bench
kernels`` runs ``main``; on the CPU the kernels run through Triton's interpreter, so the numbers there time Python,
not the kernels -- the sweep still checks every path.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import torch

from labkit.bench import write_record
from labkit.experiments.kernels.cases import (
    bench_flash,
    bench_paged,
    bench_rmsnorm,
    bench_rope,
    bench_softmax,
    bench_swiglu,
)
from labkit.experiments.kernels.gemv import bench_gemv

KERNELS = ("rmsnorm", "swiglu", "rope", "softmax", "flash", "paged", "gemv")
# (shape tuples per kernel): rmsnorm/softmax (rows, cols); swiglu (rows, d); rope (tokens, heads, kv_heads,
# head_dim); flash (batch, heads, kv_heads, seq, head_dim); paged (seqs, heads, kv_heads, head_dim, block,
# context); gemv (rows, in K, out N). The first gpu entry of each is the headline size. The ci GEMV is
# 128 outputs wide: the interpreter's time grows with the programs launched (N = 384 took 26 s of CI, 128 takes 8).
SIZES = {
    "ci": dict(rmsnorm=[(37, 256)], swiglu=[(37, 192)], rope=[(29, 4, 2, 64)], softmax=[(37, 300)],
               flash=[(1, 4, 2, 64, 64)], paged=[(3, 4, 2, 64, 16, 100)], gemv=[(1, 256, 128)]),
    "cpu": dict(rmsnorm=[(256, 1024), (1024, 1024)], swiglu=[(256, 1024)], rope=[(256, 8, 2, 64)],
                softmax=[(256, 1024), (64, 10000)], flash=[(1, 4, 2, 256, 64)], paged=[(4, 8, 2, 64, 16, 512)],
                gemv=[(1, 1024, 2048), (8, 1024, 2048)]),
    "gpu": dict(rmsnorm=[(16384, 4096), (4096, 4096), (1024, 4096), (16384, 8192)],
                swiglu=[(4096, 14336), (1024, 14336), (16384, 14336)],
                rope=[(16384, 32, 8, 128), (4096, 32, 8, 128), (1024, 32, 8, 128)],
                softmax=[(4096, 4096), (4096, 16384), (1024, 65536)],
                flash=[(4, 32, 8, 4096, 128), (4, 32, 8, 1024, 128), (4, 32, 8, 2048, 128)],
                paged=[(32, 32, 8, 128, 16, 4096), (32, 32, 8, 128, 16, 1024), (1, 32, 8, 128, 16, 32768)],
                gemv=[(1, 4096, 14336), (1, 14336, 4096), (1, 4096, 4096), (16, 4096, 14336)]),
}
BARS = {"kernels.rmsnorm_bw_frac": ">= 0.90", "kernels.rmsnorm_speedup_vs_eager": ">= 5",
        # no bar: the headline ratios of the elementwise kernels, over torch.compile of the same HF expressions
        # (labkit.headlines); the eager ratios are their footnotes
        "kernels.rmsnorm_speedup_vs_compile": None, "kernels.swiglu_speedup_vs_compile": None,
        "kernels.rope_speedup_vs_compile": None, "kernels.swiglu_speedup_vs_eager": None,
        "kernels.rope_speedup_vs_eager": None,
        "kernels.swiglu_bw_frac": ">= 0.85", "kernels.rope_bw_frac": ">= 0.80",
        "kernels.flash_attn_vs_sdpa": ">= 0.80", "kernels.paged_attn_bw_frac": ">= 0.75",
        # against SDPA's cuDNN backend, its default on Hopper (the headline); recorded where cuDNN attention runs
        "kernels.flash_attn_vs_cudnn": ">= 0.95",
        "kernels.w8_gemv_speedup_vs_bf16": ">= 1.7", "kernels.w4_gemv_speedup_vs_bf16": ">= 2.5",
        "kernels.w8_vs_bnb_int8": ">= 3", "kernels.w4_vs_bnb_nf4": ">= 3",
        # no bar: the most the bitsandbytes ratios can reach, labkit's GEMV reading its bytes at copy bandwidth
        "kernels.w8_vs_bnb_int8_at_copy_bw": None, "kernels.w4_vs_bnb_nf4_at_copy_bw": None,
        # no bar: the same at the datasheet's peak bandwidth, a bound no kernel on the part can pass
        "kernels.w8_vs_bnb_int8_at_datasheet_bw": None, "kernels.w4_vs_bnb_nf4_at_datasheet_bw": None,
        # no bar: the stationary int8 GEMV (the engine's fused int8 layers) against bf16, beside the split-K one
        "kernels.w8_stationary_gemv_speedup_vs_bf16": None,
        # no bar: against a kernel that only reads the same bytes (stream_read: launch, latency and tail
        # included), the int4 GEMV's time as a fraction, and the bitsandbytes ratios a GEMV that fast would reach
        "kernels.w4_gemv_frac_of_read_floor": None, "kernels.w8_vs_bnb_int8_at_read_floor": None,
        "kernels.w4_vs_bnb_nf4_at_read_floor": None}


BENCHES = {"rmsnorm": bench_rmsnorm, "swiglu": bench_swiglu, "rope": bench_rope, "softmax": bench_softmax,
           "flash": bench_flash, "paged": bench_paged, "gemv": bench_gemv}


def add_fractions(rows: list[dict], ceilings: dict) -> list[dict]:
    """Fraction of the measured ceiling: bandwidth for memory-bound rows, matmul FLOP/s for attention; memory-bound
    rows also get ``frac_of_datasheet_bw`` where ``ceilings`` holds the datasheet's peak bandwidth."""
    for r in rows:
        if r["kernel"] == "flash":
            r["frac_of_ceiling"] = 1e12 * r["tflop_s"] / ceilings["matmul_flops"]
        else:
            r["frac_of_ceiling"] = 1e9 * r["gb_s"] / ceilings["copy_bytes_per_s"]
            if ceilings.get("datasheet_bytes_per_s"):
                r["frac_of_datasheet_bw"] = 1e9 * r["gb_s"] / ceilings["datasheet_bytes_per_s"]
    return rows


def run_sweep(profile: str, kernels=KERNELS, dtype: torch.dtype | None = None, compile_: bool = False,
              device=None, iters: int | None = None) -> list[dict]:
    """Every size of ``SIZES[profile]`` for the chosen kernels; bfloat16 on CUDA, float16 on the CPU."""
    from tqdm.auto import tqdm

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float16)
    jobs = [(kname, shape) for kname in kernels for shape in SIZES[profile][kname]]
    rows = []
    for kname, shape in tqdm(jobs, desc="kernels", unit="case"):
        kw = {"iters": iters} if iters else {}
        rows += BENCHES[kname](shape, dtype, device, compile_=compile_, **kw)
    return rows


def pick_row(rows: list[dict], kernel: str, impl: str, shape: str | None = None) -> dict | None:
    """The first row of ``kernel`` / ``impl`` (at ``shape``, written like ``16384x4096``), or None."""
    for r in rows:
        if r["kernel"] == kernel and r["impl"] == impl and (shape is None or r["shape"] == shape):
            return r
    return None


def headline_figures(rows: list[dict], profile: str) -> dict[str, float]:
    """The issue's ``kernels.*`` figures from rows at the first (headline) size of each kernel."""
    head = {k: "x".join(map(str, v[0])) for k, v in SIZES[profile].items()}
    figs = {}

    def ratio(kernel, slow, fast):
        a, b = pick_row(rows, kernel, slow, head[kernel]), pick_row(rows, kernel, fast, head[kernel])
        return a["median_us"] / b["median_us"] if a and b else math.nan

    def frac(kernel, impl="triton", key="frac_of_ceiling"):
        r = pick_row(rows, kernel, impl, head[kernel])
        return r.get(key, math.nan) if r else math.nan

    figs["kernels.rmsnorm_bw_frac"] = frac("rmsnorm")
    figs["kernels.rmsnorm_speedup_vs_eager"] = ratio("rmsnorm", "eager", "triton")
    for k in ("rmsnorm", "swiglu", "rope"):  # the headlines: over torch.compile (NaN where it did not run)
        figs[f"kernels.{k}_speedup_vs_compile"] = ratio(k, "torch_compile", "triton")
    figs["kernels.swiglu_speedup_vs_eager"] = ratio("swiglu", "eager", "triton")
    figs["kernels.rope_speedup_vs_eager"] = ratio("rope", "eager", "triton")
    figs["kernels.swiglu_bw_frac"] = frac("swiglu")
    figs["kernels.rope_bw_frac"] = frac("rope")
    figs["kernels.flash_attn_vs_sdpa"] = ratio("flash", "sdpa_flash" if profile == "gpu" else "sdpa", "triton")
    figs["kernels.flash_attn_vs_cudnn"] = ratio("flash", "sdpa_cudnn", "triton")  # NaN where cuDNN did not run
    figs["kernels.paged_attn_bw_frac"] = frac("paged")
    dense = "bf16" if profile == "gpu" else "dense"
    figs["kernels.w8_gemv_speedup_vs_bf16"] = ratio("gemv", dense, "w8_triton")
    figs["kernels.w4_gemv_speedup_vs_bf16"] = ratio("gemv", dense, "w4_triton")
    figs["kernels.w8_stationary_gemv_speedup_vs_bf16"] = ratio("gemv", dense, "w8_triton_stationary")
    figs["kernels.w8_vs_bnb_int8"] = ratio("gemv", "bnb_int8", "w8_triton_vs_bnb")
    figs["kernels.w4_vs_bnb_nf4"] = ratio("gemv", "bnb_nf4", "w4_triton_vs_bnb")
    # bitsandbytes' time over the time labkit's GEMV would take at the copy ceiling (its bytes / bandwidth): a
    # ratio above this needs a GEMV faster than the bandwidth it must read its weights at
    figs["kernels.w8_vs_bnb_int8_at_copy_bw"] = figs["kernels.w8_vs_bnb_int8"] / frac("gemv", "w8_triton_vs_bnb")
    figs["kernels.w4_vs_bnb_nf4_at_copy_bw"] = figs["kernels.w4_vs_bnb_nf4"] / frac("gemv", "w4_triton_vs_bnb")
    # and at the vendor's peak bandwidth, which no kernel on this part exceeds
    figs["kernels.w8_vs_bnb_int8_at_datasheet_bw"] = (figs["kernels.w8_vs_bnb_int8"]
                                                      / frac("gemv", "w8_triton_vs_bnb", "frac_of_datasheet_bw"))
    figs["kernels.w4_vs_bnb_nf4_at_datasheet_bw"] = (figs["kernels.w4_vs_bnb_nf4"]
                                                     / frac("gemv", "w4_triton_vs_bnb", "frac_of_datasheet_bw"))
    # and at the time a kernel that only reads those bytes takes here, launch and tail included
    figs["kernels.w4_gemv_frac_of_read_floor"] = ratio("gemv", "w4_bytes_read", "w4_triton")
    figs["kernels.w8_vs_bnb_int8_at_read_floor"] = ratio("gemv", "bnb_int8", "w8_bytes_read")
    figs["kernels.w4_vs_bnb_nf4_at_read_floor"] = ratio("gemv", "bnb_nf4", "w4_bytes_read")
    return figs


BASELINE_IMPLS = ("eager", "eager_add_then_norm", "torch_compile", "sdpa", "sdpa_flash", "sdpa_cudnn",
                  "sdpa_contiguous", "bf16", "dense")


OURS = ("triton", "w4_triton")  # labkit's kernel in each case (the GEMV case: int4, against cuBLAS bf16)


def fraction_rows(rows: list[dict], profile: str) -> list[dict]:
    """At each kernel's headline size (the first of ``SIZES[profile]``): labkit's Triton kernel and each torch /
    cuBLAS / SDPA baseline as a fraction of the hardware limit (``frac_of_ceiling``: copy bandwidth for the
    memory-bound kernels, bf16 matmul rate for prefill attention)."""
    head = {k: "x".join(map(str, v[0])) for k, v in SIZES[profile].items()}
    out = []
    for r in rows:
        if r["shape"] != head.get(r["kernel"]) or r.get("frac_of_ceiling") is None:
            continue
        if r["impl"] in OURS or r["impl"] in BASELINE_IMPLS:
            out.append({"kernel": r["kernel"], "impl": r["impl"], "frac_of_ceiling": r["frac_of_ceiling"],
                        "median_us": r["median_us"]})
    return out


def plot_fractions(rows: list[dict], profile: str, ax=None, title: str | None = None):
    """One panel: each kernel at its headline size, labkit's Triton kernel beside its fastest baseline (named in
    the label), as a fraction of the hardware limit (1.0 = the measured copy bandwidth or bf16 matmul rate).
    Returns the axes."""
    import matplotlib.pyplot as plt

    fr = fraction_rows(rows, profile)
    kernels = list(dict.fromkeys(r["kernel"] for r in fr))
    if ax is None:
        ax = plt.subplots(figsize=(8, 0.6 * len(kernels) + 1.5))[1]
    ours, best, labels = [], [], []
    for k in kernels:
        mine = [r for r in fr if r["kernel"] == k and r["impl"] in OURS]
        base = min((r for r in fr if r["kernel"] == k and r["impl"] not in OURS), key=lambda r: r["median_us"],
                   default=None)
        ours.append(mine[0]["frac_of_ceiling"] if mine else math.nan)
        best.append(base["frac_of_ceiling"] if base else math.nan)
        name = f"{k} {mine[0]['impl'][:2]}" if mine and mine[0]["impl"] != "triton" else k
        labels.append(f"{name}\n(vs {base['impl']})" if base else name)
    ys = range(len(kernels))
    ax.barh([y - 0.2 for y in ys], ours, height=0.4, label="labkit (Triton)")
    ax.barh([y + 0.2 for y in ys], best, height=0.4, label="fastest baseline")
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xlabel("fraction of the hardware limit (copy bandwidth; bf16 matmul rate for flash)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title or "each kernel at its headline size")
    return ax


def plot_rows(rows: list[dict], out_dir: Path | None = None, show: bool = False, profile: str = "gpu") -> list[Path]:
    """``plot_fractions`` as one figure (written to ``out_dir/kernels_bench.png`` when given)."""
    import matplotlib

    if not show:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot_fractions(rows, profile)
    fig = ax.figure
    fig.tight_layout()
    paths = []
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        paths.append(Path(out_dir) / "kernels_bench.png")
        fig.savefig(paths[0], dpi=120)
    if show:
        plt.show()
    plt.close(fig)
    return paths


def write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for r in rows for key in r)))  # every row's keys
        w.writeheader()
        w.writerows(rows)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit bench kernels [--profile ...] [--only rmsnorm flash ...] [--compile] [--out DIR]``."""
    from labkit.bench import output_dir
    from labkit.hardware import measure_ceilings
    from labkit.workbook import resolve_profile

    ap = argparse.ArgumentParser(prog="python -m labkit bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="auto", help="ci, cpu, gpu or auto (sizes of SIZES[profile])")
    ap.add_argument("--only", nargs="*", default=None, help=f"kernels to run; allowed: {' '.join(KERNELS)}")
    ap.add_argument("--compile", action="store_true", help="add torch.compile rows (CUDA only)")
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions per implementation")
    ap.add_argument("--out", default=None, help="output folder (default $LABKIT_OUT or out/local)")
    args = ap.parse_args(argv)
    profile = resolve_profile(args.profile)
    kernels = tuple(args.only or KERNELS)
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        ap.error(f"--only {unknown} unknown; allowed: {list(KERNELS)}")
    out = Path(args.out) if args.out else output_dir()
    t0 = time.perf_counter()
    ceilings = measure_ceilings()
    rows = add_fractions(run_sweep(profile, kernels, compile_=args.compile, iters=args.iters), ceilings)
    figures = headline_figures(rows, profile) if set(kernels) == set(KERNELS) else {}
    csv_path = write_csv(rows, out / "records" / "kernels_bench.csv")
    rec = write_record("kernels_bench", {"profile": profile, "ceilings": ceilings, "rows": rows,
                                         "figures": figures, "bars": BARS, "csv": csv_path,
                                         "seconds": time.perf_counter() - t0}, out_dir=out)
    plot_rows(rows, out / "plots", profile=profile)
    for r in rows:
        print(f"{r['kernel']:8s} {r['impl']:24s} {r['shape']:22s} {r['median_us']:10.1f} us "
              f"{r['gb_s']:8.1f} GB/s {r['tflop_s']:7.1f} TFLOP/s  {r['frac_of_ceiling']:.2f} of ceiling")
    for name, v in figures.items():
        print(f"{name:36s} {v:8.3f}   bar {BARS[name] or '-'}")
    print(f"wrote {rec} and {csv_path}")
    return 0
