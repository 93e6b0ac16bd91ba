import json

import pytest

from labkit.bench import Timing, merge_figures, record_figure, summary_table, time_fn, write_record


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
    summary = tmp_path / "summary.json"
    merged = merge_figures(tmp_path / "figures.json", "results/h200", summary_path=summary)
    assert merged["figures"]["unit.x"]["record"] == "results/h200/records/unit.json"
    table = summary_table(summary)
    assert "`unit.x`" in table and "<= 2" in table


def test_git_commit_prefers_the_commit_given(monkeypatch):
    from labkit.bench import git_commit

    monkeypatch.setenv("LABKIT_GIT_COMMIT", "abc1234")
    assert git_commit() == "abc1234"  # a copied tree's .git may be older than the code that runs
    monkeypatch.delenv("LABKIT_GIT_COMMIT")
    assert git_commit() != "abc1234"


def test_merge_keeps_a_gpu_figure_over_a_cpu_measurement(tmp_path):
    summary = tmp_path / "summary.json"
    gpu = {"value": 2.0, "unit": "x", "machine": "NVIDIA H200", "record": "results/h200/records/a.json"}
    summary.write_text(json.dumps({"figures": {"a.x": gpu}}))
    run = tmp_path / "run"
    run.mkdir()
    cpu = {"value": 0.5, "unit": "x", "machine": "cpu", "record": str(run / "records" / "a.json")}
    (run / "figures.json").write_text(json.dumps({"a.x": cpu, "a.y": dict(cpu, value=7)}))
    merged = merge_figures(run / "figures.json", "results/cpu", summary_path=summary)
    assert merged["figures"]["a.x"] == gpu  # the CPU value stays in the run's record only
    assert merged["figures"]["a.y"]["record"] == "results/cpu/records/a.json"
    merged = merge_figures(run / "figures.json", "results/cpu", summary_path=summary, replace_gpu=True)
    assert merged["figures"]["a.x"]["machine"] == "cpu"
