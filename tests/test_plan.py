import math

import pytest

from labkit.engine.metrics import SLO
from labkit.engine.workload import LengthDist
from labkit.hardware import get_hardware
from labkit.models import PRESETS
from labkit.plan import (
    NOMINAL,
    Calibration,
    Cluster,
    Traffic,
    _decode_bytes,
    decode_step_time,
    fit_calibration,
    mape,
    plan,
    prefill_time,
    validate,
)
from labkit.profiling import roofline

H200 = get_hardware("h200")
ONE = Cluster(H200, gpus_per_node=1, nodes=1)
TRAFFIC = Traffic(2.0, LengthDist.fixed(512), LengthDist.exponential(128, 1, 1024))


def _synthetic_rows(cal: Calibration, bandwidth: float, peak: float) -> list[dict]:
    """Step times made by a known calibration, to check that fitting recovers it."""
    spec, rows = PRESETS["llama-3-8b"], []
    for w in ("bf16", "int8"):
        for b in (1, 8, 64):
            for ctx in (512, 4096):
                r = roofline(spec, H200, b, ctx + 1, "decode", dtype=w, kv_dtype="bf16")
                t = cal.step_overhead_s + _decode_bytes(spec, 1, 1, b, ctx + 1, w, "bf16") / (bandwidth * cal.bw(w))
                rows.append({"phase": "decode", "weights": w, "batch": b, "context": ctx, "median_s": t,
                             "pred_bytes": r.bytes, "pred_flops": r.flops})
        for ctx in (2048, 8000):
            r = roofline(spec, H200, 1, ctx, "prefill", dtype=w)
            rows.append({"phase": "prefill", "weights": w, "batch": 1, "context": ctx,
                         "median_s": spec.prefill_flops(ctx) / (peak * cal.compute_eff), "pred_bytes": r.bytes,
                         "pred_flops": r.flops})
    return rows


def test_fit_recovers_known_calibration():
    truth = Calibration({"bf16": 0.82, "int8": 0.6}, 0.7, 30e-6, "synthetic")
    rows = _synthetic_rows(truth, 4.3e12, 8e14)
    fit = fit_calibration(rows, "llama-3-8b", 4.3e12, 8e14)
    assert fit.bandwidth_eff["bf16"] == pytest.approx(0.82, rel=1e-6)
    assert fit.bandwidth_eff["int8"] == pytest.approx(0.6, rel=1e-6)
    assert fit.compute_eff == pytest.approx(0.7, rel=1e-6) and fit.step_overhead_s == pytest.approx(30e-6)
    with pytest.raises(ValueError, match="decode and prefill"):
        fit_calibration([r for r in rows if r["phase"] == "decode"], "llama-3-8b", 4.3e12, 8e14)


def test_validate_against_a_record():
    cal = Calibration({"bf16": 0.8, "int8": 0.6}, 0.65, 20e-6, "synthetic")
    hw = H200
    rows = _synthetic_rows(cal, hw.mem_bandwidth, hw.bf16_flops)
    record = {"data": {"preset": "llama-3-8b", "rows": rows}}
    fit = fit_calibration(rows, "llama-3-8b", hw.mem_bandwidth, hw.bf16_flops)
    out = validate(record, fit, hw)
    assert len(out) == len(rows) and mape(out) < 0.05


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
