"""Notebook 03's arithmetic and experiments at tiny sizes on the CPU."""

import torch

from labkit.experiments.kernels.study import (
    FUSION_BYTES,
    INT8_ATTN_SHAPE,
    int8_attention_speedup,
    kv_quant_attention,
    matmul_rates,
    norm_sweep,
    operator_costs,
    plot_bandwidth,
)


def test_operator_costs_bounds():
    rows = {r["operator"]: r for r in operator_costs("llama-3-8b", bandwidth=4.27e12, peak_flops=799e12)}
    assert rows["RMSNorm"]["bound"] == "memory" and rows["attention prefill (flash)"]["bound"] == "compute"
    assert rows["attention decode (paged)"]["bound"] == "memory"
    gemv16, gemv4 = rows["linear 4096x14336, batch 1 (bf16)"], rows["linear 4096x14336, batch 1 (int4)"]
    assert abs(gemv16["predicted_us"] / gemv4["predicted_us"] - 4) < 1e-9  # bytes / bandwidth
    assert abs(gemv16["MB"] - 4096 * 14336 * 2 / 1e6) < 1e-6


def test_fusion_bytes_never_favour_eager():
    assert all(v["eager"] >= v["fused"] for v in FUSION_BYTES.values())
    assert FUSION_BYTES["rmsnorm"]["eager"] / FUSION_BYTES["rmsnorm"]["fused"] == 9


def test_matmul_rates_cpu():
    rows = matmul_rates(n=64, device="cpu", iters=1)
    assert [r["matmul"] for r in rows] == ["fp32 (CUDA cores)", "bf16 (Tensor Cores)"]
    assert all(r["TFLOP/s"] > 0 for r in rows)


def test_kv_quant_attention_rows():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = kv_quant_attention(2, 4, 2, 32, 40, device=device, dtype=torch.float16, iters=1)
    assert rows[1]["cache MB read"] < rows[0]["cache MB read"] < rows[2]["cache MB read"]
    assert rows[0]["rel_err vs bf16"] == 0 and all(r["rel_err vs bf16"] < 2e-2 for r in rows)


def test_int8_attention_speedup_is_bf16_time_over_int8_time():
    rows = [{"attention": "bf16 cache", "us": 30.0}, {"attention": "int8 cache, dequantised in the kernel", "us": 20.0},
            {"attention": "int8 cache, dequantised first", "us": 90.0}]
    assert int8_attention_speedup(rows) == 1.5
    assert INT8_ATTN_SHAPE == {"seqs": 16, "heads": 32, "kv_heads": 8, "head_dim": 128, "context": 4096}


def test_norm_sweep_rows_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    rows = norm_sweep([3, 7], 96, torch.float16, "cpu", iters=1)
    assert {r["rows"] for r in rows} == {3, 7}
    assert {"triton_fused_residual", "eager_add_then_norm"} <= {r["impl"] for r in rows}
    assert all(r["gb_s"] > 0 for r in rows)
    fused = [r for r in rows if r["impl"] == "triton_fused_residual"]
    assert all(r["bytes"] == 4 * r["rows"] * 96 * 2 + 96 * 2 for r in fused)  # read x, r; write out, residual
    ax = plot_bandwidth(rows, ceiling_gb_s=10.0)
    assert len(ax.get_lines()) >= 3  # two implementations at least and the ceiling
