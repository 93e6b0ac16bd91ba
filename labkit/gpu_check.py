"""The gpu-profile check: the GPU tests and every notebook, in stages that each fit a short device lease, one table.

``scripts/gpu_check.sh`` runs the stages (``tests``: ``pytest -m gpu``; ``NN``: ``python -m labkit run --profile gpu
--only NN``), each under its own time limit, and carries on past a failure. After each stage it calls ``python -m
labkit gpu-check record``, which appends one row to ``gpu_check.json``: the stage, pass / fail / timeout, seconds
(a notebook's own execution time, from the run's ``summary.md``), false claims (the notebook's claims evaluated
against the figures the run wrote, so a claim after the first false one is counted too) and the figures it wrote.
``python -m labkit gpu-check table FILE...`` merges the rows of several device calls (one machine, one commit)
and prints the table that ``results/README.md`` shows for each machine.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from labkit.data import REPO_ROOT

STATUSES = ("pass", "fail", "timeout")
_PYTEST = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def _notebooks() -> list[Path]:
    """The workbook's notebooks (as ``labkit.workbook.list_notebooks``, which imports this module)."""
    return sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _notebook_stem(stage: str) -> str:
    notebooks = _notebooks()
    found = [p for p in notebooks if p.stem.startswith(f"{stage}_")]
    if len(found) != 1:
        numbers = [p.stem[:2] for p in notebooks]
        raise ValueError(f"stage={stage!r} names {len(found)} notebooks; allowed: 'tests' or one of {numbers}")
    return found[0].stem


def _figures(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _notebook_seconds(run_dir: Path, stem: str) -> float | None:
    """The notebook's execution seconds from the run's ``summary.md`` (``| stem | seconds | ...``)."""
    md = run_dir / "summary.md"
    if not md.exists():
        return None
    m = re.search(rf"^\| {re.escape(stem)} \| ([0-9.]+) \|", md.read_text(), re.M)
    return float(m.group(1)) if m else None


def cell_times(notebook: Path, top: int = 4) -> dict:
    """Where an executed notebook's time went, from papermill's per-cell metadata: ``cells_s`` (the cells' total
    seconds), ``slowest`` (``top`` rows of ``[cell index, seconds, first line]``) and, for a notebook stopped
    mid-run, ``stopped_in`` (the cell that was running) and ``pending`` (how many cells never started). Empty when
    the notebook is absent or unreadable."""
    try:
        cells = json.loads(notebook.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return {}
    rows, stopped, pending = [], None, 0
    for i, c in enumerate(cells):
        pm = c.get("metadata", {}).get("papermill", {})
        if c.get("cell_type") != "code" or not pm:
            continue
        src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
        first = src.strip().splitlines()[0][:80] if src.strip() else ""
        if pm.get("status") == "running":
            stopped = [i, first]
        elif pm.get("status") == "pending":
            pending += 1
            continue
        rows.append([i, round(pm.get("duration") or 0.0, 1), first])
    out = {"cells_s": round(sum(r[1] for r in rows), 1), "slowest": sorted(rows, key=lambda r: -r[1])[:top]}
    if stopped:
        out["stopped_in"] = stopped
    if pending:
        out["pending"] = pending
    return out


def false_claims(stem: str, figures: dict) -> list[str]:
    """Claims of notebook ``stem`` that are false or refused on ``figures`` (a run's ``figures.json``), judged on
    each machine class of the run they apply to (a claim whose figures the run did not record is not counted):
    ``'file:line machine: sentence (why)'``."""
    from labkit.claims import RefusedClaim, collect, evaluate
    from labkit.data import machine_class

    by_class: dict[str, dict] = {}
    for name, e in figures.items():
        by_class.setdefault(machine_class(e["machine"]), {})[name] = e
    src = REPO_ROOT / "notebooks" / "src" / f"{stem}.py"
    out = []
    for where, c in collect([src]):
        if isinstance(c, RefusedClaim):
            out.append(f"{where}: refused as written ({c.reason})")
            continue
        for m, figs in by_class.items():
            if c.applies_to(m) and all(n in figs for n in c.figures()):
                v = evaluate(c, figs, m, "this run")
                if v.status in ("false", "refused"):
                    out.append(f"{where} {m}: {v.sentence} ({v.problem or c.condition})")
    return out


def stage_row(stage: str, rc: int, seconds: float, log: Path, run_dir: Path, before: dict) -> dict:
    """One row of the table for a finished stage: ``rc`` its exit status (124 / 137: killed at its limit),
    ``log`` its output, ``run_dir`` the workbook run's folder (``before``: its ``figures.json`` before the stage)."""
    from labkit.bench import git_commit, machine_tag

    text = log.read_text(errors="replace") if log.exists() else ""
    row = {"stage": stage, "machine": machine_tag(), "commit": git_commit(),
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(seconds, 1),
           # the compiled-kernel state the call started from (scripts/triton_autotune.sh): a warm cache's times
           # are not a first run's
           "triton_cache": os.environ.get("LABKIT_TRITON_CACHE", "unknown")}
    timed_out = rc in (124, 137)
    if stage == "tests":
        counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in _PYTEST.findall(text[-2000:])}
        ok = rc == 0 and counts.get("failed", 0) == 0 and counts.get("error", 0) == 0
        row.update(kind="tests", counts=counts, status="timeout" if timed_out else ("pass" if ok else "fail"),
                   detail=next((ln for ln in reversed(text.splitlines()) if _PYTEST.search(ln)), "")[:300])
        return row
    stem = _notebook_stem(stage)
    figures = _figures(run_dir / "figures.json")
    written = sorted(n for n, e in figures.items() if before.get(n) != e)
    failed = re.search(rf"FAILED: {re.escape(stem)}\.ipynb failed at (.*)", text)
    claims = false_claims(stem, figures)
    status = "timeout" if timed_out else ("fail" if failed or (rc != 0 and "site" not in text[-600:]) else "pass")
    row.update(kind="notebook", notebook=stem, status=status, false_claims=len(claims), false_claim_text=claims,
               figures_written=len(written), detail=failed.group(1)[:400] if failed else "",
               notebook_seconds=_notebook_seconds(run_dir, stem), cells=cell_times(run_dir / f"{stem}.ipynb"))
    if status == "timeout" and row["cells"].get("stopped_in"):
        i, first = row["cells"]["stopped_in"]
        row["detail"] = f"killed in cell {i} ({first!r}) after {row['cells']['cells_s']:.0f} s of finished cells"
    elif status == "timeout" and row["cells"].get("slowest") and not row["cells"].get("pending"):  # after the last
        row["detail"] = (f"every cell finished ({row['cells']['cells_s']:.0f} s of cells); killed after the last, "
                         "while the run wrote its outputs (executed notebook, HTML, figures, claims)")
    if row["notebook_seconds"] is not None and status != "timeout":
        row["seconds"] = row["notebook_seconds"]
    return row


def append_row(path: Path, row: dict) -> None:
    rows = json.loads(path.read_text()) if path.exists() else []
    rows.append(row)
    path.write_text(json.dumps(rows, indent=1))


def merge_rows(paths: list[Path]) -> list[dict]:
    """Rows of several ``gpu_check.json`` files, the last row of each stage kept, in stage order (tests first).
    Refuses rows of different machines or commits: the table is one machine at one commit."""
    last: dict[str, dict] = {}
    for p in paths:
        for row in json.loads(Path(p).read_text()):
            last[row["stage"]] = row
    machines = {r["machine"] for r in last.values()}
    commits = {r["commit"] for r in last.values()}
    if len(machines) > 1 or len(commits) > 1:
        raise ValueError(f"rows of machines {sorted(machines)} and commits {sorted(commits)}: one table is one "
                         "machine at one commit; merge each separately")
    return [last[k] for k in sorted(last, key=lambda s: (s != "tests", s))]


def table(rows: list[dict]) -> str:
    """The markdown table: stage, status, seconds, false claims, figures written, what failed; then the totals."""
    if not rows:
        return "(no stage has run)"
    caches = sorted({r.get("triton_cache", "unknown") for r in rows})
    lines = [f"{rows[0]['machine']}, commit {rows[0]['commit'][:9]}, {rows[-1]['utc'][:10]}; compiled-kernel cache "
             f"(Triton, Inductor) at the start of each call: {', '.join(caches)}", "",
             "| stage | result | seconds | false claims | figures written | what failed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["kind"] == "tests":
            c = r.get("counts", {})
            what = ", ".join(f"{v} {k}" for k, v in c.items())
            lines.append(f"| `pytest -m gpu` | {r['status']} | {r['seconds']:.0f} | | | {what} |")
        else:
            lines.append(f"| {r['notebook']} | {r['status']} | {r['seconds']:.0f} | {r['false_claims']} | "
                         f"{r['figures_written']} | {r['detail'].replace('|', '/')} |")
    nbs = [r for r in rows if r["kind"] == "notebook"]
    passed = sum(r["status"] == "pass" and r["false_claims"] == 0 for r in nbs)
    lines += ["", f"Notebooks passing: {passed} of {len(nbs)}; notebook time {sum(r['seconds'] for r in nbs):.0f} s "
              f"(longest {max((r['seconds'] for r in nbs), default=0):.0f} s)."]
    return "\n".join(lines)


def summary_figures(rows: list[dict], notebooks: int | None = None) -> dict:
    """``workbook.gpu_notebooks_passed`` and ``workbook.gpu_run_seconds`` of a merged table. The run's seconds are a
    figure only when every one of the workbook's ``notebooks`` (default: as many as ``notebooks/`` holds) ran to its
    end, passing or failing: a notebook killed at its limit or not run would make the sum a lower bound read as the
    whole run's time (``None`` then)."""
    if notebooks is None:
        notebooks = len(_notebooks())
    nbs = [r for r in rows if r["kind"] == "notebook"]
    whole = len({r["stage"] for r in nbs}) == notebooks and all(r["status"] != "timeout" for r in nbs)
    return {"workbook.gpu_notebooks_passed": sum(r["status"] == "pass" and r["false_claims"] == 0 for r in nbs),
            "workbook.gpu_run_seconds": round(sum(r["seconds"] for r in nbs), 1) if whole else None}


def write_check(rows: list[dict], results_dir: Path, summary_path: Path | None = None) -> Path:
    """Keep a merged table (``merge_rows``) as the record ``results_dir/records/gpu_check.json`` (its header names
    the GPU, the commit that ran and the command) and merge ``summary_figures`` into the summary under the GPU's
    class. Returns the record's path."""
    from labkit.bench import SUMMARY_PATH
    from labkit.data import machine_class
    from labkit.figures import put_figure, read_summary, write_summary

    if not rows:
        raise ValueError("rows is empty: nothing ran")
    summary_path = Path(summary_path or SUMMARY_PATH)
    path = Path(results_dir) / "records" / "gpu_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {"device": rows[0]["machine"], "git_commit": rows[0]["commit"], "utc": rows[-1]["utc"],
           "command": "scripts/gpu_check.sh " + " ".join(r["stage"] for r in rows),
           "run": f"gpu-check@{rows[0]['commit']}"}
    path.write_text(json.dumps({"env": env, "data": {"rows": rows}}, indent=1) + "\n")
    summary = read_summary(summary_path)
    rel = path.resolve().relative_to(summary_path.resolve().parent.parent).as_posix() \
        if summary_path.resolve().parent.parent in path.resolve().parents else str(path)
    bars = {"workbook.gpu_notebooks_passed": ("notebooks", "== 10"), "workbook.gpu_run_seconds": ("s", "<= 1200")}
    for name, value in summary_figures(rows).items():
        unit, bar = bars[name]
        if value is None:  # not measured by this check: an earlier check's value no longer describes the code
            summary["figures"].get(name, {}).get("machines", {}).pop(machine_class(env["device"]), None)
            continue
        put_figure(summary, name, machine_class(env["device"]), value, unit, rel, env["run"], bar, env["device"])
    write_summary(summary, summary_path)
    return path


def tables_markdown(results_root: Path) -> str:
    """Each machine's committed gpu check (``results/<gpu>/records/gpu_check.json``) as its table."""
    parts = []
    for path in sorted(Path(results_root).glob("*/records/gpu_check.json")):
        rows = json.loads(path.read_text())["data"]["rows"]
        parts.append(table(rows) + f" Record: `{path.relative_to(results_root).as_posix()}`.")
    return "\n\n".join(parts) or "(no gpu check is committed yet)"
