import math

import pytest
import torch

from labkit.experiments.quantization import precision as P


def test_matmul_rates_rows():
    rows = {r["dtype"]: r for r in P.dtype_matmul_rates(64, dtypes=("fp32", "tf32", "bf16", "int8"), iters=2)}
    for name in ("fp32", "bf16", "int8"):
        assert rows[name]["status"].startswith("ok") and rows[name]["tflops"] > 0
    if not torch.cuda.is_available():
        assert rows["tf32"]["tflops"] is None and "CUDA" in rows["tf32"]["status"]


def test_matmul_rates_bad_input():
    with pytest.raises(ValueError, match="allowed"):
        P.dtype_matmul_rates(64, dtypes=("fp64",))
    with pytest.raises(ValueError, match="multiple of 16"):
        P.dtype_matmul_rates(100)


def test_bf16_keeps_fp32_range_and_fp16_does_not():
    limits = {r["dtype"]: r for r in P.dtype_limits()}
    assert limits["fp16"]["max"] == 65504 and limits["bf16"]["max"] > 3e38
    assert limits["bf16"]["mantissa_bits"] == 7 and limits["fp16"]["mantissa_bits"] == 10
    for r in P.overflow_rows():
        assert r["overflow"] == (r["dtype"] == "fp16"), r
        if r["dtype"] == "bf16":
            assert r["rel_error"] < 1e-2


def test_running_sum_stagnates_at_two_to_the_mantissa():
    ones = torch.ones(3000, 2)
    assert torch.all(P.running_sum(ones.bfloat16(), torch.bfloat16) == 256)   # 2^(7+1)
    assert torch.all(P.running_sum(ones.half(), torch.float16) == 2048)       # 2^(10+1)
    assert torch.all(P.running_sum(ones.bfloat16(), torch.float32) == 3000)   # fp32 accumulator: exact


def test_accumulation_rows():
    rows = {(r["n"], r["dtype"]): r for r in P.accumulation_rows(lengths=(1024,), batch=8)}
    assert rows[1024, "bf16"]["naive_rel_error"] > 0.1
    assert rows[1024, "bf16"]["fp32_acc_rel_error"] < 1e-3
    assert rows[1024, "fp32"]["naive_rel_error"] < 1e-5


def test_softmax_and_rmsnorm_rows():
    sm = {(r["logit_std"], r["dtype"]): r for r in P.softmax_rows(logit_scales=(1.0, 20.0), n=512)}
    assert math.isinf(sm[20.0, "fp16"]["naive"]) and sm[20.0, "fp16"]["stable"] < 1e-2
    assert all(r["upcast"] < 1e-2 for r in sm.values())
    rn = {(r["magnitude"], r["dtype"]): r for r in P.rmsnorm_rows(magnitudes=(1.0, 100.0), hidden=512)}
    assert rn[100.0, "fp16"]["naive"] > 0.5  # mean of squares overflowed: the output collapsed
    assert all(r["upcast"] < 1e-2 for r in rn.values())


def test_perplexity_by_dtype():
    ppl = P.perplexity_by_dtype(("fp32", "bf16"), seq_len=64, max_windows=2)
    assert abs(ppl["bf16"] / ppl["fp32"] - 1) < 0.02
    with pytest.raises(ValueError, match="allowed"):
        P.perplexity_by_dtype(("int8",))


def test_precision_figures_from_the_rows():
    acc = P.accumulation_rows(lengths=(64, 512), batch=4)
    figs = P.precision_figures(P.overflow_rows(), acc, [{"dtype": "fp32", "ppl change": 0.0},
                                                        {"dtype": "bf16", "ppl change": -2e-4}])
    assert figs["quant.overflow_cases"] == 3 and figs["quant.fp16_overflow_cases"] == 3
    assert figs["quant.bf16_overflow_cases"] == 0 and figs["quant.accum_terms"] == 512
    assert figs["quant.bf16_accum_rel_err"] > 100 * figs["quant.bf16_fp32_accum_rel_err"]
    assert figs["quant.bf16_model_ppl_delta_frac"] == pytest.approx(2e-4)
    assert P.precision_figures([], [], []) == {}
