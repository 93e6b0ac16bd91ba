"""Figures per machine class and run: ``results/summary.json``, its README table and its bars.

A figure (``labkit.bench.record_figure``) is a named number with its unit, machine, run, kind (``measured``, or
``derived``: configuration or arithmetic the code sets) and the record it comes from. The summary keeps, per figure,
its unit, bar and kind, and each machine class's value side by side (``machine_class``: ``h100``, ``h200``, ``cpu``;
another device gets its own class, never a known one's): two GPUs never overwrite each other, and a claim compares
figures of one machine (``machine_figures``). ``merge_figures`` updates only the merging run's machine;
``summary_table`` and ``unmet_bars_markdown`` generate the README's table and the READMEs' lists of bars not met.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from labkit.bench import SUMMARY_PATH, machine_tag
from labkit.data import REPO_ROOT, machine_class


def class_order(classes) -> list[str]:
    """Machine classes in table order: the GPUs the workbook targets, other GPUs, joined classes, the CPU."""
    rank = {"h100": 0, "h200": 1}
    return sorted(set(classes), key=lambda c: (c == "cpu", "+" in c, rank.get(c, 2), c))


# --- the summary: figures per machine class ----------------------------------------------------------------------
SUMMARY_FORMAT = 2
_PER_MACHINE = ("value", "machine", "record", "run", "note")


def _legacy_run(record: str) -> str:
    """The run of a figure merged before runs were recorded: the commit of the code its record names
    (``env.code_commit`` where the record has one, else ``env.git_commit``): records of one commit on one machine
    count as one run."""
    path = Path(record) if Path(record).is_absolute() else REPO_ROOT / record
    try:
        env = json.loads(path.read_text())["env"]
    except (OSError, ValueError, KeyError):
        return "legacy@unknown"
    commit = env.get("code_commit") or env.get("git_commit") or "unknown"
    head, dirty = (commit[:-6], "-dirty") if commit.endswith("-dirty") else (commit, "")
    return f"legacy@{head[:12]}{dirty}"


def upgrade_summary(data: dict) -> dict:
    """A summary in the current format: one entry per figure (``unit``, ``bar``, ``kind``) holding each machine
    class's value side by side under ``machines`` (``value``, ``machine``, ``record``, ``run``, ``note``). A summary
    of the first format (one value per figure) becomes one with that value under its machine's class."""
    if data.get("format") == SUMMARY_FORMAT:
        return data
    out = {}
    for name, e in data.get("figures", {}).items():
        fig = {"unit": e.get("unit", ""), "kind": e.get("kind", "measured")}
        if e.get("bar"):
            fig["bar"] = e["bar"]
        per = {k: e[k] for k in _PER_MACHINE if k in e}
        per.setdefault("run", _legacy_run(e.get("record", "")))
        fig["machines"] = {machine_class(e["machine"]): per}
        out[name] = fig
    return {"format": SUMMARY_FORMAT, "figures": dict(sorted(out.items()))}


def read_summary(path: Path | str | None = None) -> dict:
    """``results/summary.json`` (or ``path``) in the current format; an empty summary when there is none."""
    path = Path(path or SUMMARY_PATH)
    if not path.exists():
        return {"format": SUMMARY_FORMAT, "figures": {}}
    return upgrade_summary(json.loads(path.read_text()))


def write_summary(summary: dict, path: Path | str | None = None) -> Path:
    path = Path(path or SUMMARY_PATH)
    summary["figures"] = {n: dict(f, machines={c: f["machines"][c] for c in class_order(f["machines"])})
                          for n, f in sorted(summary["figures"].items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": SUMMARY_FORMAT, "figures": summary["figures"]}, indent=1) + "\n")
    return path


def machine_figures(summary: dict, machine: str) -> dict:
    """The figures one machine class holds, flat: name -> entry with ``value``, ``unit``, ``machine`` (device
    name), ``record``, ``run``, ``kind``, ``bar``, ``note`` and ``class``."""
    out = {}
    for name, f in summary["figures"].items():
        e = f["machines"].get(machine)
        if e is not None:
            out[name] = {**{k: v for k, v in f.items() if k != "machines"}, **e, "class": machine}
    return out


def summary_classes(summary: dict) -> list[str]:
    """Every machine class the summary holds a figure of, in table order."""
    return class_order(c for f in summary["figures"].values() for c in f["machines"])


def committed_figures(prefer: tuple[str, ...] | None = None, path: Path | str | None = None) -> dict:
    """One value per figure, for code that quotes "the committed record" of a figure: name -> flat entry (as
    ``machine_figures``) of the first class of ``prefer`` that holds it. Default order: this machine's class when
    it is a GPU, then the H200, the H100, other GPUs, the CPU. A comparison between figures must read one
    machine's figures (``machine_figures``) instead."""
    summary = read_summary(path)
    if prefer is None:
        here = machine_class(machine_tag())
        prefer = tuple(dict.fromkeys(([here] if here != "cpu" else []) + ["h200", "h100"]
                                     + summary_classes(summary)))
    out = {}
    for name, f in summary["figures"].items():
        for c in (*prefer, *f["machines"]):
            if c in f["machines"]:
                out[name] = machine_figures({"figures": {name: f}}, c)[name]
                break
    return out


def put_figure(summary: dict, name: str, machine: str, value, unit: str, record: str, run: str,
               bar: str | None = None, device: str | None = None) -> None:
    """Set machine class ``machine``'s value of figure ``name`` in ``summary`` (as ``read_summary`` returns it),
    beside the values the other machines hold; ``device``: the device's name (default the class)."""
    fig = summary["figures"].setdefault(name, {"machines": {}})
    fig.update(unit=unit, kind="measured", **({"bar": bar} if bar else {}))
    fig["machines"][machine] = {"value": value, "machine": device or machine, "record": record, "run": run}


def merge_figures(figures_path: Path | str, record_root: Path | str, summary_path: Path | str = SUMMARY_PATH) -> dict:
    """Merge a run's ``figures.json`` into ``results/summary.json``, re-pointing each record path at
    ``record_root`` (the folder the run's output was committed to). Returns the merged summary.

    Each figure's value goes under the class of the machine it was measured on (``machine_class``), beside the
    values other machines hold, which stay as they are; the figure's unit, bar and kind are the run's."""
    figures = json.loads(Path(figures_path).read_text())
    summary = read_summary(summary_path)
    for name, entry in figures.items():
        rec = Path(entry["record"])
        parts = rec.parts
        rel = Path(*parts[parts.index("records"):]) if "records" in parts else Path(rec.name)
        per = {k: entry[k] for k in _PER_MACHINE if k in entry}
        per["record"] = (Path(record_root) / rel).as_posix()
        per.setdefault("run", "unknown")
        fig = summary["figures"].setdefault(name, {"machines": {}})
        fig["unit"] = entry.get("unit", fig.get("unit", ""))
        fig["kind"] = entry.get("kind", "measured")
        if entry.get("bar"):
            fig["bar"] = entry["bar"]
        fig["machines"][machine_class(entry["machine"])] = per
    write_summary(summary, summary_path)
    return summary


_BAR = re.compile(r"^\s*(<=|>=|==|<|>)\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*(?:\([^()]*\))?\s*$")


def bar_holds(bar: str | None, value) -> bool | None:
    """Whether ``value`` meets a bar written as ``'>= 2'``, ``'<= 0.15'``, ``'<= 0.15 (goal 0.08)'`` or ``'true'``;
    None when the bar is prose (``'< int4 RTN (0.0159)'``) or the value is not a number."""
    if not bar:
        return None
    if bar.strip().lower() in ("true", "false"):
        return value is (bar.strip().lower() == "true") if isinstance(value, bool) else None
    m = _BAR.match(bar)
    if m is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    op, x = m.group(1), float(m.group(2))
    return {"<=": value <= x, ">=": value >= x, "==": value == x, "<": value < x, ">": value > x}[op]


def format_value(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


MARKS = {True: "✓", False: "✗", None: ""}
"""How a table marks a value against its figure's bar: met, not met, or nothing (no bar, or a bar in prose)."""


def _link(record: str, link_root: str) -> str:
    return record[len(link_root):] if link_root and record.startswith(link_root) else record


def summary_table(summary_path: Path | str = SUMMARY_PATH) -> str:
    """The README's results table (markdown), generated from ``results/summary.json``: one row per figure, one column
    per machine class, each value linked to its record and marked against the figure's bar on that machine."""
    summary = read_summary(summary_path)
    classes = summary_classes(summary)
    rows = [f"Each value links to its record; ✓ / ✗: the figure's bar is met / not met on that machine "
            f"({', '.join(f'`{c}`' for c in classes)}: the classes of `labkit.data.machine_class`).", "",
            "| figure | unit | bar | " + " | ".join(classes) + " |", "| --- | --- | --- |" + " --- |" * len(classes)]
    for name, f in summary["figures"].items():
        cells = []
        for c in classes:
            e = f["machines"].get(c)
            if e is None:
                cells.append("")
                continue
            mark = MARKS[bar_holds(f.get("bar"), e["value"])]
            cells.append(f"[{format_value(e['value'])}]({e['record']})" + (f" {mark}" if mark else ""))
        rows.append(f"| `{name}` | {f.get('unit', '')} | {f.get('bar', '')} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def unmet_bars(summary_path: Path | str = SUMMARY_PATH) -> list[dict]:
    """Every figure that misses its bar on a machine: ``{figure, class, machine, value, bar, unit, record, note}``,
    machine by machine (a figure can meet its bar on one machine and miss it on another)."""
    summary = read_summary(summary_path)
    out = []
    for c in summary_classes(summary):
        for name, e in machine_figures(summary, c).items():
            if bar_holds(e.get("bar"), e["value"]) is False:
                out.append({"figure": name, "class": c, "machine": e["machine"], "value": e["value"],
                            "bar": e["bar"], "unit": e.get("unit", ""), "record": e["record"],
                            "note": e.get("note", "")})
    return out


def unmet_bars_markdown(summary_path: Path | str = SUMMARY_PATH, link_root: str = "") -> str:
    """The READMEs' "Bars not met" list, generated from the summary: per machine class, each figure under its
    bar with its value and record (links relative to ``link_root``: ``"results/"`` for ``results/README.md``)."""
    rows = unmet_bars(summary_path)
    if not rows:
        return "Every figure with a numeric bar meets it on every machine that measured it."
    lines = [f"{len(rows)} bars not met, by machine (generated from `results/summary.json` by "
             f"`python -m labkit readme`):"]
    for c in dict.fromkeys(r["class"] for r in rows):
        mine = [r for r in rows if r["class"] == c]
        lines.append(f"- **{c}** ({mine[0]['machine']}):")
        lines += [f"  - `{r['figure']}` {format_value(r['value'])} against {r['bar']} "
                  f"([{Path(r['record']).name}]({_link(r['record'], link_root)}))" for r in mine]
    return "\n".join(lines)
