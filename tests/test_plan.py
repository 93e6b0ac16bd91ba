import math
from dataclasses import replace

import pytest

from labkit.bench.serving import SLO
from labkit.bench.workload import LengthDist
from labkit.hardware import get_hardware
from labkit.model import PRESETS, get_config
from labkit.plan import (
    NOMINAL,
    Calibration,
    Cluster,
    Traffic,
    decode_step_time,
    explain,
    fit_calibration,
    mape,
    plan,
    prefill_time,
    validate,
)
from labkit.roofline import roofline

H200 = get_hardware("h200")
ONE = Cluster(H200, gpus_per_node=1, nodes=1)
TRAFFIC = Traffic(2.0, LengthDist.fixed(512), LengthDist.exponential(128, 1, 1024))


def _synthetic_rows(cal: Calibration, bandwidth: float, peak: float) -> list[dict]:
    """Step times made by a known calibration (through the planner's own step model on a one-GPU cluster of
    these ceilings), to check that fitting recovers it."""
    spec, rows = PRESETS["llama-3-8b"], []
    hw = replace(H200, mem_bandwidth=bandwidth, bf16_flops=peak)
    one = Cluster(hw, gpus_per_node=1, nodes=1)
    for w in ("bf16", "int8"):
        for b in (1, 8, 64):
            for ctx in (512, 4096):
                r = roofline(spec, H200, b, ctx + 1, "decode", dtype=w, kv_dtype="bf16")
                t = decode_step_time(spec, one, cal, 1, 1, b, ctx + 1, w, "bf16")
                rows.append({"phase": "decode", "weights": w, "batch": b, "context": ctx, "median_s": t,
                             "pred_bytes": r.bytes, "pred_flops": r.flops})
        for ctx in (512, 2048, 8000):
            r = roofline(spec, H200, 1, ctx, "prefill", dtype=w)
            rows.append({"phase": "prefill", "weights": w, "batch": 1, "context": ctx,
                         "median_s": prefill_time(spec, one, cal, 1, 1, ctx, w), "pred_bytes": r.bytes,
                         "pred_flops": r.flops})
    return rows


TRUTH = Calibration({"bf16": 0.82, "int8": 0.6}, {"bf16": 0.7, "int8": 0.45}, 0.0, "synthetic", kv_eff=0.5,
                    dequant_s_per_param={"int8": 2e-13}, prefill_layer_overhead_s=100e-6)


def test_fit_recovers_known_calibration():
    rows = _synthetic_rows(TRUTH, 4.3e12, 8e14)
    fit = fit_calibration(rows, "llama-3-8b", 4.3e12, 8e14)
    assert fit.bandwidth_eff == pytest.approx(TRUTH.bandwidth_eff, rel=1e-6)
    assert fit.compute_eff == pytest.approx(TRUTH.compute_eff, rel=1e-6)
    assert fit.kv_eff == pytest.approx(0.5, rel=1e-6) and fit.layer_overhead_s == 0.0
    assert fit.dequant_s_per_param["int8"] == pytest.approx(2e-13, rel=1e-6)
    assert fit.prefill_layer_overhead_s == pytest.approx(100e-6, rel=1e-6)
    with pytest.raises(ValueError, match="decode and prefill"):
        fit_calibration([r for r in rows if r["phase"] == "decode"], "llama-3-8b", 4.3e12, 8e14)


def test_fixed_step_cost_folds_into_the_weight_efficiency():
    """One sweep cannot separate a per-layer cost from the weight-read efficiency (both are constant per
    precision); the fit folds the cost in and still predicts every measured step."""
    with_cost = replace(TRUTH, layer_overhead_s=40e-6)
    rows = _synthetic_rows(with_cost, 4.3e12, 8e14)
    fit = fit_calibration(rows, "llama-3-8b", 4.3e12, 8e14)
    assert fit.layer_overhead_s == 0.0 and fit.bandwidth_eff["bf16"] < TRUTH.bandwidth_eff["bf16"]
    record = {"data": {"preset": "llama-3-8b", "rows": rows,
                       "ceilings": {"copy_bytes_per_s": 4.3e12, "matmul_flops": 8e14}}}
    hw = replace(H200, mem_bandwidth=4.3e12, bf16_flops=8e14)
    assert mape([r for r in validate(record, fit, hw) if r["batch"] == 1 and r["phase"] == "decode"]) < 1e-6


def test_fit_keeps_efficiencies_physical():
    """Times *below* a floor cannot make an efficiency above 1: the fit is constrained, not extrapolated."""
    rows = _synthetic_rows(TRUTH, 4.3e12, 8e14)
    fast = [dict(r, median_s=r["median_s"] * 0.2) for r in rows]
    fit = fit_calibration(fast, "llama-3-8b", 4.3e12, 8e14)
    assert all(0 < e <= 1 for e in [*fit.bandwidth_eff.values(), *fit.compute_eff.values(), fit.kv_eff])
    assert fit.layer_overhead_s >= 0 and fit.prefill_layer_overhead_s >= 0


def test_validate_against_a_record():
    hw = H200
    rows = _synthetic_rows(TRUTH, hw.mem_bandwidth, hw.bf16_flops)
    record = {"data": {"preset": "llama-3-8b", "rows": rows,
                       "ceilings": {"copy_bytes_per_s": hw.mem_bandwidth, "matmul_flops": hw.bf16_flops}}}
    fit = fit_calibration(rows, "llama-3-8b", hw.mem_bandwidth, hw.bf16_flops)
    out = validate(record, fit, hw)
    assert len(out) == len(rows) and mape(out) < 1e-6
    held = validate(record, fit, hw, held_out=True)  # each row predicted by a fit that never saw it
    assert len(held) == len(rows) and mape(held) < 1e-3


def test_step_times_follow_the_arithmetic():
    spec = PRESETS["llama-3-8b"]
    t1 = decode_step_time(spec, ONE, NOMINAL, 1, 1, 1, 512, "bf16", "bf16")
    floor = roofline(spec, H200, 1, 512, "decode").bytes / H200.mem_bandwidth
    assert floor < t1 < 1.5 * floor  # bandwidth-bound, near the floor once calibrated
    node = Cluster(H200, 8, 1)
    assert decode_step_time(spec, node, NOMINAL, 8, 1, 1, 512, "bf16", "bf16") < t1  # TP splits the reads
    assert decode_step_time(spec, node, NOMINAL, 1, 4, 4, 512, "bf16", "bf16") > t1  # PP does not speed a token
    assert prefill_time(spec, ONE, NOMINAL, 1, 1, 4096, "bf16") > prefill_time(spec, ONE, NOMINAL, 1, 1, 512, "bf16")


def test_plan_ranks_feasible_layouts_first():
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    plans = plan("llama-3-8b", ONE, TRAFFIC, slo, cal=NOMINAL, batches=(8, 64))
    best = plans[0]
    assert best.meets_slo and best.fits and best.gpus == 1 and best.tpot_ms <= 50
    big = plan("gpt3-175b", ONE, TRAFFIC, slo, cal=NOMINAL, weights=("bf16",), kv=("bf16",), batches=(8,))
    assert not any(p.fits for p in big)  # 350 GB of weights on one 141 GB GPU


def test_plan_saturates_when_traffic_exceeds_capacity():
    heavy = Traffic(10_000.0, LengthDist.fixed(512), LengthDist.fixed(256))
    plans = plan("llama-3-8b", ONE, heavy, SLO(1.0, 0.05), cal=NOMINAL, weights=("bf16",), kv=("bf16",),
                 batches=(8,))
    assert not plans[0].meets_slo and math.isinf(plans[0].tpot_ms)


@pytest.mark.parametrize("kwargs,match", [({"weights": ("fp4",)}, "weights='fp4' is unknown"),
                                          ({"kv": ("int4",)}, "kv='int4' is unknown")])
def test_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan("llama-3-8b", ONE, TRAFFIC, SLO(1.0, 0.05), cal=NOMINAL, **kwargs)
    with pytest.raises(ValueError, match="rate_req_s=0"):
        plan("llama-3-8b", ONE, Traffic(0, LengthDist.fixed(8), LengthDist.fixed(8)), SLO(1, 1), cal=NOMINAL)


def test_explain_states_how_many_gpus_the_weights_need():
    node = Cluster(H200, 8, 1)
    slo = SLO(ttft_s=5.0, tpot_s=1.0)
    big = plan(PRESETS["gpt3-175b"], node, TRAFFIC, slo, cal=NOMINAL, batches=(16,))[0]
    text = explain(big, PRESETS["gpt3-175b"], node)
    need = math.ceil(PRESETS["gpt3-175b"].weight_bytes(big.weights) / (0.9 * H200.mem_capacity))
    assert f"at least {need} GPUs must share them" in text if need > 1 else "one GPU could hold them" in text
    small = plan(PRESETS["llama-3-8b"], Cluster(H200, 1, 1), TRAFFIC, slo, cal=NOMINAL, batches=(16,))[0]
    assert "one GPU could hold them" in explain(small, PRESETS["llama-3-8b"], Cluster(H200, 1, 1))


def test_smaller_weights_buy_a_larger_batch_and_so_fewer_gpus():
    """The same scenario planned with an FP8 kernel at half bf16's time at every batch: FP8's half-size weights leave
    room for a larger batch on the same TP group, so fewer replicas (fewer GPUs) meet the objective; with a kernel
    as slow as bf16 per weight FP8 needs no more GPUs than bf16; with one slower per weight, more. The plan says which
    kernel each step's number comes from (``decode_step_parts``' ``weights_path``)."""
    from labkit.plan import SCENARIO_175B, KernelPath, decode_step_parts, load_calibration, recommend

    cal, _ = load_calibration()
    gpus = {}
    for ratio in (0.5, 1.0, 1.7):
        fast = tuple(KernelPath("fp8", "k", b, ratio, "t", "gpu") for b in (1, 4, 8, 16, 32, 64, 128, 256))
        rec = recommend(SCENARIO_175B, cal=replace(cal, kernels=fast))
        gpus[ratio] = rec.gpus("fp8")
        bf16, fp8 = rec.by_weights["bf16"], rec.by_weights["fp8"]
        if ratio == 0.5:
            assert fp8.gpus < bf16.gpus and fp8.max_batch > bf16.max_batch and fp8.tp <= bf16.tp
            part = decode_step_parts(get_config("gpt3-175b"), rec.scenario.cluster(rec.gpu), rec.cal, fp8.tp, fp8.pp,
                                     fp8.max_batch, 600, "fp8", fp8.kv)
            assert part["weights_path"] == f"k (batch {fp8.max_batch})"
    assert gpus[0.5] < gpus[1.0] <= rec.gpus("bf16") < gpus[1.7]
