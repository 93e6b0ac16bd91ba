"""Notebook 03's arithmetic and experiments at tiny sizes on the CPU."""

import torch

from labkit.experiments.kernels.study import FUSION_BYTES, kv_quant_attention, matmul_rates, operator_costs


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
