"""The one cost model of a TP x PP decode step (``labkit.plan.steps.decode_step_parts``): its properties, notebook
06's tables through it (``labkit.plan.layouts``), and the planner and notebook 06 giving one layout one number."""

import json

import pytest

from labkit.hardware import get_hardware
from labkit.model import PRESETS
from labkit.plan import (
    MULTI_GPU_CAVEAT,
    NOMINAL,
    SCENARIO_175B,
    Cluster,
    calibrated_cluster,
    decode_step_parts,
    decode_step_time,
    every_layout,
    layout_rows,
    load_calibration,
    multi_gpu_records,
    plan,
    recommend,
    steps,
    worked_example_175b,
)

H200 = get_hardware("h200")
NODES = Cluster(H200, gpus_per_node=8, nodes=2)


def test_decode_step_properties():
    spec = PRESETS["llama-3-70b"]
    tp1 = decode_step_parts(spec, NODES, NOMINAL, 1, 1, 8, 1024)
    tp8 = decode_step_parts(spec, NODES, NOMINAL, 8, 1, 8, 1024)
    pp8 = decode_step_parts(spec, NODES, NOMINAL, 1, 8, 8, 1024, microbatches=8)
    assert not tp1["fits"] and tp8["fits"]  # 141 GB of bf16 weights do not fit one 141 GB GPU
    assert tp8["weights_read_s"] == pytest.approx(tp1["weights_read_s"] / 8, rel=0.02)  # TP divides the reads
    assert tp8["step_s"] < tp1["step_s"] and 0 < tp8["comm_frac"] < 1  # ... and adds latency-bound all-reduces
    # weight-bound decode: 8 micro-batches re-read each stage's weights 8 times, so PP8 is no faster than 1 GPU
    assert pp8["step_s"] >= 0.9 * tp1["step_s"]
    assert tp1["validated"] and tp1["caveat"] == ""
    assert not tp8["validated"] and tp8["caveat"] == MULTI_GPU_CAVEAT  # no multi-GPU record calibrates it
    assert decode_step_time(spec, NODES, NOMINAL, 8, 1, 8, 1024, "bf16", "bf16") == tp8["step_s"]
    with pytest.raises(ValueError, match="microbatches=0"):
        decode_step_parts(spec, NODES, NOMINAL, 1, 2, 8, 16, microbatches=0)


def test_worked_example_175b_is_calibrated_and_labelled():
    rows = worked_example_175b("h200")
    by = {(r["layout"], r["microbatches"]): r for r in rows}
    assert by["TP8 x PP1", 1]["weights_gb"] == pytest.approx(PRESETS["gpt3-175b"].weight_bytes("bf16") / 8e9, rel=0.01)
    # crossing nodes with TP costs more than it saves; PP across nodes does not
    assert by["TP16 x PP1", 1]["tp_comm_s"] > 4 * by["TP8 x PP2", 1]["tp_comm_s"]
    assert by["TP8 x PP2", 1]["tokens_per_s"] > by["TP16 x PP1", 1]["tokens_per_s"]
    assert all(r["caveat"] == MULTI_GPU_CAVEAT for r in rows)  # every row spans GPUs; none is validated yet
    cal = load_calibration()[0]
    assert all(r["calibration"] == cal.source for r in rows) and "measured" in rows[0]["hardware"]
    h100 = worked_example_175b("h100")[0]
    assert "datasheet" in h100["hardware"] and not h100["fits"]  # 82 GB per GPU on an 80 GB card


def test_every_layout_prefers_tp_inside_a_node():
    cluster, cal, _ = calibrated_cluster("h200")
    rows = every_layout(PRESETS["gpt3-175b"], cluster, cal, num_gpus=16, batch=32, context=2048)
    assert {r["layout"] for r in rows} >= {"TP16 x PP1", "TP8 x PP2", "TP1 x PP16"}
    assert all(r["tp"] * r["pp"] == 16 for r in rows)
    assert rows[0]["fits"] and rows[0]["tp"] <= 8  # TP stays on NVLink; the node boundary is crossed by PP


def test_notebook_06_and_the_planner_give_one_layout_one_number():
    """Both are ``decode_step_parts``: 06's worked example gives its step times for TP8 and PP8, and the planner's
    pick, evaluated by 06's table function at the planner's batch and context, is the planner's own step time."""
    cluster, cal, _ = calibrated_cluster("h200")
    rows = {r["layout"]: r for r in worked_example_175b("h200")}
    for tp, pp, m in ((8, 1, 1), (1, 8, 8)):
        parts = decode_step_parts(PRESETS["gpt3-175b"], cluster, cal, tp, pp, 32, 2048, "bf16", "bf16", m)
        assert rows[f"TP{tp} x PP{pp}"]["step_s"] == parts["step_s"]
    rec = recommend(SCENARIO_175B)
    b = rec.best
    traffic = rec.scenario.traffic()
    ctx = int(traffic.mean("prompt") + traffic.mean("output") / 2)
    row = layout_rows("gpt3-175b", rec.scenario.cluster(rec.gpu), rec.cal, [(b.tp, b.pp, b.pp)], b.max_batch, ctx,
                      b.weights, b.kv)[0]
    assert row["step_s"] * 1e3 == pytest.approx(b.decode_step_ms, rel=1e-12)
    assert not b.validated and MULTI_GPU_CAVEAT in b.notes and b.to_dict()["validated"] is False


def test_the_planner_labels_multi_gpu_plans_until_a_multi_gpu_record_exists(tmp_path):
    traffic = SCENARIO_175B.traffic()
    one = Cluster(H200, gpus_per_node=1, nodes=1)
    single = plan("llama-3-8b", one, traffic, SCENARIO_175B.slo(), cal=NOMINAL, weights=("bf16",), kv=("bf16",),
                  batches=(8,))
    assert all(p.validated for p in single)
    assert multi_gpu_records(tmp_path) == ({}, "")
    rec = tmp_path / "h200x8" / "records"
    rec.mkdir(parents=True)
    fits = {"all_reduce@8": {"alpha_s": 1e-5, "beta_bytes_per_s": 2e11}, "send_recv@2": {"error": "noisy"}}
    (rec / "multigpu_comm.json").write_text(json.dumps({"data": {"fits": fits, "rows": []}}))
    (rec / "multigpu_tp.json").write_text(json.dumps({"data": {"rows": []}}))
    got, tp = multi_gpu_records(tmp_path)
    assert got == {"all_reduce@8": fits["all_reduce@8"]} and tp.endswith("h200x8/records/multigpu_tp.json")
    cal, _ = load_calibration(multi_gpu_root=tmp_path)
    assert cal.collectives == got and cal.multi_gpu == tp
    part = decode_step_parts(PRESETS["gpt3-175b"], NODES, cal, 8, 1, 32, 2048)
    assert part["validated"] and part["collectives"] == "measured"
    spec = PRESETS["gpt3-175b"]
    assert part["tp_comm_s"] == pytest.approx(steps.tp_comm(spec, 8, 32, "nvlink4", fits=got)["time_s"])
    assert part["tp_comm_s"] != pytest.approx(steps.tp_comm(spec, 8, 32, "nvlink4")["time_s"])
