"""The appendix (studies, A/B passes, kernel lore) stays out of the main job and the claims check."""

import importlib.util

import pytest
import torch

from labkit.data import REPO_ROOT
from labkit.workbook import list_notebooks

APPENDIX = REPO_ROOT / "notebooks" / "appendix"


def test_the_main_job_does_not_run_the_appendix():
    assert APPENDIX.is_dir() and (APPENDIX / "README.md").exists()
    assert all(APPENDIX not in nb.parents for nb in list_notebooks())


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script would run the passes")
def test_quantization_passes_refuses_without_cuda(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("quantization_passes", APPENDIX / "quantization_passes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
