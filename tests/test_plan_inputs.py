"""Bad inputs to the planner and its Cluster/Traffic get a ValueError naming the argument, the value and what is
allowed (issue 32); the per-format kernel paths pick the fastest measured path at the planned batch."""

import math

import pytest

from labkit.bench.serving import SLO
from labkit.bench.workload import LengthDist
from labkit.hardware import get_hardware
from labkit.model import PRESETS
from labkit.plan import (
    NOMINAL,
    SCENARIO_175B,
    Cluster,
    KernelPath,
    Scenario,
    Traffic,
    decode_step_time,
    kernel_paths,
    kv_read_time,
    plan,
    weight_paths,
)

H200 = get_hardware("h200")
ONE = Cluster(H200, gpus_per_node=1, nodes=1)
TRAFFIC = Traffic(2.0, LengthDist.fixed(512), LengthDist.fixed(64))
SLO1 = SLO(1.0, 0.05)


@pytest.mark.parametrize("kwargs,match", [
    ({"gpus_per_node": 0}, r"gpus_per_node=0 must be an int >= 1"),
    ({"gpus_per_node": -8}, r"gpus_per_node=-8"),
    ({"gpus_per_node": 2.5}, r"gpus_per_node=2.5"),
    ({"nodes": 0}, r"nodes=0 must be an int >= 1"),
    ({"intra": "carrier-pigeon"}, r"intra='carrier-pigeon' is unknown; allowed"),
])
def test_cluster_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cluster(H200, **kwargs)
    with pytest.raises(ValueError, match="gpu='h200' must be a labkit.hardware.Hardware"):
        Cluster("h200")


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), float("inf")])
def test_traffic_refuses_bad_rates(rate):
    with pytest.raises(ValueError, match=f"rate_req_s={rate!r} must be a finite number > 0"):
        Traffic(rate, LengthDist.fixed(8), LengthDist.fixed(8))
    with pytest.raises(ValueError, match="prompt_len=512 must be a LengthDist"):
        Traffic(1.0, 512, LengthDist.fixed(8))
    with pytest.raises(ValueError, match="which='input' is unknown"):
        TRAFFIC.mean("input")


@pytest.mark.parametrize("kwargs,match", [
    ({"batches": (8, -4)}, r"batches=-4 must be an int >= 1"),
    ({"batches": (0,)}, r"batches=0 must be an int >= 1"),
    ({"batches": ()}, r"batches=\(\) must be a non-empty tuple"),
    ({"weights": ("fp4",)}, r"weights='fp4' is unknown; allowed: \['bf16', 'fp8', 'int8', 'int4'\]"),
    ({"weights": ()}, r"weights=\(\) is empty"),
    ({"kv": ("int4",)}, r"kv='int4' is unknown; allowed"),
    ({"cal": "nominal"}, r"cal='nominal' must be a labkit.plan.Calibration"),
])
def test_plan_refuses(kwargs, match):
    kwargs.setdefault("cal", NOMINAL)
    with pytest.raises(ValueError, match=match):
        plan("llama-3-8b", ONE, TRAFFIC, SLO1, **kwargs)


@pytest.mark.parametrize("slo,match", [(SLO(float("nan"), 0.05), r"slo.ttft_s=nan must be a finite number > 0"),
                                       (SLO(1.0, -0.1), r"slo.tpot_s=-0.1 must be a finite number > 0")])
def test_plan_refuses_bad_slo(slo, match):
    with pytest.raises(ValueError, match=match):
        plan("llama-3-8b", ONE, TRAFFIC, slo, cal=NOMINAL)
    with pytest.raises(ValueError, match="cluster=8 must be a labkit.plan.Cluster"):
        plan("llama-3-8b", 8, TRAFFIC, SLO1, cal=NOMINAL)
    with pytest.raises(ValueError, match="traffic=2.0 must be a labkit.plan.Traffic"):
        plan("llama-3-8b", ONE, 2.0, SLO1, cal=NOMINAL)


@pytest.mark.parametrize("fn", [decode_step_time, kv_read_time])
@pytest.mark.parametrize("tp,pp,match", [(0, 1, r"tp=0 must be an int >= 1"),
                                         (1, 0, r"pp=0 must be an int >= 1"),
                                         (-2, 1, r"tp=-2")])
def test_step_times_refuse_empty_layouts(fn, tp, pp, match):
    args = ("bf16", "bf16") if fn is decode_step_time else ("bf16",)
    with pytest.raises(ValueError, match=match):
        fn(PRESETS["llama-3-8b"], ONE, NOMINAL, tp, pp, 8, 512, *args)


def test_step_times_refuse_bad_batch_and_formats():
    spec = PRESETS["llama-3-8b"]
    with pytest.raises(ValueError, match=r"batch=-1 must be an int >= 1"):
        decode_step_time(spec, ONE, NOMINAL, 1, 1, -1, 512, "bf16", "bf16")
    with pytest.raises(ValueError, match=r"context=-100 must be an int >= 1"):  # was a time
        decode_step_time(spec, ONE, NOMINAL, 1, 1, 1, -100, "bf16", "bf16")
    with pytest.raises(ValueError, match=r"context='512' must be an int"):
        decode_step_time(spec, ONE, NOMINAL, 1, 1, 1, "512", "bf16", "bf16")
    with pytest.raises(ValueError, match=r"weights='fp16x' is unknown"):
        decode_step_time(spec, ONE, NOMINAL, 1, 1, 1, 512, "fp16x", "bf16")
    with pytest.raises(ValueError, match=r"kv='int2' is unknown"):
        decode_step_time(spec, ONE, NOMINAL, 1, 1, 1, 512, "bf16", "int2")


def test_scenario_refuses():
    with pytest.raises(ValueError, match=r"nodes=0 must be an int >= 1"):
        Scenario(nodes=0)
    with pytest.raises(ValueError, match=r"rate_req_s=nan must be a finite number > 0"):
        Scenario(rate_req_s=float("nan"))
    assert SCENARIO_175B.cluster(H200).num_gpus == 32


def test_fastest_measured_path_at_the_planned_batch():
    """A measured path stands for the batch it was measured at only, never for another (there is no
    ``extrapolate``); the step takes the fastest path measured at its micro-batch."""
    spec = PRESETS["llama-3-8b"]
    gemv = KernelPath("int8", "gemv", 1, 0.5, "r", "gpu")
    gemm = KernelPath("fp8", "scaled_mm", 64, 0.7, "r", "gpu")
    slow = KernelPath("fp8", "scaled_mm", 1, 2.0, "r", "gpu")
    assert "extrapolate" not in KernelPath.__dataclass_fields__
    cal = type(NOMINAL)(dict(NOMINAL.bandwidth_eff, int8=0.8), NOMINAL.compute_eff, 0.0, "t",
                        dequant_s_per_param={"int8": 1e-13}, kernels=(gemv, gemm, slow))
    assert [p.path for p in cal.paths("int8", 1)] == ["gemv"] and cal.paths("int8", 32) == []
    assert cal.paths("fp8", 32) == [] and [p.batch for p in cal.paths("fp8", 64)] == [64]
    assert cal.padded_batch("fp8", 2) == 64 and cal.padded_batch("fp8", 65) is None
    at1 = weight_paths(spec, ONE, cal, 1, 1, 1, 512, "int8")
    assert set(at1) == {"labkit engine step (step-sweep fit)", "gemv (batch 1)"}
    assert at1["gemv (batch 1)"] == pytest.approx(min(at1.values()))
    bf16 = weight_paths(spec, ONE, cal, 1, 1, 64, 512, "bf16")["labkit engine step (step-sweep fit)"]
    assert weight_paths(spec, ONE, cal, 1, 1, 64, 512, "fp8") == {"scaled_mm (batch 64)": pytest.approx(0.7 * bf16)}
    # an unmeasured KV format is charged the bf16 read: its memory counts, not an unmeasured speed-up
    assert kv_read_time(spec, ONE, cal, 1, 1, 8, 512, "fp8") == kv_read_time(spec, ONE, cal, 1, 1, 8, 512, "bf16")


def test_a_format_without_a_path_at_the_batch_is_not_planned():
    """FP8 measured at batch 64 only: at batch 32 a step runs padded to the measured 64 rows (the engine pads to its
    captured graph's batch), at 128 it has no path (an infinite step, ``NO_PATH``), where the nominal calibration,
    which measured no FP8 path at all, charges its bytes as an assumption. A swept format's fitted path stands inside
    the sweep's batches only."""
    from labkit.plan import decode_step_parts
    from labkit.plan.steps import NO_PATH

    spec = PRESETS["llama-3-8b"]
    cal = type(NOMINAL)(dict(NOMINAL.bandwidth_eff, int8=0.8), NOMINAL.compute_eff, 0.0, "t",
                        kernels=(KernelPath("fp8", "scaled_mm", 64, 0.7, "r", "gpu"),), swept_batches={"int8": (1, 64)})
    at32 = decode_step_parts(spec, ONE, cal, 1, 1, 32, 512, "fp8")
    assert at32["weights_path"] == "scaled_mm (batch 64, 32 padded)"
    assert at32["weights_read_s"] == decode_step_parts(spec, ONE, cal, 1, 1, 64, 512, "fp8")["weights_read_s"]
    at128 = decode_step_parts(spec, ONE, cal, 1, 1, 128, 512, "fp8")
    assert at128["weights_path"] == NO_PATH and math.isinf(at128["step_s"])
    assert decode_step_parts(spec, ONE, cal, 1, 1, 64, 512, "fp8")["weights_path"] == "scaled_mm (batch 64)"
    assert "assumed" in decode_step_parts(spec, ONE, NOMINAL, 1, 1, 32, 512, "fp8")["weights_path"]
    swept = decode_step_parts(spec, ONE, cal, 1, 1, 64, 512, "int8")["weights_path"]
    assert swept == "labkit engine step (step-sweep fit)"
    assert math.isinf(decode_step_parts(spec, ONE, cal, 1, 1, 128, 512, "int8")["step_s"])  # past the sweep


def test_the_measured_shape_nearest_the_shard_is_used():
    """Rows of the 8B layer and of the 175B layer: a 175B stage on one GPU takes the 175B layer's ratio; a TP8 shard
    of it (close to an 8B layer in weights) the 8B layer's."""
    spec = PRESETS["gpt3-175b"]
    small, big = 218_103_808, 1_811_939_328
    cal = type(NOMINAL)(NOMINAL.bandwidth_eff, NOMINAL.compute_eff, 0.0, "t",
                        kernels=(KernelPath("fp8", "a", 64, 0.9, "r", "gpu", small),
                                 KernelPath("fp8", "b", 64, 0.6, "r", "gpu", big)))
    assert list(weight_paths(spec, ONE, cal, 1, 1, 64, 512, "fp8")) == ["b (batch 64)"]
    eight = type(ONE)(ONE.gpu, gpus_per_node=8)
    assert list(weight_paths(spec, eight, cal, 8, 1, 64, 512, "fp8")) == ["a (batch 64)"]


def test_kernel_paths_from_the_committed_records():
    weights, kv = kernel_paths()
    fmts = {p.fmt for p in weights}
    assert {"int8", "int4", "fp8"} <= fmts and all(p.ratio > 0 and math.isfinite(p.ratio) for p in weights)
    assert [p.fmt for p in kv] == ["int8"] and all(p.machine != "cpu" for p in (*weights, *kv))
    fresh = {"device": "X", "rows": [{"weights": "int8", "path": "torch._int_mm W8A8", "batch": 32, "us": 5.0,
                                      "bf16_us": 10.0}]}
    w2, _ = kernel_paths(format_gemm=fresh)
    assert KernelPath("int8", "torch._int_mm W8A8", 32, 0.5, "this run", "X", 218_103_808) in w2


def test_one_recommendation_for_06_and_08():
    """The committed summary's two layouts (06's and 08's) are what ``recommend`` gives on the committed records,
    and each weight format's GPU count is the one recorded."""
    from labkit.plan import load_summary, recommend

    figures = load_summary()
    rec = recommend(SCENARIO_175B)
    assert figures["parallel.recommended_175b_layout"]["value"] == figures["plan.gpt3_175b_layout"]["value"]
    assert rec.layout == figures["plan.gpt3_175b_layout"]["value"]
    assert all(rec.gpus(w) == figures[f"plan.gpus_175b_{w}"]["value"] for w in ("bf16", "fp8", "int8", "int4"))
    assert figures["plan.gpus_175b_bf16"]["machine"] == rec.cal.machine != "cpu"
