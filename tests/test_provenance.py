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
