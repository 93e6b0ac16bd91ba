"""Executed notebooks carry the hash of their source; a changed source marks them stale (labkit.workbook)."""

import json

from labkit.provenance import NOTEBOOK_DIR, source_hash, stale_executed, stamp_executed


def test_stamp_then_stale_when_the_source_changes(tmp_path):
    src_dir = tmp_path / "notebooks"
    src_dir.mkdir()
    source = src_dir / "01_demo.ipynb"
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# demo"},
             {"cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": [], "execution_count": None}]
    source.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    runs = tmp_path / "results" / "h100"
    runs.mkdir(parents=True)
    executed = runs / "01_demo.ipynb"
    executed.write_text(source.read_text())
    assert "not stamped" in stale_executed(tmp_path / "results", src_dir)["h100/01_demo.ipynb"]
    stamp_executed(executed, source, "gpu")
    meta = json.loads(executed.read_text())["metadata"]["labkit"]
    assert meta["source_sha256"] == source_hash(source) and meta["profile"] == "gpu"
    assert stale_executed(tmp_path / "results", src_dir) == {}
    cells[1]["source"] = "x = 2"
    source.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert "source changed after this run" in stale_executed(tmp_path / "results", src_dir)["h100/01_demo.ipynb"]
    source.unlink()
    assert "no notebook" in stale_executed(tmp_path / "results", src_dir)["h100/01_demo.ipynb"]


def test_hash_ignores_outputs_and_metadata():
    nb = sorted(NOTEBOOK_DIR.glob("0[0-9]_*.ipynb"))[0]
    assert len(source_hash(nb)) == 64


def test_records_table_is_read_from_each_records_env(tmp_path):
    from labkit.provenance import records_markdown

    (tmp_path / "h100" / "records").mkdir(parents=True)
    (tmp_path / "h100" / "records" / "a.json").write_text(json.dumps({"env": {
        "device": "NVIDIA H100 80GB HBM3", "command": "__main__.py bench decode --batch 1",
        "utc": "2026-12-07T10:00:00Z",
        "git_commit": "ae4df193893ffa1dbbf30ba4bf6818a35f217586-dirty", "code_commit": "4c8ba77",
        "code_note": "run from an export of d1ace7c"}, "data": {}}))
    (tmp_path / "h100" / "records" / "b.json").write_text(json.dumps({"data": {}}))
    rows = records_markdown(tmp_path).splitlines()
    assert rows[2] == ("| `h100/records/a.json` | NVIDIA H100 80GB HBM3 | `python -m labkit bench decode --batch 1` | "
                       "4c8ba77 (run from an export of d1ace7c) | 2026-12-07T10:00:00Z |")
    assert rows[3] == "| `h100/records/b.json` | | (no `env` header) | | |"
    assert len(rows) == 4
