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
from collections.abc import Callable
from pathlib import Path

from labkit.data import REPO_ROOT
from labkit.device import environ
from labkit.exercises.cells import exercise_source
from labkit.gpu_check import tables_markdown
from labkit.provenance import records_markdown, stale_executed, stamp_executed

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


# --- numbers typed into the prose ---------------------------------------------------------------------------------
_NUMBER = re.compile(r"(?<![\w.\-^/=<>])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?(?:\s*(?:%|x\b|×)|\s*[-–]\s*\d+(?:\.\d+)?%?)?"
                     r"(?![\w^]|-[a-zA-Z]|/\d)")
_NUMBER_WORDS = re.compile(
    r"\b(?:(?:about|around|roughly|nearly|almost|over|under|some|more than|less than|at least|at most)\s+(?:a |an )?"
    r"(?:hundred|thousand|million|dozen|half|third|quarter|fifth|tenth|one|two|three|four|five|six|seven|eight|nine|ten"
    r"|twice)\b|(?:one|two|three|four|five|six|seven|eight|nine|ten|a hundred|hundreds|thousands) times\b"
    r"|one (?:\w+ )?in (?:two|three|four|five|six|ten)\b|hundreds of\b|thousands of\b"
    r"|a (?:fifth|quarter|tenth|third) of\b)",
    re.I)
_NOT_FINDINGS = [re.compile(p) for p in (
    r"`[^`]*`", r"\$\$.*?\$\$", r"\$[^$]*\$", r"\]\([^)]*\)", r"https?://\S+",  # code, math, link targets
    r"\b(?:[Nn]otebooks?|[Hh]ints?|[Ii]ssues?|[Ff]ollow-ups?|[Gg]ate|[Tt]echnique|[Ss]tage|[Ss]tep)\s+\d+"
    r"(?:\s*(?:[-–,]|and|or)\s*\d+)*",  # references to notebooks, hints, sections
    r"(?<![\w.\-])0\d(?:\s*[-–]\s*0\d)?\b",  # notebooks by number: 02-06
    r"\((?:19|20)\d\d\)|\b(?:19|20)\d\d\b", r"^\s*\d+\.\s", r"\(\d\)",  # years, enumerations
    r"\bbatch(?:es)?(?: of)? \d+(?:(?:,| and| to) \d+)*", r"\bcontext(?: of)? \d+",  # the notebook's sizes
    r"\b\d[\d,]* (?:cached |prompt |output )?tokens\b(?!/)", r"\b\d+(?:/\d+)?(?:-| )bits?\b", r"\bper \d+\b",
    r"\b\d+\s*x\s*\d+(?:\s*x\s*\d+)*\b", r"\b(?:TP|PP|rank|ranks)\s+\d+",  # shapes, layouts
    r"\b\d+ (?:query |KV )?heads\b")]


def markdown_numbers(source: Path | str, allowed: tuple[str, ...] = ()) -> list[tuple[int, str, str]]:
    """The numbers typed into the markdown cells of a notebook source (``# %% [markdown]``), as ``(line, number,
    text)``: digits (``587``, ``1e-7``, ``4x``, ``20-38%``) and approximate number words ("about a hundred", "hundreds
    of", "one in four"). A measured finding in the prose must be a claim or rendered from figures instead.

    Not counted: the title line, code (inline and fenced), math, link targets, references to notebooks, hints and
    sections, years, list numbering, and the notebook's sizes (batch N, context N, N tokens, N bits, per N, shapes
    N x M, TP N, N heads). ``allowed``: phrases (definitions, datasheet and paper numbers, model shapes) whose numbers
    are not findings either."""
    out, markdown, fence = [], False, False
    for i, line in enumerate(Path(source).read_text().splitlines(), 1):
        if line.startswith("# %%"):
            markdown, fence = "[markdown]" in line, False
            continue
        if not markdown or line.startswith("# # "):
            continue
        text = re.sub(r"^# ?", "", line)
        if text.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        masked = text
        for pattern in [*(re.compile(re.escape(a)) for a in allowed), *_NOT_FINDINGS]:
            masked = pattern.sub(lambda m: " " * len(m.group(0)), masked)
        found = sorted([*_NUMBER.finditer(masked), *_NUMBER_WORDS.finditer(masked)], key=lambda m: m.start())
        out += [(i, m.group(0), text) for m in found]
    return out


def list_notebooks(only: list[str] | None = None) -> list[Path]:
    """Notebooks in reading order, optionally those whose number or name is in ``only`` (None: all; an empty list or
    a single string is refused, never read as all)."""
    nbs = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only is not None:
        if isinstance(only, str) or not only:
            raise ValueError(f"only={only!r} must be a non-empty list of notebook numbers or names (None: every "
                             f"notebook); allowed: {[nb.stem for nb in nbs]}")
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
            stamp_executed(target, nb, profile)
            raise RuntimeError(f"{nb.name} failed at {_failed_cell(target)}") from e
    stamp_executed(target, nb, profile)
    return time.perf_counter() - t0


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children: a notebook's kernel once it exits. On a
    machine shared with other work, a kernel's CPU time is closer to its time on an idle machine than the wall
    clock is (a notebook that pins torch to one thread uses at most one core)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def summary_markdown(figures: dict, timings: dict[str, float], profile: str, committed: dict | None = None,
                     cpu_s: dict[str, float] | None = None) -> str:
    """``summary.md`` of a run: seconds per notebook (wall clock, and the kernel's CPU seconds where given), then
    one row per figure of the run: this run's value with its machine class, and beside it each machine's committed
    value from ``results/summary.json`` (``committed``: that summary, ``labkit.figures.read_summary``). Every value is
    marked against the figure's bar on its own machine (✓ met, ✗ not met): a CPU value is never judged by a GPU's.
    """
    from labkit.data import machine_class
    from labkit.figures import MARKS, bar_holds, class_order, format_value

    committed = (committed or {}).get("figures", {})
    classes = class_order(c for n in figures for c in committed.get(n, {}).get("machines", {}))
    machines = sorted({e["machine"] for e in figures.values()})
    lines = [f"# labkit workbook run ({profile} profile)", "",
             f"This run measured on: {', '.join(machines) or 'nothing'}. Each figure's value from this run stands "
             "beside each machine's committed value of the same name (`results/summary.json` keeps one per machine "
             "class). ✓ / ✗: the figure's bar is met / not met by that value, on that value's machine.", "",
             "| notebook | seconds | kernel CPU seconds |", "| --- | --- | --- |"]
    cpu_s = cpu_s or {}
    lines += [f"| {name} | {s:.1f} | {cpu_s[name]:.1f} |" if name in cpu_s else f"| {name} | {s:.1f} | |"
              for name, s in timings.items()]
    lines += [f"| **total** | {sum(timings.values()):.1f} | {sum(cpu_s.values()):.1f} |", "",
              "| figure | unit | bar | this run | " + " | ".join(f"committed {c}" for c in classes) + " |",
              "| --- | --- | --- | --- |" + " --- |" * len(classes)]

    def cell(value, bar) -> str:
        mark = MARKS[bar_holds(bar, value)]
        return format_value(value) + (f" {mark}" if mark else "")

    for name, e in sorted(figures.items()):
        c = committed.get(name, {})
        bar = e.get("bar") or c.get("bar", "")
        cells = [cell(c["machines"][m]["value"], bar) if m in c.get("machines", {}) else "" for m in classes]
        lines.append(f"| `{name}` | {e['unit']} | {bar} | {cell(e['value'], bar)} ({machine_class(e['machine'])}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_workbook(profile: str = "auto", only: list[str] | None = None, out: str | Path = "out/workbook",
                 timeout: int = 1800, execute: Callable[[Path, Path, str, int], float] | None = None) -> int:
    """Execute the notebooks headless; write executed copies, records, ``figures.json``, ``summary.md`` and
    ``index.html`` (every executed notebook as an HTML page, the summary, the capstone's answer: ``labkit.site``).
    Every figure of the run carries one run id (``$LABKIT_RUN_ID`` when set, else the start time and commit), so
    that a claim comparing figures of two notebooks compares one run's.

    ``execute(notebook, out_dir, profile, timeout) -> seconds`` runs one notebook (default ``execute_notebook``,
    papermill; raises ``RuntimeError`` naming the failed cell). Returns 0, or 1 after naming the notebook and cell
    that failed (the remaining notebooks still run).
    """
    execute = execute or execute_notebook
    from tqdm.auto import tqdm

    profile = resolve_profile(profile)
    out_dir = Path(out)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    nbs = list_notebooks(only)
    if not nbs:
        print("no notebooks found in notebooks/", file=sys.stderr)
        return 1
    from labkit.bench import new_run_id

    failures, timings, failed, cpu_s = [], {}, {}, {}
    t_run = time.perf_counter()
    run = os.environ.get("LABKIT_RUN_ID") or new_run_id()  # one run id for every notebook of this run
    print(f"run {run}")
    for nb in tqdm(nbs, desc=f"workbook ({profile})", unit="notebook"):
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        try:
            with environ(LABKIT_RUN_ID=run):
                timings[nb.stem] = execute(nb, out_dir, profile, timeout)
        except RuntimeError as e:
            timings[nb.stem] = time.perf_counter() - t0
            failed[nb.stem] = str(e)
            failures.append(str(e))
            print(f"FAILED: {e}", file=sys.stderr)
        cpu_s[nb.stem] = _children_cpu_s() - cpu0
    fig_path = out_dir / "figures.json"
    figures = json.loads(fig_path.read_text()) if fig_path.exists() else {}
    from labkit.figures import read_summary
    from labkit.site import write_site

    committed = read_summary()
    (out_dir / "summary.md").write_text(summary_markdown(figures, timings, profile, committed, cpu_s))
    try:
        index = write_site(out_dir, timings, failed)
    except Exception as e:  # noqa: BLE001 -- the notebooks' results are written; say what failed, not a traceback
        index = None
        failures.append(f"the site (index.html) could not be written: {type(e).__name__}: {e} (the executed "
                        f"notebooks, records, figures.json and summary.md are in {out_dir})")
    site = f"{index} (open it in a browser: every notebook rendered, the summary, the capstone's answer)" if index \
        else "no site"
    print(f"wrote {len(timings)} executed notebooks, {len(figures)} figures, summary.md and {site}; whole run "
          f"{time.perf_counter() - t_run:.0f} s")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


BARS_BEGIN, BARS_END = "<!-- bars:begin -->", "<!-- bars:end -->"
GPU_CHECK_BEGIN, GPU_CHECK_END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
EXECUTED_BEGIN, EXECUTED_END = "<!-- executed:begin -->", "<!-- executed:end -->"
RECORDS_BEGIN, RECORDS_END = "<!-- records:begin -->", "<!-- records:end -->"


def executed_markdown(results_root: Path) -> str:
    """The executed notebooks under ``results_root``, each with what it ran from (``metadata.labkit``) and whether
    its source changed since (``provenance.stale_executed``)."""
    stale = stale_executed(results_root)
    rows = ["| executed notebook | profile | machine | commit | source |", "| --- | --- | --- | --- | --- |"]
    for path in sorted(Path(results_root).rglob("[0-9][0-9]_*.ipynb")):
        rel = path.relative_to(results_root).as_posix()
        stamp = json.loads(path.read_text()).get("metadata", {}).get("labkit") or {}
        rows.append(f"| `{rel}` | {stamp.get('profile', '?')} | {stamp.get('machine', '?')} | "
                    f"{str(stamp.get('commit', '?'))[:9]} | {stale.get(rel, 'current')} |")
    return "\n".join(rows) + f"\n\n{len(stale)} of {len(rows) - 2} executed notebooks are stale."
RESULTS_BEGIN, RESULTS_END = "<!-- results:begin -->", "<!-- results:end -->"


def _fill(text: str, begin: str, end: str, body: str, where: Path) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"{where} has no {begin} ... {end} block to fill")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def readme_blocks(readme: Path = REPO_ROOT / "README.md", results_readme: Path = REPO_ROOT / "results" / "README.md",
                  summary: Path | None = None) -> dict[Path, str]:
    """What ``python -m labkit readme`` writes: the README with its results table and its list of bars not met,
    and ``results/README.md`` with the same list (links relative to ``results/``), all from the summary."""
    from labkit.bench import SUMMARY_PATH
    from labkit.figures import summary_table, unmet_bars_markdown

    summary = summary or SUMMARY_PATH
    text = _fill(readme.read_text(), RESULTS_BEGIN, RESULTS_END, summary_table(summary), readme)
    text = _fill(text, BARS_BEGIN, BARS_END, unmet_bars_markdown(summary), readme)
    results = _fill(results_readme.read_text(), BARS_BEGIN, BARS_END,
                    unmet_bars_markdown(summary, link_root="results/"), results_readme)
    results = _fill(results, GPU_CHECK_BEGIN, GPU_CHECK_END, tables_markdown(results_readme.parent), results_readme)
    results = _fill(results, EXECUTED_BEGIN, EXECUTED_END, executed_markdown(results_readme.parent), results_readme)
    results = _fill(results, RECORDS_BEGIN, RECORDS_END, records_markdown(results_readme.parent), results_readme)
    return {readme: text, results_readme: results}


def update_readme_table(readme: Path = REPO_ROOT / "README.md",
                        results_readme: Path = REPO_ROOT / "results" / "README.md") -> list[Path]:
    """Regenerate, from results/summary.json, the README's results table and the lists of bars not met in the README
    and in results/README.md; returns the files that changed."""
    changed = []
    for path, text in readme_blocks(readme, results_readme).items():
        if path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed
