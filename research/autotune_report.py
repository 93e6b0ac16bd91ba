"""Every autotuned candidate's time for the GEMVs and RMSNorm at the issue's shapes, on the GPU at hand.

The autotuner keeps only its winner; this prints and records all of them (``Autotuner.configs_timings``), so that
the next change to a kernel's tiles starts from what each candidate measured rather than from a guess.

    python research/autotune_report.py --out results/h200
"""

from __future__ import annotations

import argparse
import sys

import torch

from labkit.bench import write_record
from labkit.kernels import rms_norm as rn
from labkit.kernels.quantized_matmul import splitk, w8a16_matmul
from labkit.quant.weight_only import quantize_int4, quantize_int8

SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 6144), (4096, 28672))


def _timings(tuner) -> list[dict]:
    rows = []
    for cfg, t in sorted(tuner.configs_timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1]):
        t0 = t[0] if isinstance(t, list) else t
        rows.append({"config": str(cfg), "us": t0 * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", nargs="+", choices=("gemv", "rms_norm"), default=("gemv", "rms_norm"),
                    help="which kernels' candidates to time (the GEMVs take about a minute to tune)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("autotune_report needs a CUDA device", file=sys.stderr)
        return 2
    out = []
    for k, n in SHAPES if "gemv" in args.kernels else ():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        q, s = quantize_int8(w)
        w8a16_matmul(x, q, s)  # a bare int8 product: the autotuned split-K GEMV
        out.append({"kernel": "w8_gemv", "N": n, "K": k, "candidates": _timings(splitk._w8_gemv_tuned)})
        p, sc, z = quantize_int4(w, 128)
        # the split-K int4 GEMV itself (the public w4a16_matmul takes the stationary one at these shapes)
        splitk.splitk_gemv(x, n, 4, (p.view(torch.int32), sc, z), (k // 8, k // 128, k // 128, 0x4F000000),
                           {"GROUP": 128, "HALF_MATH": 1}, None)
        out.append({"kernel": "w4_gemv", "N": n, "K": k, "candidates": _timings(splitk._w4_gemv_tuned)})
        for r in out[-2:]:
            best = r["candidates"][0]
            print(f"{r['kernel']} {k}->{n}: best {best['us']:.2f} us {best['config']}; "
                  f"{len(r['candidates'])} candidates, worst {r['candidates'][-1]['us']:.2f} us", flush=True)
    for residual in (False, True) if "rms_norm" in args.kernels else ():
        x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
        wt = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        rn.rms_norm(x, wt, residual=torch.randn_like(x) if residual else None)
        rows = _timings(rn._rms_norm_tuned)
        out.append({"kernel": "rms_norm", "residual": residual, "rows": 16384, "cols": 4096, "candidates": rows})
        print(f"rms_norm residual={residual}: " + ", ".join(f"{r['config']} {r['us']:.1f} us" for r in rows))
    print("wrote", write_record("autotune_report", {"results": out}, out_dir=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
