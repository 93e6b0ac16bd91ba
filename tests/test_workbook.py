import json

import pytest

from labkit.workbook import (
    NOTEBOOK_DIR,
    SOURCE_DIR,
    build_notebooks,
    list_notebooks,
    notebook_from_percent,
    resolve_profile,
)

SRC = '''# %% [markdown]
# # Title
# some *text*
# %% tags=["parameters"]
profile = "auto"
# %%
x = 1
print(x)
'''


def test_percent_source_to_notebook():
    nb = notebook_from_percent(SRC)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds == ["markdown", "code", "code"]
    assert nb.cells[0].source == "# Title\nsome *text*"
    assert nb.cells[1].metadata["tags"] == ["parameters"]
    assert nb.cells[2].source == "x = 1\nprint(x)"


def test_committed_notebooks_match_sources_and_have_no_outputs():
    assert build_notebooks(check=True) == [], "run `python -m labkit build-notebooks`"
    nbs = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert len(nbs) == len(list(SOURCE_DIR.glob("[0-9][0-9]_*.py"))) >= 2
    for nb in nbs:
        cells = json.loads(nb.read_text())["cells"]
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in cells if c["cell_type"] == "code"), f"{nb.name} carries outputs"
        params = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(params) == 1 and 'profile = "auto"' in "".join(params[0]["source"]), nb.name


def test_profiles_and_selection():
    assert resolve_profile("ci") == "ci"
    assert resolve_profile("auto") in ("cpu", "gpu")
    with pytest.raises(ValueError, match="profile='fast' is unknown"):
        resolve_profile("fast")
    assert [p.stem[:2] for p in list_notebooks(["00"])] == ["00"]
    with pytest.raises(ValueError, match="match no notebook"):
        list_notebooks(["42"])


def test_readmes_results_table_and_unmet_bars_are_generated_from_summary():
    """README.md's results table and its list of bars not met, and results/README.md's list, are what
    ``python -m labkit readme`` writes from results/summary.json."""
    from labkit.bench import SUMMARY_PATH
    from labkit.figures import summary_table, unmet_bars
    from labkit.workbook import readme_blocks

    for path, text in readme_blocks().items():
        assert path.read_text() == text, f"{path} is out of date: run `python -m labkit readme`"
    readme = next(iter(readme_blocks()))
    assert summary_table(SUMMARY_PATH) in readme.read_text()
    for bar in unmet_bars():  # every bar not met is listed, per machine
        assert f"`{bar['figure']}`" in readme.read_text().split("<!-- bars:begin -->")[1]


def test_unmet_bars_are_listed_per_machine(tmp_path):
    import json

    from labkit.figures import unmet_bars_markdown

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": 2, "figures": {"a.x": {"unit": "x", "bar": ">= 2", "machines": {
        "h100": {"value": 1.5, "machine": "NVIDIA H100 80GB HBM3", "record": "results/h100/records/a.json", "run": "r"},
        "h200": {"value": 2.5, "machine": "NVIDIA H200", "record": "results/h200/records/a.json", "run": "s"}}}}}))
    md = unmet_bars_markdown(path, link_root="results/")
    assert "1 bars not met" in md and "- **h100** (NVIDIA H100 80GB HBM3):" in md and "h200" not in md
    assert "  - `a.x` 1.5 against >= 2 ([a.json](h100/records/a.json))" in md


def test_a_site_that_cannot_be_written_fails_the_run_with_a_message(tmp_path, monkeypatch, capsys):
    import labkit.site
    import labkit.workbook as wb

    monkeypatch.setattr(wb, "execute_notebook", lambda nb, out_dir, profile, timeout: 0.1)

    def no_templates(*args, **kwargs):
        raise ValueError("No template sub-directory with name 'lab'")

    monkeypatch.setattr(labkit.site, "write_site", no_templates)
    assert wb.run_workbook(profile="ci", only=["09"], out=tmp_path) == 1
    err = capsys.readouterr().err
    assert "the site (index.html) could not be written: ValueError: No template" in err
    assert (tmp_path / "summary.md").exists()  # what the notebooks produced is still there
