"""Where a predict-then-measure exercise finds its measurement: this run's figures, else the committed records.

A notebook run writes ``figures.json`` and ``records/*.json`` into its output folder (``$LABKIT_OUT``, set by the
workbook runner; ``out/local`` in a notebook opened by hand). When this run recorded the figure an exercise compares
with, its record is used (the prediction's inputs and the measurement come from the same record); otherwise the
committed one that ``results/summary.json`` names (``$LABKIT_SUMMARY``: another summary). Each lookup says which it
used, and on what machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from labkit.data import REPO_ROOT


class NoMeasurement(LookupError):
    """Neither this run nor the committed records hold the figure an exercise compares with."""


def run_dir() -> Path:
    """The current run's output folder (as ``labkit.bench.output_dir``, without creating it)."""
    return Path(os.environ.get("LABKIT_OUT", REPO_ROOT / "out" / "local"))


def summary_path() -> Path:
    """The committed summary the exercises compare with: ``$LABKIT_SUMMARY``, else ``results/summary.json``."""
    return Path(os.environ.get("LABKIT_SUMMARY", REPO_ROOT / "results" / "summary.json"))


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _shown(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _record_path(entry: dict, root: Path) -> Path:
    rec = Path(entry["record"])
    return rec if rec.is_absolute() else root / rec


def figure(name: str, summary: Path | None = None) -> tuple[dict, dict | None, str]:
    """``(figure entry, its record or None, where both come from)``: this run's when it recorded ``name``, else the
    committed summary's; ``NoMeasurement`` when neither has it."""
    run_figs = _read(run_dir() / "figures.json") or {}
    if name in run_figs:
        entry = run_figs[name]
        path = _record_path(entry, Path.cwd())
        return entry, _read(path), f"this run's {_shown(path)}, {entry.get('machine', '?')}"
    from labkit.figures import committed_figures

    summary = Path(summary or summary_path())
    figs = committed_figures(path=summary) if summary.exists() else {}
    if name in figs:
        entry = figs[name]
        path = _record_path(entry, REPO_ROOT)
        return entry, _read(path), f"the committed {_shown(path)}, {entry.get('machine', '?')}: this run did not " \
                                   f"record {name}"
    raise NoMeasurement(f"neither this run ({_shown(run_dir() / 'figures.json')}) nor results/summary.json holds "
                        f"the figure {name}")


def committed_record(rel: str) -> tuple[dict, str]:
    """A committed record by its path under the repository (``results/h200/records/03_kernels.json``)."""
    data = _read(REPO_ROOT / rel)
    if data is None:
        raise NoMeasurement(f"{rel} is not in this checkout")
    return data, f"the committed {rel}, {data.get('env', {}).get('device', '?')}"


def data_of(record: dict | None, what: str) -> dict:
    """The ``data`` part of a record, or ``NoMeasurement`` naming ``what`` was looked for."""
    if not record or "data" not in record:
        raise NoMeasurement(f"the record of {what} could not be read")
    return record["data"]
