"""The kernels benchmark runs end to end on the CPU (interpreter) and writes its CSV, record and plot."""

import csv
import json
import math

import torch

from labkit.hardware import device_name
from labkit.kernels.bench import BARS, SIZES, add_fractions, bench_gemv, headline_figures, main

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DEVICE_NAME = device_name(DEVICE)


def test_bench_main_writes_csv_record_and_plot(tmp_path):
    assert main(["--profile", "ci", "--only", "rmsnorm", "paged", "--iters", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "records" / "kernels_bench.csv").open()))
    assert {r["kernel"] for r in rows} == {"rmsnorm", "paged"}
    assert {"triton", "eager"} <= {r["impl"] for r in rows if r["kernel"] == "rmsnorm"}
    rec = json.loads((tmp_path / "records" / "kernels_bench.json").read_text())
    assert rec["env"]["device"] == DEVICE_NAME and rec["data"]["ceilings"]["copy_bytes_per_s"] > 0
    triton_rows = [r for r in rec["data"]["rows"] if r["impl"] == "triton"]
    assert all(r["rel_err"] < 1e-2 and r["frac_of_ceiling"] > 0 for r in triton_rows)
    assert (tmp_path / "plots" / "kernels_bench.png").exists()


def test_headline_figures_from_gemv_rows():
    rows = bench_gemv(SIZES["ci"]["gemv"][0], torch.float16, DEVICE, iters=1)
    assert {"dense", "w8_triton", "w8_triton_stationary", "w4_triton"} <= {r["impl"] for r in rows}
    assert all(r["rel_err"] is None or r["rel_err"] < 1e-2 for r in rows)
    figs = headline_figures(add_fractions(rows, {"copy_bytes_per_s": 1e10, "matmul_flops": 1e11}), "ci")
    assert set(figs) == set(BARS)
    assert figs["kernels.w8_gemv_speedup_vs_bf16"] > 0 and figs["kernels.w8_stationary_gemv_speedup_vs_bf16"] > 0
    if DEVICE.type == "cpu":  # no bitsandbytes baseline off CUDA
        assert math.isnan(figs["kernels.w8_vs_bnb_int8"])
