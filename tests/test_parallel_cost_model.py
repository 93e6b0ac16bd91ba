"""labkit.parallel.cost_model: ring-collective arithmetic, per-step TP/PP traffic, memory per GPU, the 175B table."""

import pytest

from labkit.hardware import get_hardware
from labkit.models import PRESETS, TINY
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
    # what tests/test_parallel_tensor_parallel measures through comm.STATS: batch 2 x 13 tokens, float32
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


def test_decode_step_properties():
    spec, hw = PRESETS["llama-3-70b"], get_hardware("h200")
    tp1 = cm.decode_step(spec, hw, tp=1, pp=1, batch=8, context=1024)
    tp8 = cm.decode_step(spec, hw, tp=8, pp=1, batch=8, context=1024)
    pp8 = cm.decode_step(spec, hw, tp=1, pp=8, batch=8, context=1024, microbatches=8)
    assert not tp1["fits"] and tp8["fits"]  # 141 GB of bf16 weights do not fit one 141 GB GPU
    assert tp8["stage_read_s"] == pytest.approx(tp1["stage_read_s"] / 8, rel=0.02)  # TP divides the bytes read
    assert tp8["step_s"] < tp1["step_s"]  # ... but adds 161 latency-bound all-reduces per step
    # weight-bound decode: 8 micro-batches re-read each stage's weights 8 times, so PP8 is no faster than 1 GPU
    assert pp8["step_s"] >= 0.9 * tp1["step_s"]
    assert 0 < tp8["comm_frac"] < 1
    with pytest.raises(ValueError, match="microbatches=3 must divide batch=8"):
        cm.decode_step(spec, hw, tp=1, pp=2, batch=8, context=16, microbatches=3)


def test_worked_example_175b():
    rows = cm.worked_example_175b(get_hardware("h200"))
    by = {(r["layout"], r["microbatches"]): r for r in rows}
    assert by["TP8 x PP1", 1]["weights_gb"] == pytest.approx(PRESETS["gpt3-175b"].weight_bytes("bf16") / 8e9, rel=0.01)
    # crossing nodes with TP costs more than it saves; PP across nodes does not
    assert by["TP16 x PP1", 1]["tp_comm_s"] > 4 * by["TP8 x PP2", 1]["tp_comm_s"]
    assert by["TP8 x PP2", 1]["tokens_per_s"] > by["TP16 x PP1", 1]["tokens_per_s"]


def test_best_layouts_prefer_tp_inside_a_node():
    rows = cm.best_layouts(PRESETS["gpt3-175b"], get_hardware("h200"), num_gpus=16, batch=32, context=2048)
    assert {r["layout"] for r in rows} >= {"TP16 x PP1", "TP8 x PP2", "TP1 x PP16"}
    assert all(r["tp"] * r["pp"] == 16 for r in rows)
    best = rows[0]
    assert best["fits"] and best["tp"] <= 8  # TP stays on NVLink; the node boundary is crossed by PP
