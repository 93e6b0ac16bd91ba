"""The kernels benchmark runs end to end on the CPU (interpreter) and writes its CSV, record and plot."""

import csv
import json
import math

import pytest
import torch

from labkit.experiments.kernels.bench import (
    BARS,
    SIZES,
    add_fractions,
    bench_gemv,
    fraction_rows,
    headline_figures,
    main,
    plot_fractions,
)
from labkit.hardware import device_name

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


def test_gemv_rows_give_the_headline_figures_and_hold_the_read_floors():
    """One ci-sized GEMV benchmark (the interpreter's run of every GEMV takes a minute, so one run serves both
    checks): the headline figures from its rows, and ``w8_bytes_read`` / ``w4_bytes_read``, a bare read of as many
    bytes as each format's weights, with its figures (the int4 GEMV as a fraction of it; bitsandbytes' time over
    it, NaN without bitsandbytes)."""
    rows = bench_gemv(SIZES["ci"]["gemv"][0], torch.float16, DEVICE, iters=1)
    assert {"dense", "w8_triton", "w8_triton_stationary", "w4_triton"} <= {r["impl"] for r in rows}
    assert all(r["rel_err"] is None or r["rel_err"] < 1e-2 for r in rows)
    figs = headline_figures(add_fractions([dict(r) for r in rows], {"copy_bytes_per_s": 1e10, "matmul_flops": 1e11}),
                            "ci")
    assert set(figs) == set(BARS)
    assert figs["kernels.w8_gemv_speedup_vs_bf16"] > 0 and figs["kernels.w8_stationary_gemv_speedup_vs_bf16"] > 0
    _, k, n = SIZES["ci"]["gemv"][0]
    read = {r["impl"]: r for r in rows if r["impl"].endswith("_bytes_read")}
    assert read["w8_bytes_read"]["bytes"] >= n * k + 2 * n and read["w4_bytes_read"]["bytes"] >= n * k // 2
    assert figs["kernels.w4_gemv_frac_of_read_floor"] > 0
    if DEVICE.type == "cpu":  # no bitsandbytes baseline off CUDA
        assert math.isnan(figs["kernels.w8_vs_bnb_int8"])
        assert math.isnan(figs["kernels.w4_vs_bnb_nf4_at_read_floor"])


def test_bitsandbytes_bound_at_the_datasheet_bandwidth():
    """bitsandbytes' time over labkit's bytes at the vendor's peak: the ratio no kernel on the part can pass."""
    shape = "x".join(map(str, SIZES["gpu"]["gemv"][0]))
    # labkit's int8 GEMV moves 1 GB in 500 us, its int4 GEMV 0.5 GB in 250 us; bitsandbytes takes 1000 us each
    rows = [dict(kernel="gemv", impl="bnb_int8", shape=shape, median_us=1000.0, gb_s=1.0 / 1000e-6),
            dict(kernel="gemv", impl="w8_triton_vs_bnb", shape=shape, median_us=500.0, gb_s=1.0 / 500e-6),
            dict(kernel="gemv", impl="bnb_nf4", shape=shape, median_us=1000.0, gb_s=0.5 / 1000e-6),
            dict(kernel="gemv", impl="w4_triton_vs_bnb", shape=shape, median_us=250.0, gb_s=0.5 / 250e-6)]
    ceilings = {"copy_bytes_per_s": 4e12, "matmul_flops": 1e15, "datasheet_bytes_per_s": 5e12}
    figs = headline_figures(add_fractions([dict(r) for r in rows], ceilings), "gpu")
    # 1 GB at 5 TB/s takes 200 us: 1000 / 200; 0.5 GB takes 100 us: 1000 / 100
    assert figs["kernels.w8_vs_bnb_int8_at_datasheet_bw"] == pytest.approx(5.0)
    assert figs["kernels.w4_vs_bnb_nf4_at_datasheet_bw"] == pytest.approx(10.0)
    assert figs["kernels.w8_vs_bnb_int8_at_copy_bw"] == pytest.approx(4.0)
    measured_only = {"copy_bytes_per_s": 4e12, "matmul_flops": 1e15}
    no_sheet = headline_figures(add_fractions([dict(r) for r in rows], measured_only), "gpu")
    assert math.isnan(no_sheet["kernels.w8_vs_bnb_int8_at_datasheet_bw"])


def test_flash_against_both_sdpa_backends_and_the_fractions_plot():
    """``kernels.flash_attn_vs_cudnn`` names SDPA's cuDNN backend (Hopper's default) beside the flash-backend
    ratio; the summary plot is one panel of fractions of the hardware limit at the headline sizes."""
    import matplotlib

    matplotlib.use("Agg")
    shape = "x".join(map(str, SIZES["gpu"]["flash"][0]))
    rows = [dict(kernel="flash", impl="triton", shape=shape, median_us=1200.0, tflop_s=457.0),
            dict(kernel="flash", impl="sdpa_flash", shape=shape, median_us=1700.0, tflop_s=321.0),
            dict(kernel="flash", impl="sdpa_cudnn", shape=shape, median_us=950.0, tflop_s=576.0)]
    figs = headline_figures(add_fractions([dict(r) for r in rows], {"copy_bytes_per_s": 4e12, "matmul_flops": 8e14}),
                            "gpu")
    assert figs["kernels.flash_attn_vs_sdpa"] == pytest.approx(1700 / 1200)
    assert figs["kernels.flash_attn_vs_cudnn"] == pytest.approx(950 / 1200)
    fr = fraction_rows(add_fractions([dict(r) for r in rows], {"copy_bytes_per_s": 4e12, "matmul_flops": 8e14}),
                       "gpu")
    assert {r["impl"] for r in fr} == {"triton", "sdpa_flash", "sdpa_cudnn"}
    assert fr[0]["frac_of_ceiling"] == pytest.approx(457 / 800)
    ax = plot_fractions(add_fractions(rows, {"copy_bytes_per_s": 4e12, "matmul_flops": 8e14}), "gpu")
    assert len(ax.figure.axes) == 1
