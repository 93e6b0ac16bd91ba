"""The gpu-profile check's rows and table (labkit.gpu_check), on logs and run folders made here."""

import json

import pytest

from labkit import gpu_check
from labkit.workbook import list_notebooks


def _run_dir(tmp_path, figures: dict, seconds: float | None = None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "figures.json").write_text(json.dumps(figures))
    if seconds is not None:
        (run / "summary.md").write_text(f"| notebook | seconds |\n| --- | --- |\n| 01_diagnose | {seconds} | 3.0 |\n")
    return run


def test_tests_stage_counts_and_status(tmp_path, monkeypatch):
    log = tmp_path / "tests.log"
    log.write_text("....\n79 passed, 3 skipped in 92.10s (0:01:32)\n")
    monkeypatch.setenv("LABKIT_TRITON_CACHE", "seeded: 12 kernels")  # as scripts/triton_autotune.sh sets it
    row = gpu_check.stage_row("tests", 0, 95.0, log, _run_dir(tmp_path, {}), {})
    assert row["status"] == "pass" and row["counts"] == {"passed": 79, "skipped": 3}
    assert row["triton_cache"] == "seeded: 12 kernels"
    assert "(Triton, Inductor) at the start of each call: seeded: 12 kernels" in gpu_check.table([row])
    log.write_text("F...\n1 failed, 78 passed in 90.00s\n")
    assert gpu_check.stage_row("tests", 1, 95.0, log, tmp_path / "run", {})["status"] == "fail"
    assert gpu_check.stage_row("tests", 124, 420.0, log, tmp_path / "run", {})["status"] == "timeout"


def test_notebook_stage_reads_failure_seconds_and_new_figures(tmp_path):
    fig = {"diagnose.a": {"value": 1.0, "unit": "x", "machine": "cpu", "record": "r.json"},
           "other.b": {"value": 2.0, "unit": "x", "machine": "cpu", "record": "r.json"}}
    run = _run_dir(tmp_path, fig, seconds=41.5)
    log = tmp_path / "01.log"
    log.write_text("FAILED: 01_diagnose.ipynb failed at cell 7 ('x = 1'): AssertionError: boom\n")
    row = gpu_check.stage_row("01", 1, 60.0, log, run, before={"other.b": fig["other.b"]})
    assert row["status"] == "fail" and "cell 7" in row["detail"]
    assert row["figures_written"] == 1 and row["seconds"] == 41.5 and row["notebook"] == "01_diagnose"
    log.write_text("wrote 1 executed notebooks\n")
    assert gpu_check.stage_row("01", 0, 60.0, log, run, before={})["status"] == "pass"


def test_merge_keeps_the_last_row_per_stage_and_refuses_mixed_machines(tmp_path):
    base = {"machine": "NVIDIA H100 80GB HBM3", "commit": "abc", "utc": "2026-12-06T00:00:00Z", "kind": "notebook",
            "false_claims": 0, "figures_written": 3, "detail": ""}
    a = [dict(base, stage="02", notebook="02_kv_cache", status="fail", seconds=60.0),
         dict(base, stage="tests", kind="tests", status="pass", seconds=90.0, counts={"passed": 3})]
    b = [dict(base, stage="02", notebook="02_kv_cache", status="pass", seconds=61.0)]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    rows = gpu_check.merge_rows([pa, pb])
    assert [r["stage"] for r in rows] == ["tests", "02"] and rows[1]["status"] == "pass"
    text = gpu_check.table(rows)
    assert "| 02_kv_cache | pass | 61 | 0 | 3 |" in text and "Notebooks passing: 1 of 1" in text
    assert gpu_check.summary_figures(rows, notebooks=1) == {"workbook.gpu_notebooks_passed": 1,
                                                            "workbook.gpu_run_seconds": 61.0}
    # the whole run's seconds only when every notebook ran to its end: not with one missing, nor with one killed
    assert gpu_check.summary_figures(rows, notebooks=2)["workbook.gpu_run_seconds"] is None
    killed = [dict(b[0], status="timeout", seconds=240.0)]
    assert gpu_check.summary_figures(killed, notebooks=1) == {"workbook.gpu_notebooks_passed": 0,
                                                              "workbook.gpu_run_seconds": None}
    pb.write_text(json.dumps([dict(b[0], machine="NVIDIA H200")]))
    with pytest.raises(ValueError, match="one machine at one commit"):
        gpu_check.merge_rows([pa, pb])


def test_write_check_keeps_the_record_and_its_figures(tmp_path):
    from labkit.figures import read_summary, write_summary

    summary = tmp_path / "results" / "summary.json"
    summary.parent.mkdir()
    write_summary({"figures": {}}, summary)
    rows = [{"stage": "07", "machine": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "utc": "2026-12-06T00:00:00Z",
             "kind": "notebook", "notebook": "07_finetuning", "status": "pass", "seconds": 70.0, "false_claims": 0,
             "figures_written": 14, "detail": ""}]
    path = gpu_check.write_check(rows, tmp_path / "results" / "h100", summary)
    assert json.loads(path.read_text())["env"]["device"] == "NVIDIA H100 80GB HBM3"
    figs = read_summary(summary)["figures"]
    assert figs["workbook.gpu_notebooks_passed"]["machines"]["h100"]["value"] == 1
    assert "h100" not in figs.get("workbook.gpu_run_seconds", {}).get("machines", {})  # 1 of 10 notebooks ran
    every = [dict(rows[0], stage=p.stem[:2], notebook=p.stem) for p in list_notebooks()]
    gpu_check.write_check(every, tmp_path / "results" / "h100", summary)
    figs = read_summary(summary)["figures"]
    assert figs["workbook.gpu_run_seconds"]["machines"]["h100"]["record"] == "results/h100/records/gpu_check.json"
    assert "| 07_finetuning | pass | 70 | 0 | 14 |" in gpu_check.tables_markdown(tmp_path / "results")
    with pytest.raises(ValueError, match="nothing ran"):
        gpu_check.write_check([], tmp_path)


def test_cell_times_say_where_a_timed_out_notebook_stopped(tmp_path):
    cells = [{"cell_type": "markdown", "source": "# t", "metadata": {}},
             {"cell_type": "code", "source": "import x\n", "metadata": {"papermill": {"status": "completed",
                                                                                   "duration": 4.04}}},
             {"cell_type": "code", "source": ["sweep = run(\n", "  1)"],
              "metadata": {"papermill": {"status": "completed", "duration": 61.25}}},
             {"cell_type": "code", "source": "probe()", "metadata": {"papermill": {"status": "running",
                                                                                 "duration": None}}},
             {"cell_type": "code", "source": "later()", "metadata": {"papermill": {"status": "pending"}}}]
    nb = tmp_path / "05_batching.ipynb"
    nb.write_text(json.dumps({"cells": cells}))
    got = gpu_check.cell_times(nb, top=2)
    assert got == {"cells_s": 65.2, "slowest": [[2, 61.2, "sweep = run("], [1, 4.0, "import x"]],
                   "stopped_in": [3, "probe()"], "pending": 1}
    assert gpu_check.cell_times(tmp_path / "absent.ipynb") == {}
    log = tmp_path / "05.log"
    log.write_text("")
    row = gpu_check.stage_row("05", 124, 140.0, log, tmp_path, {})
    assert row["status"] == "timeout" and row["detail"].startswith("killed in cell 3 ('probe()') after 65 s")
    # every cell finished, killed while the run wrote its outputs: said so, not left blank
    for c in cells[3:]:
        c["metadata"]["papermill"] = {"status": "completed", "duration": 1.0}
    nb.write_text(json.dumps({"cells": cells}))
    row = gpu_check.stage_row("05", 124, 140.0, log, tmp_path, {})
    assert row["detail"].startswith("every cell finished (67 s of cells); killed after the last")
    cells[4]["metadata"]["papermill"] = {"status": "pending"}  # killed between two cells: not "every cell finished"
    nb.write_text(json.dumps({"cells": cells}))
    assert gpu_check.stage_row("05", 124, 140.0, log, tmp_path, {})["detail"] == ""
