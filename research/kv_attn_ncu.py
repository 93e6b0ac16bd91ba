"""What do Nsight Compute's counters say binds the int8 KV decode-attention kernel, against the bf16 one?

The ladder of ``kv_quant_decode_study.py`` (H100 at 0518b54) left int8 at 1.12x bf16 (84.4 against 94.2 us, batch 16,
context 4096, 32/8 heads of 128) with no rung past 1.15x, and without any scale load only 1.18x: neither the scales,
occupancy nor the grid binds, so the question goes to the counters (issue slots, stall reasons, achieved occupancy,
DRAM throughput) of the product kernel on each cache. This driver autotunes both first, then brackets one call of
each with ``cudaProfilerStart``/``Stop``; ncu profiles only those (``--profile-from-start off``):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --csv \\
        python research/kv_attn_ncu.py > $OUT/kv_attn_ncu.csv

(``scripts/gpu_studies.sh ncu`` runs exactly that.) ``--device cpu`` checks the driver on the interpreter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# isort: off
import labkit  # noqa: F401  (first: on a CPU-only host it sets TRITON_INTERPRET before triton is imported)
# isort: on
import torch
from kv_quant_decode_study import MAIN_CONTEXT, TINY_SHAPE, Case, product_call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    case = Case(MAIN_CONTEXT, device, pools=1) if device.type == "cuda" else Case(70, device, TINY_SHAPE, pools=1)
    for fmt in ("bf16", "int8", "fp8"):  # autotune and warm each outside the profiled range
        for _ in range(3):
            product_call(case, fmt, case.pools[fmt][0])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for fmt in ("bf16", "int8", "fp8"):  # one profiled call each, in this order (the CSV's launch order)
        out = product_call(case, fmt, case.pools[fmt][0])
        err = float((out.float() - case.ref[fmt]).norm() / case.ref[fmt].norm())
        print(f"{fmt}: rel err {err:.2e}", file=sys.stderr)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
