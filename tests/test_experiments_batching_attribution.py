"""Where a decode step's time goes (``labkit.experiments.batching.attribution``): the parts of a real profile of the
embedded model's engine step on the CPU, the byte floors against hand arithmetic, the record's schema, bad inputs,
and (GPU) the replayed step's parts and gaps summing to its time. No speed is asserted."""

import json

import pytest
import torch

from labkit.data import split_tokens
from labkit.experiments.batching import (
    attribute_step,
    attribution_figures,
    attribution_rows,
    decode_attribution,
    decode_part_bytes,
    decode_rate,
    format_attribution,
    plot_attribution,
)
from labkit.experiments.batching.attribution import GAPS
from labkit.model import PRESETS, ModelConfig
from labkit.profiling import STEP_PARTS, KernelEvent, ProfileResult, categorize, step_part

pytestmark = pytest.mark.usefixtures("one_thread")

MICRO = ModelConfig(name="micro", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1)  # head_dim 16: q 32, kv 16 wide
PART_KEYS = {"part", "us_per_step", "share", "kernels_per_step", "floor_bytes", "floor_us", "floor_frac", "top"}
KEYS = {"batch", "context", "dtype", "kv_dtype", "device", "steps_profiled", "kernels_from", "step_us", "step_basis",
        "kernel_us", "kernels_per_step", "gaps_us", "gap_frac", "kernels_over_step_us", "bandwidth_bytes_per_s",
        "floor_us", "floor_frac", "parts"}


@pytest.fixture(scope="module")
def cpu_step(tiny_model):
    """A ``decode_rate`` row of the embedded model's engine at batch 4 on the CPU, with a profile of 4 more steps
    (a part's time is a mean over them: one operator stalled by a neighbouring process on a 2-core machine once
    took a quarter of a 2-step profile)."""
    model, tok = tiny_model
    row = decode_rate(model, 4, 24, 3, split_tokens("heldout", tok), profile_steps=4)
    return model, row, row.pop("profile")


def test_parts_of_a_real_cpu_step(cpu_step):
    """Every part of the step is found in a real profile, by the operators' callers where the operator is a plain
    ``aten::mul``; the named parts claim most of the operator time; parts and gaps make up the profiled step."""
    model, row, prof = cpu_step
    assert prof.steps == 4 and row["profile_context"] == 24 + 3 + 3 + 2 and not prof.on_cuda
    assert any(e.scope for e in prof.events)
    parts = {}
    for e in prof.events:
        parts.setdefault(step_part(e.name, e.scope), set()).add(e.name)
    assert "aten::mul" in parts["rope/cache write"] and "aten::mul" in parts["activation"]
    assert "aten::mul" in parts["norm"] and "aten::argmax" in parts["sampling/logits"]
    assert {"aten::mm", "aten::bmm"} & parts["attention"] and "aten::mm" in parts["gemm"]
    att = decode_attribution(model, row, prof, bandwidth=2e10, source=None)
    assert set(att) == KEYS and [r["part"] for r in att["parts"]] == [*STEP_PARTS, GAPS]
    us = {r["part"]: r["us_per_step"] for r in att["parts"]}
    assert all(us[p] > 0 for p in STEP_PARTS)
    assert us["copies/other"] < 0.2 * att["kernel_us"]  # the classifier names most of the step
    assert att["step_basis"] == "profiled wall per step" and att["kernels_over_step_us"] == 0
    assert sum(us.values()) == pytest.approx(att["step_us"], rel=1e-9)
    assert sum(r["share"] for r in att["parts"]) == pytest.approx(1.0)
    assert att["context"] == row["profile_context"] and att["dtype"] == "fp32" and "eager" in att["kernels_from"]
    json.dumps(att)  # the record's row holds it as it is


def test_part_floors_by_hand():
    """MICRO in float32 (4 bytes everywhere), batch 3, context 10: T = 3 tokens, L = 2, h = 32, q = 32, k = 16,
    I = 64, V = 64."""
    got = decode_part_bytes(MICRO, 3, 10, dtype="fp32")
    weights = (2 * (32 * (2 * 32 + 2 * 16) + 3 * 32 * 64) + 64 * 32) * 4  # q/k/v/o and the MLP of 2 layers, LM head
    proj_io = 3 * 2 * ((32 + 32 + 2 * 16) + (32 + 32) + (32 + 2 * 64) + (64 + 32)) * 4 + 3 * (32 + 64) * 4
    assert got == {
        "gemm": weights + proj_io,  # 81,920 + 9,984 + 1,152
        "attention": 3 * 10 * (2 * 2 * 16 * 4) + 3 * 2 * 2 * 32 * 4,  # the KV cache + q read, output written
        "norm": 5 * 3 * 4 * 32 * 4 + (2 * 2 * 32 + 32) * 4,  # 5 norms x 4 vectors a token + their weights
        "rope/cache write": 3 * 2 * ((32 + 32) * 4 + (32 + 16) * 4 + 2 * 16 * 4 + 16 * 4),
        "activation": 3 * 2 * 3 * 64 * 4,
        "sampling/logits": 3 * 64 * 4,
        "copies/other": 3 * 32 * 8,
    }
    assert got["gemm"] == 93_056 and got["attention"] == 9_216 and got["rope/cache write"] == 3_840
    # an 8-bit KV cache halves what attention reads of it, a quarter of fp32's
    assert decode_part_bytes(MICRO, 3, 10, "fp32", "int8")["attention"] == 3 * 10 * 2 * 2 * 16 + 1536


def test_part_floors_hold_the_bench_floor():
    """Weights and the KV cache in the parts are the bench's MBU floor (``decode_weight_bytes + batch * kv_bytes``);
    the rest is activation traffic, a few percent at batch 64."""
    spec = PRESETS["llama-3-8b"]
    floor = spec.decode_weight_bytes("bf16") + 64 * spec.kv_bytes(520, "bf16")
    total = sum(decode_part_bytes(spec, 64, 520).values())
    assert floor < total < 1.05 * floor  # 1.037: 0.7 GB of activations against 19.4 GB


def _gpu_like_profile(steps: int = 2) -> ProfileResult:
    """A replayed step's kernels as CUPTI names them, per step: 1,000 us of GEMM, 400 attention, 50 norm, 20 RoPE,
    30 activation, 10 argmax, 5 copy."""
    kernels = [("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", 1000.0), ("_paged_attn_kernel", 300.0),
               ("_paged_attn_reduce", 100.0), ("_rms_norm_kernel", 50.0), ("_rope_cache_kernel", 20.0),
               ("_silu_and_mul_kernel", 30.0), ("void at::native::reduce_kernel<ArgMaxOps<float>>", 10.0),
               ("Memcpy HtoD (Pinned -> Device)", 5.0)]
    events, t = [], 0.0
    for _ in range(steps):
        for name, dur in kernels:
            events.append(KernelEvent(name, t, dur, categorize(name)))
            t += dur + 1.0
    return ProfileResult("NVIDIA H100 80GB HBM3", steps * 2e-3, steps, events, on_cuda=True)


def test_attribution_schema_and_figures(tmp_path):
    """With a step time given (the engine's step timed apart), gaps are what the kernels leave of it; each part's
    floor is its bytes over the bandwidth; the figures are the bench's names."""
    att = attribute_step(_gpu_like_profile(), "llama-3-8b", 64, 520, bandwidth=3e12, step_s=2e-3,
                         kernels_from="test")
    assert set(att) == KEYS and all(set(r) == PART_KEYS for r in att["parts"])
    parts = {r["part"]: r for r in att["parts"]}
    assert att["kernel_us"] == pytest.approx(1515.0) and att["gaps_us"] == pytest.approx(485.0)
    assert att["gap_frac"] == pytest.approx(485 / 2000) and att["step_basis"] == "given step_s"
    floors = decode_part_bytes("llama-3-8b", 64, 520)
    assert parts["gemm"]["floor_us"] == pytest.approx(floors["gemm"] / 3e12 * 1e6)
    assert parts["attention"]["floor_frac"] == pytest.approx(floors["attention"] / 3e12 * 1e6 / 400)
    assert parts["attention"]["kernels_per_step"] == 2 and parts["gemm"]["top"][0]["us_per_step"] == 1000
    assert parts[GAPS]["floor_us"] == 0 and parts[GAPS]["floor_frac"] is None
    assert [r["part"] for r in attribution_rows(att)] == [*STEP_PARTS, GAPS]
    text = format_attribution(att)
    assert "gaps" in text and "rope/cache write" in text and "485.0" in text
    figs = attribution_figures(att, tmp_path / "r.json", tmp_path)
    assert set(figs) == {"engine.decode_b64_gap_frac", "engine.decode_b64_gemm_floor_frac",
                         "engine.decode_b64_attn_floor_frac"}
    saved = json.loads((tmp_path / "figures.json").read_text())
    assert saved["engine.decode_b64_gap_frac"]["value"] == pytest.approx(485 / 2000)
    # a step time under the kernels' sum leaves no gap and says by how much
    over = attribute_step(_gpu_like_profile(), "llama-3-8b", 64, 520, 3e12, step_s=1.5e-3)
    assert over["gaps_us"] == 0 and over["kernels_over_step_us"] == pytest.approx(15.0)


def test_plot_attribution_one_panel():
    import matplotlib

    matplotlib.use("Agg")
    ax = plot_attribution(attribute_step(_gpu_like_profile(), "llama-3-8b", 64, 520, 3e12, step_s=2e-3))
    assert len(ax.figure.axes) == 1 and len(ax.get_yticklabels()) == len(STEP_PARTS) + 1


@pytest.mark.parametrize("kwargs,match", [
    ({"profile": "trace.json"}, "profile=str"), ({"batch": 0}, "batch"), ({"bandwidth": 0.0}, "bandwidth"),
    ({"step_s": -1.0}, "step_s"), ({"context": 0}, "context"), ({"spec": "llama-9"}, "spec='llama-9'"),
    ({"profile": ProfileResult("cpu", 1.0, 1, [], on_cuda=False)}, "profile holds no"),
])
def test_bad_inputs(kwargs, match):
    args = {"profile": _gpu_like_profile(), "spec": "llama-3-8b", "batch": 64, "context": 520, "bandwidth": 3e12,
            **kwargs}
    with pytest.raises(ValueError, match=match):
        attribute_step(**args)


def test_decode_rate_refuses_negative_profile_steps(tiny_model):
    with pytest.raises(ValueError, match="profile_steps"):
        decode_rate(tiny_model[0], 1, 8, 1, list(range(3, 200)), profile_steps=-1)


@pytest.mark.gpu
def test_replayed_step_parts_and_gaps_sum_to_the_step():
    """On CUDA with graphs (the embedded model, Triton kernels): the engine's replayed steps are profiled kernel by
    kernel (or, where CUPTI shows none inside a replay, eagerly, and the record says so); the GEMMs, attention and
    norms are found by their kernels' names; parts and gaps sum to the engine's step time, the kernels within it."""
    from labkit.model import load_model

    model, source = load_model(device="cuda")[0], torch.arange(100, 6000)
    row = decode_rate(model, 8, 64, 8, source, profile_steps=3)
    assert row["cuda_graphs"] and row["replay_step_s"]
    att = decode_attribution(model, row, row.pop("profile"), bandwidth=3e12, source=source)
    us = {r["part"]: r["us_per_step"] for r in att["parts"]}
    assert all(us[p] > 0 for p in ("gemm", "attention", "norm")), us
    assert att["step_basis"] == "given step_s" and att["step_us"] == pytest.approx(row["step_median_s"] * 1e6)
    assert att["kernels_over_step_us"] <= 0.05 * att["step_us"]
    assert sum(us.values()) == pytest.approx(att["step_us"], rel=0.05)
    assert "replayed" in att["kernels_from"] or "eagerly" in att["kernels_from"]
    print(format_attribution(att))
