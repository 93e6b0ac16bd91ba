import json

import pytest

from labkit.bench import SUMMARY_PATH, Timing, record_figure, time_fn, write_record
from labkit.data import machine_class
from labkit.figures import committed_figures, merge_figures, read_summary, summary_table


def test_time_fn_cpu_counts_and_orders():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, iters=5)
    assert len(calls) == 7 and len(t.samples_s) == 5 and t.method == "wall_clock"
    assert t.quantile_s(0.1) <= t.median_s <= t.quantile_s(0.9)


def test_timing_statistics():
    t = Timing([1.0, 2.0, 3.0, 4.0, 100.0], "wall_clock")
    assert t.median_s == 3.0 and t.median_ms == 3000.0
    assert t.to_dict()["p90_s"] == 100.0 and t.quantile_s(0.1) == 1.0  # nearest rank


def test_bad_timing_arguments():
    with pytest.raises(ValueError, match="iters=0"):
        time_fn(lambda: None, iters=0)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        time_fn(lambda: None, device="cpu", cuda_graph=True)


def test_records_figures_and_summary(tmp_path):
    rec = write_record("unit", {"timing": Timing([0.1, 0.2], "wall_clock"), "x": 1}, out_dir=tmp_path)
    body = json.loads(rec.read_text())
    for key in ("device", "torch", "transformers", "git_commit", "command", "utc"):
        assert key in body["env"]
    assert body["data"]["timing"]["median_s"] == pytest.approx(0.15)
    record_figure("unit.x", 1.5, "s", rec, bar="<= 2", out_dir=tmp_path)
    with pytest.raises(ValueError, match="must be '<area>.<figure>'"):
        record_figure("nodot", 1, "s", rec, out_dir=tmp_path)
    entry = json.loads((tmp_path / "figures.json").read_text())["unit.x"]
    assert entry["kind"] == "measured" and entry["run"] and entry["run"] == body["env"]["run"]
    record_figure("unit.n", 200, "requests", rec, out_dir=tmp_path, derived=True)
    summary = tmp_path / "summary.json"
    merged = merge_figures(tmp_path / "figures.json", "results/h200", summary_path=summary)
    cls = machine_class(entry["machine"])
    assert merged["figures"]["unit.x"]["machines"][cls]["record"] == "results/h200/records/unit.json"
    assert merged["figures"]["unit.n"]["kind"] == "derived" and merged["figures"]["unit.x"]["bar"] == "<= 2"
    table = summary_table(summary)
    assert "`unit.x`" in table and "<= 2" in table


def test_git_commit_prefers_the_commit_given(monkeypatch):
    from labkit.bench import git_commit

    monkeypatch.setenv("LABKIT_GIT_COMMIT", "abc1234")
    assert git_commit() == "abc1234"  # a copied tree's .git may be older than the code that runs
    monkeypatch.delenv("LABKIT_GIT_COMMIT")
    assert git_commit() != "abc1234"


def test_merge_updates_only_the_merging_runs_machine(tmp_path):
    summary = tmp_path / "summary.json"
    gpu = {"value": 2.0, "machine": "NVIDIA H200", "record": "results/h200/records/a.json", "run": "g"}
    summary.write_text(json.dumps({"format": 2, "figures": {"a.x": {"unit": "x", "kind": "measured",
                                                                    "machines": {"h200": gpu}}}}))
    run = tmp_path / "run"
    run.mkdir()
    cpu = {"value": 0.5, "unit": "x", "machine": "cpu", "record": str(run / "records" / "a.json"), "run": "c",
           "kind": "measured"}
    (run / "figures.json").write_text(json.dumps({"a.x": cpu, "a.y": dict(cpu, value=7)}))
    merged = merge_figures(run / "figures.json", "results/cpu", summary_path=summary)
    assert merged["figures"]["a.x"]["machines"]["h200"] == gpu  # the GPU's value stays beside the CPU's
    assert merged["figures"]["a.x"]["machines"]["cpu"] == {"value": 0.5, "machine": "cpu", "run": "c",
                                                           "record": "results/cpu/records/a.json"}
    h100 = dict(cpu, machine="NVIDIA H100 80GB HBM3", value=1.5, run="h")
    (run / "figures.json").write_text(json.dumps({"a.x": h100}))
    merged = merge_figures(run / "figures.json", "results/h100", summary_path=summary)
    assert [m for m in merged["figures"]["a.x"]["machines"]] == ["h100", "h200", "cpu"]
    assert merged["figures"]["a.x"]["machines"]["h200"]["value"] == 2.0  # two GPUs never overwrite each other


def test_machine_classes():
    assert machine_class("NVIDIA H100 80GB HBM3") == "h100" and machine_class("NVIDIA H200") == "h200"
    assert machine_class("cpu") == "cpu"
    assert machine_class("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"  # unknown: its own class, never a known one's
    assert machine_class("NVIDIA H100 PCIe") == "h100-pcie"
    assert machine_class("NVIDIA H100 80GB HBM3 + NVIDIA H200") == "h100+h200"  # derived from two machines' records
    with pytest.raises(ValueError, match="need a device name"):
        machine_class("")


def test_a_summary_of_one_value_per_figure_is_upgraded(tmp_path):
    old = {"figures": {"a.x": {"value": 2.0, "unit": "x", "machine": "NVIDIA H200", "record": "nowhere.json",
                               "bar": ">= 1", "note": "n"}}}
    (tmp_path / "s.json").write_text(json.dumps(old))
    new = read_summary(tmp_path / "s.json")
    assert new["format"] == 2
    assert new["figures"]["a.x"] == {"unit": "x", "kind": "measured", "bar": ">= 1", "machines": {"h200": {
        "value": 2.0, "machine": "NVIDIA H200", "record": "nowhere.json", "note": "n", "run": "legacy@unknown"}}}


def test_committed_figures_prefer_one_machine(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": 2, "figures": {"a.x": {"unit": "x", "kind": "measured", "machines": {
        "h200": {"value": 2.0, "machine": "NVIDIA H200", "record": "r", "run": "g"},
        "cpu": {"value": 0.5, "machine": "cpu", "record": "c", "run": "c"}}}}}))
    assert committed_figures(("cpu",), path)["a.x"]["value"] == 0.5
    assert committed_figures(("h100", "h200"), path)["a.x"]["value"] == 2.0
    assert committed_figures(("h100",), path)["a.x"]["class"] in ("h200", "cpu")  # falls back to any holder


def test_the_committed_summary_is_per_machine_and_every_figure_has_a_run():
    summary = read_summary()
    assert json.loads(SUMMARY_PATH.read_text())["format"] == 2, "migrate results/summary.json (read_summary)"
    for name, f in summary["figures"].items():
        assert f["kind"] in ("measured", "derived"), name
        for cls, e in f["machines"].items():
            assert machine_class(e["machine"]) == cls and e["run"], (name, cls)
