"""Execute every notebook headless with papermill under the ``ci`` profile, as ``python -m labkit run`` does."""

import pytest

from labkit.workbook import execute_notebook, list_notebooks

NOTEBOOKS = list_notebooks()


@pytest.mark.notebooks
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_under_ci_profile(nb, tmp_path):
    seconds = execute_notebook(nb, tmp_path, profile="ci", timeout=600)
    assert (tmp_path / nb.name).exists()
    assert (tmp_path / "figures.json").exists(), f"{nb.name} recorded no figure"
    print(f"{nb.name}: {seconds:.1f} s")
