"""``python -m labkit lab``: jupyter lab on notebooks/, with --allow-root for root; and the profiler's USDT lines
are quiet once labkit is imported."""

import os
import subprocess
import sys

from labkit.__main__ import LAB_ENV, NOTEBOOKS, lab_command


def test_lab_passes_allow_root_only_for_root():
    root = lab_command([], uid=0)
    assert root[1:] == ["-m", "jupyter", "lab", str(NOTEBOOKS), "--allow-root"] and NOTEBOOKS.is_dir()
    assert "--allow-root" not in lab_command(["--no-browser"], uid=1000)
    assert lab_command(["--allow-root"], uid=0).count("--allow-root") == 1
    assert lab_command(["--no-browser"], uid=0)[-2:] == ["--allow-root", "--no-browser"]
    assert LAB_ENV["JUPYTER_PLATFORM_DIRS"] == "1"


def test_profiler_usdt_lines_are_quiet_after_import():
    code = ("import labkit, torch\nx = torch.randn(4, 4)\n"
            "with torch.profiler.profile():\n    x @ x\nprint('ok')")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "ok" and "USDT" not in out.stderr, out.stderr
