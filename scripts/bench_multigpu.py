"""Multi-GPU measurements for issue 11: NCCL bandwidth, tensor-parallel decode, pipeline bubble. Run by torchrun.

    # on one host with N GPUs (N = 2, 4 or 8); each section fits in a 10-minute command
    torchrun --standalone --nproc_per_node=N scripts/bench_multigpu.py --sections comm
    torchrun --standalone --nproc_per_node=N scripts/bench_multigpu.py --sections tp \
        --fits results/h200xN/records/multigpu_comm.json
    torchrun --standalone --nproc_per_node=N scripts/bench_multigpu.py --sections pp
    python -m labkit merge results/h200xN results/h200xN     # figures -> results/summary.json

    # smoke test on CPU processes (gloo, tiny random shapes): what tests/test_parallel_multigpu.py runs
    torchrun --standalone --nproc_per_node=2 scripts/bench_multigpu.py --backend gloo --smoke --out /tmp/mg

Writes ``<out>/records/multigpu_<section>.json`` (raw rows, environment) and ``<out>/figures.json``:
``parallel.nccl_allreduce_busbw_gb_s`` (peak all-reduce bus bandwidth on all N GPUs, nccl-tests' definition),
``parallel.tp8_70b_decode_tok_s`` (Llama-3-70B shape, 80 layers, TP 8, batch 1, CUDA-graph replays) and
``parallel.tp_scaling_efficiency`` (step time at TP 1 over TP N times N, batch 1). ``<out>`` defaults to
``results/<gpu>x<N>`` (e.g. ``results/h200x8``).

NVLink multicast (NVLS) stays off: the three variables below are set before torch is imported, and nothing here
calls ``cuMulticastCreate`` (no symmetric memory, no NVLS all-reduce).
"""

from __future__ import annotations

import os

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import labkit  # noqa: E402, F401  (before triton: sets TRITON_INTERPRET on CPU hosts)
from labkit.bench import record_figure, write_record  # noqa: E402
from labkit.data import REPO_ROOT  # noqa: E402
from labkit.experiments.parallelism import multigpu  # noqa: E402
from labkit.parallel.launch import default_backend, init_rank, rank_device  # noqa: E402

SECTIONS = ("comm", "tp", "pp")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="comm,tp,pp", help=f"comma-separated, from {SECTIONS}")
    ap.add_argument("--backend", default=None, choices=("nccl", "gloo"))
    ap.add_argument("--out", default=None, help="output folder (default results/<gpu>x<N>)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU ranks: checks the code paths only")
    ap.add_argument("--fits", default=None, help="multigpu_comm.json whose alpha-beta fits calibrate the TP rows")
    ap.add_argument("--iters", type=int, default=20, help="timed decode steps per configuration")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layers-70b", type=int, default=20, help="depth of the 70B shape for the TP 1..N sweep")
    ap.add_argument("--eager", action="store_true", help="time TP decode without CUDA graphs")
    ap.add_argument("--no-overlap", action="store_true", help="skip the two-communicator overlap measurement")
    a = ap.parse_args(argv)
    a.sections = [s for s in a.sections.split(",") if s]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections {bad} unknown; allowed: {SECTIONS}")
    return a


def default_out(world: int) -> Path:
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    tag = next((k for k in ("h200", "h100", "a100") if k in name), name.replace(" ", "-"))
    return REPO_ROOT / "results" / f"{tag}x{world}"


def plan(a: argparse.Namespace, world: int) -> dict:
    """Sizes per section: full H200 sizes, or tiny ones for ``--smoke``."""
    tp_sizes = [t for t in (1, 2, 4, 8) if t <= world]
    if a.smoke:
        return {"sizes": [2**k for k in range(6, 21, 2)], "comm_iters": 2, "comm_repeats": 2,
                "tp_presets": [("tiny", 2)], "tp_sizes": tp_sizes, "batches": [1, 2], "context": 16,
                "dtype": torch.float32, "pp": dict(preset="tiny", pp_sizes=[2, 4], microbatch_counts=[1, 2],
                                                   microbatch_size=1, seq_len=8, repeats=1, decode_tokens=3,
                                                   dtype=torch.float32), "iters": 2}
    return {"sizes": [2**k for k in range(3, 31, 2)] + [2**30], "comm_iters": 10, "comm_repeats": 3,
            "tp_presets": [("llama-3-8b", None), ("llama-3-70b", a.layers_70b)], "tp_sizes": tp_sizes,
            "batches": [int(b) for b in a.batches.split(",")], "context": a.context, "dtype": torch.bfloat16,
            "pp": dict(preset="llama-3-8b", pp_sizes=[2, 4], microbatch_counts=[1, 2, 4, 8], microbatch_size=4,
                       seq_len=256, repeats=3, decode_tokens=16, dtype=torch.bfloat16), "iters": a.iters}


def main(argv=None) -> int:
    a = parse(argv)
    backend = a.backend or default_backend()
    rank, world = init_rank(backend)
    if world < 2:
        dist.destroy_process_group()
        raise SystemExit(f"WORLD_SIZE={world}: this script measures communication and needs at least 2 ranks")
    device = rank_device()
    p = plan(a, world)
    out = Path(a.out) if a.out else default_out(world)
    lead = rank == 0
    fits = json.loads(Path(a.fits).read_text())["data"]["fits"] if a.fits else None

    if "comm" in a.sections:
        groups = tuple(g for g in (2, 4) if g < world)
        res = multigpu.comm_section(device, p["sizes"], p["comm_iters"], p["comm_repeats"], groups)
        fits = res["fits"]
        if lead:
            rec = write_record("multigpu_comm", dict(res, backend=backend, world_size=world), out)
            ar = [r for r in res["rows"] if r["op"] == "all_reduce" and r["world_size"] == world]
            record_figure(f"parallel.{backend}_allreduce_busbw_gb_s", max(r["busbw_gb_s"] for r in ar), "GB/s", rec,
                          out_dir=out, note=f"peak all-reduce bus bandwidth over {world} ranks, "
                                            f"{min(r['bytes'] for r in ar)}..{max(r['bytes'] for r in ar)} B")

    if "tp" in a.sections:
        def save(rows):
            write_record("multigpu_tp", {"rows": rows, "world_size": world, "fits": fits}, out)

        presets = list(p["tp_presets"])
        rows = multigpu.tp_section(device, presets, p["tp_sizes"], p["batches"], p["context"], p["iters"],
                                   cuda_graph=not a.eager, overlap=not a.no_overlap, fits=fits, on_row=save,
                                   dtype=p["dtype"])
        if not a.smoke and world >= 8:  # the figure's configuration: 70B at full depth, TP 8
            rows += multigpu.tp_section(device, [("llama-3-70b", None)], [8], [1], p["context"], p["iters"],
                                        cuda_graph=not a.eager, overlap=False, fits=fits)
        if lead:
            rec = write_record("multigpu_tp", {"rows": rows, "world_size": world, "fits": fits}, out)
            tp_figures(rows, rec, out)

    if "pp" in a.sections:
        rows = multigpu.pp_section(device, **p["pp"])
        if lead:
            write_record("multigpu_pp", {"rows": rows, "world_size": world}, out)
    dist.barrier()
    dist.destroy_process_group()
    if lead:
        print(f"records and figures in {out}")
    return 0


def tp_figures(rows: list[dict], rec: Path, out: Path) -> None:
    """``parallel.tp8_70b_decode_tok_s`` and ``parallel.tp_scaling_efficiency`` from the TP rows (batch 1)."""
    ok = [r for r in rows if "step_s" in r and r["batch"] == 1]
    full70 = [r for r in ok if r["preset"] == "llama-3-70b" and r["tp"] == 8 and r["layers"] == 80]
    if full70:
        record_figure("parallel.tp8_70b_decode_tok_s", full70[0]["tokens_per_s"], "tokens/s", rec, out_dir=out,
                      note=f"Llama-3-70B shape, random bf16 weights, batch 1, context {full70[0]['context']}, "
                           f"{'CUDA-graph replays' if full70[0]['graph'] else 'eager'}")
    for preset in ("llama-3-70b", "llama-3-8b", "tiny"):
        pr = [r for r in ok if r["preset"] == preset and r["layers"] == min(x["layers"] for x in ok
                                                                             if x["preset"] == preset)]
        tps = {r["tp"]: r["step_s"] for r in pr}
        if 1 in tps and len(tps) > 1:
            n = max(tps)
            record_figure("parallel.tp_scaling_efficiency", tps[1] / (n * tps[n]), "fraction", rec, out_dir=out,
                          note=f"{preset} shape ({pr[0]['layers']} layers), batch 1: t(TP1) / ({n} x t(TP{n}))")
            return


if __name__ == "__main__":
    raise SystemExit(main())
