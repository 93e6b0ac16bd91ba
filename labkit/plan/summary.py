"""Reading ``results/summary.json``: the figures the planner and the capstone quote."""

from __future__ import annotations

from pathlib import Path


def load_summary(path: Path | str | None = None, prefer: tuple[str, ...] | None = None) -> dict:
    """The figures of ``results/summary.json``, one value each (name -> entry with value, unit, machine, record,
    run): the first machine class of ``prefer`` that holds it (default: this machine's class if it is a GPU, then
    the H200, the H100, other GPUs, the CPU; ``labkit.figures.committed_figures``)."""
    from labkit.bench import SUMMARY_PATH
    from labkit.figures import committed_figures

    path = Path(path or SUMMARY_PATH)
    return committed_figures(prefer, path) if path.exists() else {}
