"""labkit.parallel.cost_model: ring-collective arithmetic (or measured fits), per-step TP/PP traffic, memory per GPU.
The step time of a layout is the planner's (tests/test_plan_layouts.py)."""

import pytest

from labkit.model import PRESETS, TINY
from labkit.parallel import cost_model as cm
from labkit.parallel.schedules import bubble_formula


def test_collective_formulas():
    nv = cm.LINKS["nvlink4"]
    assert cm.all_reduce_time(1e9, 1, nv) == 0.0
    assert cm.all_reduce_time(1e9, 8, nv) == pytest.approx(14 * nv.latency_s + 1.75 * 1e9 / nv.bandwidth)
    assert cm.all_gather_time(1e9, 4, "pcie5") == pytest.approx(3 * 3e-6 + 0.75 * 1e9 / 64e9)
    assert cm.p2p_time(50e9, "ib-ndr") == pytest.approx(1.0 + 5e-6)
    for p, m in [(1, 1), (2, 1), (4, 8), (8, 3)]:
        assert cm.bubble_fraction(p, m) == bubble_formula(p, m)
    with pytest.raises(ValueError, match="link='ethernet' is unknown"):
        cm.get_link("ethernet")


def test_tp_traffic_matches_what_the_tp_layers_send():
    # what tests/test_parallel_tensor_parallel counts (bench.collectives.CountingCollectives): batch 2 x 13, fp32
    c = cm.tp_comm(TINY, tp=2, tokens=2 * 13, dtype="fp32")
    assert c["all_reduces"] == 2 * TINY.num_layers + 1
    assert c["all_reduces"] * c["all_reduce_bytes"] == 452608
    assert c["all_gather_bytes"] == 2 * 13 * 8192 * 4
    assert cm.tp_comm(TINY, tp=1, tokens=4)["time_s"] == 0.0
    assert cm.pp_comm(TINY, pp=4, tokens=8, dtype="fp32")["sends"] == 3


def test_memory_per_device():
    spec = PRESETS["llama-3-8b"]
    one = cm.memory_per_device(spec, tp=1, pp=1, kv_tokens=1000)
    assert one["weights"] == pytest.approx(spec.weight_bytes("bf16"), rel=1e-4)
    assert one["kv"] == pytest.approx(spec.kv_bytes(1000, "bf16"))
    tp8 = cm.memory_per_device(spec, tp=8, pp=1, kv_tokens=1000)
    assert tp8["weights"] == pytest.approx(one["weights"] / 8, rel=1e-3) and tp8["kv"] == pytest.approx(one["kv"] / 8)
    # 8 KV heads over 16 ranks: each rank keeps (a replica of) one head
    assert cm.memory_per_device(spec, tp=16, pp=1, kv_tokens=1000)["kv_heads_per_gpu"] == 1
    pp4 = cm.memory_per_device(spec, tp=1, pp=4, kv_tokens=1000)
    assert pp4["kv"] == pytest.approx(one["kv"] / 4) and pp4["weights"] < one["weights"] / 3
    with pytest.raises(ValueError, match="pp=64 exceeds num_layers=32"):
        cm.memory_per_device(spec, tp=1, pp=64, kv_tokens=1)


def test_measured_collectives_replace_the_datasheet_link():
    spec = PRESETS["gpt3-175b"]
    datasheet = cm.tp_comm(spec, 8, 32, "nvlink4")
    fits = {"all_reduce@8": {"alpha_s": 20e-6, "beta_bytes_per_s": 100e9}}
    measured = cm.tp_comm(spec, 8, 32, "nvlink4", fits=fits)
    ar = 32 * spec.hidden_size * 2
    ag = cm.all_gather_time(32 * spec.vocab_size * 2, 8, "nvlink4")  # no fit for the all-gather: the link's
    assert measured["time_s"] == pytest.approx(datasheet["all_reduces"] * (20e-6 + ar / 100e9) + ag)
    assert cm.tp_comm(spec, 4, 32, "nvlink4", fits=fits)["time_s"] == cm.tp_comm(spec, 4, 32, "nvlink4")["time_s"]
    assert cm.measured_time(None, "all_reduce", 1.0, 8) is None
