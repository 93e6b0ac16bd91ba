"""The workbook: notebook sources, profiles, and the headless runner behind ``python -m labkit run``.

Notebooks are written as percent-format sources in ``notebooks/src/NN_topic.py`` (``# %% [markdown]`` cells,
``# %% tags=["parameters"]`` for the papermill parameters cell, ``# %%`` code cells) and built into
``notebooks/NN_topic.ipynb`` without outputs by ``python -m labkit build-notebooks``; a test checks the two agree.

Profiles: ``ci`` (seconds per notebook, CPU, smallest sizes), ``cpu`` (minutes on a laptop), ``gpu`` (full sizes);
``auto`` picks ``gpu`` when CUDA is present, else ``cpu``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from labkit.device import environ
from labkit.exercises.cells import exercise_source
from labkit.models import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
SOURCE_DIR = NOTEBOOK_DIR / "src"
PROFILES = ("ci", "cpu", "gpu")
_CELL = re.compile(r"^# %%(?P<rest>.*)$")


def resolve_profile(profile: str = "auto") -> str:
    """``ci``, ``cpu`` or ``gpu`` from a profile name or ``auto`` (``gpu`` with CUDA, else ``cpu``)."""
    import torch

    if profile == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is unknown; allowed: 'auto', {', '.join(map(repr, PROFILES))}")
    if profile == "gpu" and not torch.cuda.is_available():
        raise ValueError("profile='gpu' needs a CUDA device and none is present; use 'cpu', 'ci' or 'auto'")
    return profile


# --- sources <-> notebooks ------------------------------------------------------------------------------------
def notebook_from_percent(text: str):
    """An ``nbformat`` v4 notebook (no outputs) from a percent-format source."""
    import nbformat

    cells, kind, tags, lines = [], None, [], []

    def flush() -> None:
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", ln) for ln in body.split("\n"))
            cell = nbformat.v4.new_markdown_cell(body)
        else:
            cell = nbformat.v4.new_code_cell(body)
        if tags:
            cell.metadata["tags"] = list(tags)
        cell["id"] = f"cell-{len(cells):02d}"  # stable ids: rebuilding a notebook changes no line it need not
        cells.append(cell)

    for line in text.splitlines():
        m = _CELL.match(line)
        if m:
            flush()
            rest = m.group("rest")
            kind = "markdown" if "[markdown]" in rest else "code"
            t = re.search(r"tags=\[([^\]]*)\]", rest)
            tags = [s.strip().strip("\"'") for s in t.group(1).split(",")] if t else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def _render(nb) -> str:
    import nbformat

    return nbformat.writes(nb) + "\n"


def build_notebooks(check: bool = False) -> list[str]:
    """Build every ``notebooks/src/*.py`` into ``notebooks/*.ipynb``; with ``check``, only report stale ones."""
    stale = []
    for src in sorted(SOURCE_DIR.glob("[0-9][0-9]_*.py")):
        target = NOTEBOOK_DIR / (src.stem + ".ipynb")
        text = _render(notebook_from_percent(src.read_text() + exercise_source(src.stem)))  # + its exercises
        if not target.exists() or target.read_text() != text:
            stale.append(target.name)
            if not check:
                target.write_text(text)
    return stale


def list_notebooks(only: list[str] | None = None) -> list[Path]:
    """Notebooks in reading order, optionally those whose number or name is in ``only``."""
    nbs = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        picked = [nb for nb in nbs if any(nb.stem == o or nb.stem.split("_")[0] == o for o in only)]
        unknown = [o for o in only if not any(nb.stem == o or nb.stem.split("_")[0] == o for nb in nbs)]
        if unknown:
            raise ValueError(f"only={unknown} match no notebook; allowed: {[nb.stem for nb in nbs]}")
        return picked
    return nbs


# --- running -------------------------------------------------------------------------------------------------
def _failed_cell(nb_path: Path) -> str:
    """Index and first line of the cell that raised, read from an executed notebook."""
    try:
        nb = json.loads(nb_path.read_text())
    except (OSError, ValueError):
        return "unknown cell"
    for i, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                first = "".join(cell.get("source", "")).split("\n")[0][:80]
                return f"cell {i} ({first!r}): {out.get('ename')}: {out.get('evalue', '')[:300]}"
    return "unknown cell"


def execute_notebook(nb: Path, out_dir: Path, profile: str, timeout: int = 1800) -> float:
    """Execute one notebook with papermill under ``profile``; returns seconds. Raises with the failing cell."""
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / nb.name
    command = os.environ.get("LABKIT_COMMAND") or f"python -m labkit run --profile {profile} --only {nb.stem[:2]}"
    t0 = time.perf_counter()
    with environ(LABKIT_OUT=str(out_dir.resolve()), LABKIT_PROFILE=profile, LABKIT_COMMAND=command):
        try:
            pm.execute_notebook(str(nb), str(target), parameters={"profile": profile}, kernel_name="python3",
                                cwd=str(NOTEBOOK_DIR), progress_bar=False, execution_timeout=timeout,
                                request_save_on_cell_execute=True)  # a killed run keeps its finished cells
        except Exception as e:  # papermill raises PapermillExecutionError; report the cell, whatever the type
            raise RuntimeError(f"{nb.name} failed at {_failed_cell(target)}") from e
    return time.perf_counter() - t0


def _summary_markdown(figures: dict, timings: dict[str, float], profile: str) -> str:
    lines = [f"# labkit workbook run ({profile} profile)", "", "| notebook | seconds |", "| --- | --- |"]
    lines += [f"| {name} | {s:.1f} |" for name, s in timings.items()]
    lines += ["", "| figure | value | unit | bar | machine |", "| --- | --- | --- | --- | --- |"]
    for name, e in sorted(figures.items()):
        v = e["value"]
        v = f"{v:.4g}" if isinstance(v, float) else str(v)
        lines.append(f"| `{name}` | {v} | {e['unit']} | {e.get('bar', '')} | {e['machine']} |")
    return "\n".join(lines) + "\n"


def run_workbook(profile: str = "auto", only: list[str] | None = None, out: str | Path = "out/workbook",
                 timeout: int = 1800) -> int:
    """Execute the notebooks headless; write executed copies, records, ``figures.json`` and ``summary.md``.

    Returns 0, or 1 after naming the notebook and cell that failed (the remaining notebooks still run).
    """
    from tqdm.auto import tqdm

    profile = resolve_profile(profile)
    out_dir = Path(out)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    nbs = list_notebooks(only)
    if not nbs:
        print("no notebooks found in notebooks/", file=sys.stderr)
        return 1
    failures, timings = [], {}
    for nb in tqdm(nbs, desc=f"workbook ({profile})", unit="notebook"):
        try:
            timings[nb.stem] = execute_notebook(nb, out_dir, profile, timeout)
        except RuntimeError as e:
            failures.append(str(e))
            print(f"FAILED: {e}", file=sys.stderr)
    fig_path = out_dir / "figures.json"
    figures = json.loads(fig_path.read_text()) if fig_path.exists() else {}
    (out_dir / "summary.md").write_text(_summary_markdown(figures, timings, profile))
    print(f"wrote {len(timings)} executed notebooks, {len(figures)} figures and summary.md to {out_dir}")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


def update_readme_table(readme: Path = REPO_ROOT / "README.md") -> None:
    """Replace the block between the results markers in the README with the table from results/summary.json."""
    from labkit.bench import summary_table

    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    text = readme.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{readme} has no {begin} ... {end} block to fill")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{begin}\n{summary_table()}\n{end}{tail}")
