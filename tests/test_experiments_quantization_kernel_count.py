"""Kernels per step and per layer by name (notebook 04's FP8 explanation), and the step split that sums to the
timed step (its breakdown plot)."""

import pytest
import torch

from labkit.experiments.quantization.compare import step_parts
from labkit.experiments.quantization.kernel_count import count_summary, kernel_counts, linear_ops
from labkit.quant.fp8 import Fp8Linear


def test_fp8_linear_quantises_its_activations_in_separate_ops():
    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 48, bias=False)
    assert linear_ops(dense) == ["aten::linear"]
    ops = linear_ops(Fp8Linear.from_linear(dense, backend="scaled_mm"))
    assert "aten::_scaled_mm" in ops and {"aten::abs", "aten::amax", "aten::clamp"} <= set(ops)
    assert ops.index("aten::amax") < ops.index("aten::_scaled_mm")  # the activation scale comes first
    assert len(ops) >= 8  # cast, abs, amax, divide, clamp, divide, clamp, cast to e4m3, then the GEMM


def test_kernel_counts_per_layer():
    layers = [torch.nn.Linear(32, 32) for _ in range(3)]
    x = torch.randn(2, 32)

    def step():
        h = x
        for layer in layers:
            h = torch.relu(layer(h))
        return h

    rows = kernel_counts(step, layers=3, steps=2)
    by = {r["kernel"]: r for r in rows}
    assert by["aten::relu"]["calls_per_step"] == 3 and by["aten::relu"]["calls_per_layer"] == 1
    summary = count_summary(rows, layers=3)
    assert summary["kernels_per_step"] == pytest.approx(sum(r["calls_per_step"] for r in rows))
    assert summary["kernels_per_layer"] == pytest.approx(summary["kernels_per_step"] / 3)
    with pytest.raises(ValueError, match="layers=0"):
        kernel_counts(step, layers=0)


def test_step_parts_sum_to_the_timed_step():
    # summed kernel time (12 ms) above the timed step (10 ms): overlap and profiler slow-down must not stack past it
    row = {"decode_ms": 10.0, "breakdown": {"device_us_per_step": 12000.0, "busy_us_per_step": 11000.0,
                                            "category_us_per_step": {"matmul": 9000.0, "attention": 3000.0}}}
    parts = step_parts(row)
    assert sum(parts.values()) == pytest.approx(10.0) and parts["between kernels"] == 0
    assert parts["matmul"] / parts["attention"] == pytest.approx(3.0)
    row["breakdown"]["busy_us_per_step"] = 6000.0
    parts = step_parts(row)
    assert sum(parts.values()) == pytest.approx(10.0) and parts["between kernels"] == pytest.approx(4.0)
