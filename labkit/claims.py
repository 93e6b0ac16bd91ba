"""Claims: every sentence of the workbook that states a measured number or a direction, checked by code.

A claim is a sentence, a condition over named figures and the machine class it holds on::

    Claim("Paged KV holds {kvcache.max_seqs_ratio:.1f}x the sequences of a contiguous cache sized to the workload",
          "kvcache.max_seqs_ratio > 1", machine="any")

* ``text`` is a ``str.format`` template whose fields are figure names (``{area.figure}`` with an optional format
  spec), rendered from the figures' values, so a number in it cannot drift from the record.
* ``condition`` is a Python expression over figure names: comparisons, arithmetic, ``and`` / ``or`` / ``not``,
  ``abs``, ``min``, ``max``, numbers, strings and booleans; nothing else is evaluated.
* ``machine``: ``"gpu"`` (holds on the GPU records; a CPU run shows the committed GPU value and says so),
  ``"cpu"``, or ``"any"`` (holds wherever the figure was measured).

Notebooks declare their claims as literal ``Claim(...)`` calls in code cells and show them with ``show(...)``, which
renders each sentence from the figures of the current run (or, for a claim of another machine class, from
``results/summary.json``), marks whether it holds, and raises under the ``gpu`` profile when one does not.
``python -m labkit claims`` reads every ``Claim(...)`` of ``notebooks/src/*.py`` without running anything,
evaluates each against ``results/summary.json`` and exits 1 naming every false claim, every figure that is missing
and every figure measured on another machine class than the claim's.
"""

from __future__ import annotations

import ast
import json
import math
import os
import string
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from labkit.models import REPO_ROOT

MACHINES = ("any", "gpu", "cpu")
_FUNCTIONS = {"abs": abs, "min": min, "max": max}
_COMPARE = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
            ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}


class ClaimError(ValueError):
    """A claim that cannot be evaluated: a bad condition, a missing figure, or a figure of another machine."""


@dataclass(frozen=True)
class Claim:
    """A sentence (``text``, a format template over figure names), the ``condition`` that makes it true, and the
    ``machine`` class it holds on ('any', 'gpu', 'cpu')."""

    text: str
    condition: str
    machine: str = "any"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"text={self.text!r}: a claim needs its sentence")
        if self.machine not in MACHINES:
            raise ValueError(f"machine={self.machine!r} is unknown; allowed: {MACHINES}")
        self.figures()  # refuse a bad condition when the claim is written, not when it is checked
        for name in self.text_figures():
            if "." not in name:
                raise ValueError(f"text field {{{name}}} is not a figure name ('area.figure')")

    def figures(self) -> list[str]:
        """Every figure the claim reads: the condition's and the text's, in order, without repeats."""
        return list(dict.fromkeys(_figure_names(_parse(self.condition)) + self.text_figures()))

    def text_figures(self) -> list[str]:
        return [f for _, f, _, _ in string.Formatter().parse(self.text) if f]


@dataclass
class Verdict:
    """A claim evaluated against figures: ``holds`` is None when it could not be evaluated (``problem`` says why)."""

    claim: Claim
    holds: bool | None
    sentence: str
    source: str  # where the figures came from: 'this run' or the summary's machine and record
    problem: str = ""
    where: str = ""  # the notebook source that declares it (set by ``collect``)


# --- conditions ---------------------------------------------------------------------------------------------------
def _parse(condition: str) -> ast.Expression:
    if not isinstance(condition, str) or not condition.strip():
        raise ValueError(f"condition={condition!r}: need an expression over figure names, e.g. 'engine.x > 1'")
    try:
        tree = ast.parse(condition, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"condition={condition!r} is not an expression: {e.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant,
                                 ast.Attribute, ast.Name, ast.Call, ast.Load, ast.And, ast.Or, ast.Not, ast.USub,
                                 *_COMPARE, *_BINARY)):
            raise ValueError(f"condition={condition!r}: {type(node).__name__} is not allowed (comparisons, "
                             f"arithmetic, and/or/not, abs/min/max, constants and figure names)")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            raise ValueError(f"condition={condition!r}: only {sorted(_FUNCTIONS)} may be called")
    return tree


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _figure_names(tree: ast.AST) -> list[str]:
    """The figure names a condition reads, in order: each outermost dotted name (not a called function's)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Attribute, ast.Name)):
            names.append(_dotted(node) or "")
            return
        if isinstance(node, ast.Call):
            for a in node.args:
                visit(a)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    for n in names:
        if "." not in n or "__" in n:
            raise ValueError(f"{n!r} is not a figure name ('area.figure')")
    return names


def _evaluate(node: ast.AST, values: dict):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, values)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Attribute, ast.Name)):
        name = _dotted(node)
        if name not in values:
            raise ClaimError(f"figure {name!r} is not in the figures")
        return values[name]
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = _evaluate(right_node, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        parts = (_evaluate(v, values) for v in node.values)
        return all(parts) if isinstance(node.op, ast.And) else any(parts)
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand, values)
        return (not v) if isinstance(node.op, ast.Not) else -v
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, ast.Call):
        return _FUNCTIONS[node.func.id](*(_evaluate(a, values) for a in node.args))
    raise ClaimError(f"cannot evaluate {ast.dump(node)}")


# --- figures ------------------------------------------------------------------------------------------------------
def machine_class(machine: str) -> str:
    """'cpu' for a figure measured on the CPU, else 'gpu' (figures carry the GPU's name)."""
    return "cpu" if machine == "cpu" else "gpu"


def _value(entry: dict):
    v = entry["value"]
    return float(v) if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf") else v


def _namespace(values: dict) -> dict:
    """``{'area': SimpleNamespace(figure=value)}`` so that '{area.figure:.2f}' formats a figure's value."""
    areas: dict[str, dict] = {}
    for name, v in values.items():
        area, _, rest = name.partition(".")
        areas.setdefault(area, {})[rest] = v
    return {a: SimpleNamespace(**kv) for a, kv in areas.items()}


def evaluate(claim: Claim, figures: dict, fallback: dict | None = None, here: str | None = None) -> Verdict:
    """Evaluate ``claim`` against ``figures`` (name -> summary entry with 'value' and 'machine').

    A claim of one machine class reads each figure from ``figures`` when measured there on that class, else from
    ``fallback`` (the committed summary) when that one was. ``here``: the machine class of the current run (figures
    of this run are then labelled 'this run').
    """
    values, sources, problems = {}, set(), []
    for name in claim.figures():
        entry = None
        for pool, label in ((figures, "this run" if here else None), (fallback or {}, None)):
            e = pool.get(name)
            if e is not None and (claim.machine == "any" or machine_class(e["machine"]) == claim.machine):
                entry, src = e, label or f"{e['machine']}, {Path(e.get('record', '?')).name}"
                break
        if entry is None:
            seen = figures.get(name) or (fallback or {}).get(name)
            problems.append(f"{name} is missing" if seen is None else
                            f"{name} was measured on {seen['machine']}, the claim holds on {claim.machine}")
            continue
        values[name], _ = _value(entry), sources.add(src)
    source = "; ".join(sorted(sources))
    if problems:
        return Verdict(claim, None, claim.text, source, "; ".join(problems))
    try:
        holds = bool(_evaluate(_parse(claim.condition), values))
        sentence = claim.text.format_map(_namespace(values))
    except (ClaimError, TypeError, ValueError, ZeroDivisionError) as e:
        return Verdict(claim, None, claim.text, source, f"{type(e).__name__}: {e}")
    if any(isinstance(v, float) and math.isnan(v) for v in values.values()):
        holds = False
    return Verdict(claim, holds, sentence, source)


# --- notebooks ----------------------------------------------------------------------------------------------------
def collect(sources: list[Path] | None = None) -> list[tuple[str, Claim]]:
    """Every literal ``Claim(...)`` call in the notebook sources, as ``(file:line, Claim)``, without running them.
    A ``Claim`` whose arguments are not literals is an error: the checker could not read it."""
    sources = sorted((REPO_ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")) if sources is None else sources
    found = []
    for path in sources:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node.func) in ("Claim", "claims.Claim"):
                where = f"{Path(path).name}:{node.lineno}"
                try:
                    args = [ast.literal_eval(a) for a in node.args]
                    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                except ValueError:
                    raise ValueError(f"{where}: Claim(...) arguments must be literals (the checker reads them "
                                     f"without running the notebook)") from None
                found.append((where, Claim(*args, **kwargs)))
    return found


def load_summary(path: Path | str | None = None) -> dict:
    from labkit.bench import SUMMARY_PATH

    return json.loads(Path(path or SUMMARY_PATH).read_text())["figures"]


def check_all(summary: Path | str | None = None, sources: list[Path] | None = None) -> list[Verdict]:
    """Every claim of the notebooks evaluated against the committed summary."""
    figures = load_summary(summary)
    verdicts = []
    for where, c in collect(sources):
        v = evaluate(c, figures)
        v.where = where
        verdicts.append(v)
    return verdicts


def report(verdicts: list[Verdict]) -> str:
    bad = [v for v in verdicts if v.holds is not True]
    lines = [f"{len(verdicts)} claims checked against results/summary.json: {len(verdicts) - len(bad)} hold, "
             f"{sum(v.holds is False for v in verdicts)} false, {sum(v.holds is None for v in verdicts)} "
             f"not evaluable"]
    for v in bad:
        why = v.problem or f"condition {v.claim.condition!r} is false"
        lines.append(f"  {'FALSE' if v.holds is False else 'UNCHECKED'} {v.where}: {v.sentence} -- {why}")
    return "\n".join(lines)


def show(*claims: Claim, title: str = "Takeaways"):
    """Render claims in a notebook as a takeaway box, each sentence from the figures, marked by whether it holds.

    Figures come from this run's ``figures.json`` (``LABKIT_OUT``) and, for claims of the other machine class,
    from ``results/summary.json``. Under the ``gpu`` profile a claim that is false or cannot be evaluated raises
    ``AssertionError`` (the run fails); under ``ci`` and ``cpu`` it is shown as not holding in this run.
    """
    from IPython.display import Markdown, display

    from labkit.bench import machine_tag, output_dir

    path = output_dir() / "figures.json"
    run = json.loads(path.read_text()) if path.exists() else {}
    here = machine_class(machine_tag())
    verdicts = [evaluate(c, run, load_summary(), here=here) for c in claims]
    lines = [f"**{title}**", ""]
    for v in verdicts:
        mark = {True: "✓", False: "✗ (does not hold in this run)", None: f"? ({v.problem})"}[v.holds]
        lines.append(f"- {v.sentence} <sub>{mark}; {v.source or 'no figure'}</sub>")
    display(Markdown("\n".join(lines)))
    if os.environ.get("LABKIT_PROFILE") == "gpu":
        bad = [v for v in verdicts if v.holds is not True]
        assert not bad, "false claims: " + "; ".join(f"{v.claim.text!r} ({v.problem or v.claim.condition})"
                                                     for v in bad)
    return verdicts


def write_figures(verdicts: list[Verdict], summary: Path | str | None = None) -> Path:
    """Record the check (``workbook.claims_checked``, ``workbook.claims_false``) in a record beside the summary and
    merge both figures into it."""
    from labkit.bench import RESULTS_DIR, SUMMARY_PATH, write_record

    summary = Path(summary or SUMMARY_PATH)
    rows = [{"where": v.where, "text": v.claim.text, "condition": v.claim.condition, "machine": v.claim.machine,
             "sentence": v.sentence, "holds": v.holds, "problem": v.problem, "source": v.source} for v in verdicts]
    path = write_record("claims", {"claims": rows}, out_dir=RESULTS_DIR / "cpu")
    data = json.loads(summary.read_text())
    rel = path.relative_to(summary.parent.parent).as_posix() if summary.parent.parent in path.parents else str(path)
    for name, value, unit in (("workbook.claims_checked", len(verdicts), "claims"),
                              ("workbook.claims_false", sum(v.holds is not True for v in verdicts), "claims")):
        data["figures"][name] = {"value": value, "unit": unit, "machine": "cpu", "record": rel,
                                 **({"bar": "== 0"} if name.endswith("false") else {"bar": ">= 60"})}
    data["figures"] = dict(sorted(data["figures"].items()))
    summary.write_text(json.dumps(data, indent=1) + "\n")
    return path
