"""Claims: every sentence of the workbook that states a measured number or a direction, checked by code.

A claim is a sentence, a condition over named figures and the machines it holds on::

    Claim("Paged KV holds {kvcache.max_seqs_ratio:.1f}x the sequences of a contiguous cache sized to the workload",
          "kvcache.max_seqs_ratio > 1", machine="any")

* ``text`` is a template whose fields are figure names (``{area.figure}`` with an optional format spec), rendered
  from the figures' values, so a number in it cannot drift from the record. A field may pick its words from the
  data instead of printing the value: ``{kernels.w8_gemv_speedup_vs_bf16:if >= 2 then reaches else falls short of}``
  (``if OP OPERAND then WORDS else WORDS``; the operand is a number or another figure). Where a lesson's direction
  differs between machines, the sentence says what each machine measured instead of stating one outcome.
* ``condition`` is a Python expression over figure names: comparisons, arithmetic, ``and`` / ``or`` / ``not``,
  ``abs``, ``min``, ``max``, numbers, strings and booleans; nothing else is evaluated.
* ``machine``: ``"gpu"`` (holds on every GPU class the summary holds: ``h100``, ``h200``, ...), ``"cpu"``, or
  ``"any"`` (every machine that measured all its figures).

Figures are kept per machine class (``labkit.figures.machine_class``) and carry the run that recorded them. A claim is
evaluated on one machine at a time, from figures of that machine only, and all of them of one run: a comparison of
figures from two runs (two notebooks run apart, a figure merged later) is flagged ``cross-run`` and not evaluated.

The checker refuses (``ClaimRefused``, naming the rule) a claim that cannot fail or tests nothing: a condition that
reads no figure (*vacuous*), a figure compared with itself (*self-compared*), a condition true whatever the figures'
values (*tautological*), a condition that reads only figures the code sets (*derived-only*: configuration or
arithmetic, recorded with ``record_figure(..., derived=True)``), and a boolean compared as a number
(*boolean-as-number*). The first three are refused when the claim is written, the last two when it is checked.

Notebooks declare their claims as literal ``Claim(...)`` calls in code cells and show them with ``show(...)``.
``python -m labkit claims`` reads every ``Claim(...)`` of ``notebooks/src/*.py`` without running anything, checks
each against every machine of ``results/summary.json`` it applies to, prints a table claim x machine and exits 1 on a
false or refused claim.
"""

from __future__ import annotations

import ast
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from labkit.conditions import (
    ClaimError,
    ClaimRefused,
    bool_as_number,
    check_name,
    dotted,
    evaluate_expression,
    fields,
    figure_names,
    operand,
    parse,
    render,
    word_choice,
    wording_problems,
    written_refusal,
)
from labkit.data import REPO_ROOT, machine_class
from labkit.figures import machine_figures, read_summary, summary_classes

__all__ = ["MACHINES", "STATUSES", "Claim", "ClaimCheck", "ClaimError", "ClaimRefused", "RefusedClaim", "Verdict",
           "check_claim", "check_all", "collect", "evaluate", "machine_class", "render", "show",
           "wording_problems"]

MACHINES = ("any", "gpu", "cpu")
STATUSES = ("holds", "false", "missing", "cross-run", "refused")
"""A claim on one machine: it holds, it is false, a figure is missing there, its figures come from different runs,
or the checker refuses it."""


# --- claims -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    """A sentence (``text``, a template over figure names), the ``condition`` that makes it true, and the machines
    it holds on (``machine``: 'any', 'gpu', 'cpu'). Refused when written if the condition cannot fail
    (``ClaimRefused``: vacuous, self-compared, tautological)."""

    text: str
    condition: str
    machine: str = "any"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"text={self.text!r}: a claim needs its sentence")
        if self.machine not in MACHINES:
            raise ValueError(f"machine={self.machine!r} is unknown; allowed: {MACHINES}")
        parse(self.condition)
        for name, spec, _ in fields(self.text):
            if "." not in name:
                raise ValueError(f"text field {{{name}}} is not a figure name ('area.figure')")
            check_name(name)
            word_choice(spec)
        why = written_refusal(self.condition)
        if why:
            raise ClaimRefused(why)

    def condition_figures(self) -> list[str]:
        return list(dict.fromkeys(figure_names(parse(self.condition))))

    def text_figures(self) -> list[str]:
        """The figures the sentence renders, including those its word choices compare with."""
        names = []
        for name, spec, _ in fields(self.text):
            names.append(name)
            picked = word_choice(spec)
            if picked and operand(picked[1]) is None:
                names.append(picked[1])
        return list(dict.fromkeys(names))

    def figures(self) -> list[str]:
        """Every figure the claim reads: the condition's and the text's, in order, without repeats."""
        return list(dict.fromkeys(self.condition_figures() + self.text_figures()))

    def applies_to(self, machine: str) -> bool:
        """Whether the claim is checked on figures of machine class ``machine``."""
        return self.machine == "any" or (machine == "cpu") == (self.machine == "cpu")


@dataclass(frozen=True)
class RefusedClaim:
    """A ``Claim(...)`` of a notebook source that the checker refused as written, with the reason."""

    text: str
    condition: str
    machine: str
    reason: str


@dataclass
class Verdict:
    """A claim evaluated on the figures of one machine class: ``status`` is one of ``STATUSES``."""

    claim: Claim
    machine: str
    status: str
    sentence: str
    source: str = ""  # where the figures came from: 'this run' or the records and run
    problem: str = ""

    @property
    def holds(self) -> bool | None:
        return {"holds": True, "false": False}.get(self.status)


@dataclass
class ClaimCheck:
    """One claim of a notebook (``where``: file:line) checked on every machine it applies to."""

    claim: Claim | RefusedClaim
    where: str = ""
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def status(self) -> str:
        """'refused', 'false', 'holds' (held on every machine where it was evaluated), or 'unchecked'."""
        if isinstance(self.claim, RefusedClaim) or any(v.status == "refused" for v in self.verdicts):
            return "refused"
        if any(v.status == "false" for v in self.verdicts):
            return "false"
        return "holds" if any(v.status == "holds" for v in self.verdicts) else "unchecked"

    @property
    def problem(self) -> str:
        if isinstance(self.claim, RefusedClaim):
            return self.claim.reason
        return "; ".join(f"{v.machine}: {v.problem or 'condition ' + repr(v.claim.condition) + ' is false'}"
                         for v in self.verdicts if v.status != "holds")


def _value(entry: dict):
    v = entry["value"]
    return float(v) if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf") else v


def _partial(text: str, figures: dict) -> str:
    """The sentence with the fields it can fill filled, the others as '…' (for a claim that is not evaluated)."""
    try:
        return render(text, {n: _value(e) for n, e in figures.items()}, missing="…")
    except (ClaimError, TypeError, ValueError):
        return text


def evaluate(claim: Claim, figures: dict, machine: str | None = None, label: str | None = None) -> Verdict:
    """Evaluate ``claim`` on the figures of one machine class (name -> flat entry with ``value``, ``record``,
    ``run``, ``kind``; ``labkit.figures.machine_figures``). ``label``: how to name their source ('this run').

    Missing figures give 'missing'; figures of more than one run give 'cross-run'; a condition that reads only
    derived figures, or uses a boolean as a number, is 'refused'; a NaN figure makes the claim false."""
    machine = machine or "?"
    absent = [n for n in claim.figures() if n not in figures]
    partial = _partial(claim.text, figures)
    if absent:
        return Verdict(claim, machine, "missing", partial, label or "",
                       f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not measured on {machine}"
                       + (" in this run" if label == "this run" else ""))
    entries = {n: figures[n] for n in claim.figures()}
    runs = {n: e.get("run", "unknown") for n, e in entries.items()}
    records = sorted({Path(str(e.get("record", "?"))).name for e in entries.values()})
    source = label or f"{', '.join(records)} ({sorted(set(runs.values()))[0]})"
    if len(set(runs.values())) > 1:
        by_run: dict[str, list[str]] = {}
        for n, r in runs.items():
            by_run.setdefault(r, []).append(n)
        return Verdict(claim, machine, "cross-run", partial, label or ", ".join(records),
                       "figures of different runs: " + "; ".join(f"{', '.join(ns)} from run {r}"
                                                                 for r, ns in by_run.items()))
    values = {n: _value(e) for n, e in entries.items()}
    tree = parse(claim.condition)
    if any(v is None for v in values.values()):
        none = [n for n, v in values.items() if v is None]
        return Verdict(claim, machine, "false", claim.text, source, f"{', '.join(none)} is None (nothing was found)")
    cond = claim.condition_figures()
    if all(entries[n].get("kind") == "derived" for n in cond):
        return Verdict(claim, machine, "refused", claim.text, source,
                       f"refused (derived-only): condition {claim.condition!r} reads only figures the code sets "
                       f"({', '.join(cond)}: configuration or arithmetic), not a measurement; state it as plain "
                       f"text")
    flag = bool_as_number(tree, values)
    if flag:
        return Verdict(claim, machine, "refused", claim.text, source,
                       f"refused (boolean-as-number): {flag} is a boolean and the condition {claim.condition!r} "
                       f"uses it as a number; write '{flag} == True' or '{flag}'")
    try:
        holds = bool(evaluate_expression(tree, values))
        sentence = render(claim.text, values)
    except (ClaimError, TypeError, ValueError, ZeroDivisionError) as e:
        return Verdict(claim, machine, "refused", claim.text, source, f"cannot evaluate: {type(e).__name__}: {e}")
    if any(isinstance(v, float) and math.isnan(v) for v in values.values()):
        holds = False
    return Verdict(claim, machine, "holds" if holds else "false", sentence, source)


def check_claim(claim: Claim, summary: dict) -> list[Verdict]:
    """``claim`` on every machine class of ``summary`` (``labkit.figures.read_summary``) it applies to and that
    measured at least one of its figures."""
    out = []
    for c in summary_classes(summary):
        figs = machine_figures(summary, c)
        if claim.applies_to(c) and any(n in figs for n in claim.figures()):
            out.append(evaluate(claim, figs, c))
    return out


# --- notebooks ----------------------------------------------------------------------------------------------------
def collect(sources: list[Path] | None = None) -> list[tuple[str, Claim | RefusedClaim]]:
    """Every literal ``Claim(...)`` call in the notebook sources, as ``(file:line, Claim)``, without running them; a
    claim the checker refuses as written comes back as a ``RefusedClaim``. A ``Claim`` whose arguments are not
    literals is an error: the checker could not read it."""
    sources = sorted((REPO_ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")) if sources is None else sources
    found = []
    for path in sources:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and dotted(node.func) in ("Claim", "claims.Claim"):
                where = f"{Path(path).name}:{node.lineno}"
                try:
                    args = [ast.literal_eval(a) for a in node.args]
                    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                except ValueError:
                    raise ValueError(f"{where}: Claim(...) arguments must be literals (the checker reads them "
                                     f"without running the notebook)") from None
                try:
                    found.append((where, Claim(*args, **kwargs)))
                except ClaimRefused as e:
                    given = dict(zip(("text", "condition", "machine"), args), **kwargs)
                    found.append((where, RefusedClaim(given["text"], given["condition"], given.get("machine", "any"),
                                                      str(e))))
    return sorted(found, key=lambda wc: (wc[0].split(":")[0], int(wc[0].split(":")[1])))


def check_all(summary: Path | str | None = None, sources: list[Path] | None = None) -> list[ClaimCheck]:
    """Every claim of the notebooks checked on every machine of the committed summary it applies to."""
    data = read_summary(summary)
    return [ClaimCheck(c, where, [] if isinstance(c, RefusedClaim) else check_claim(c, data))
            for where, c in collect(sources)]


# --- notebooks: show and record -----------------------------------------------------------------------------------
def _mark(v: Verdict) -> str:
    return {"holds": "✓", "false": "✗ does not hold", "missing": "? not checked", "cross-run": "? not checked",
            "refused": "✗ refused"}[v.status]


def _statement(text: str, by_class: dict, committed: dict) -> str:
    """A plain statement (configuration, arithmetic, a definition) rendered from the first machine that holds all
    its figures, this run's first; not checked."""
    names = [n for n, _, _ in fields(text)]
    pools = [(m, figs, "this run") for m, figs in by_class.items()]
    pools += [(m, machine_figures(committed, m), "committed") for m in summary_classes(committed)]
    for m, figs, where in pools:
        if all(n in figs for n in names):
            try:
                sentence = render(text, {n: _value(figs[n]) for n in names})
            except (ClaimError, TypeError, ValueError):
                continue
            records = sorted({Path(str(figs[n].get("record", "?"))).name for n in names})
            return f"- {sentence} <sub>stated, not a claim; {m} {where}" + (
                f" ({', '.join(records)})" if records and where == "committed" else "") + "</sub>"
    return f"- {text} <sub>stated, not a claim; no figure yet</sub>"


class ClaimChecks(list):
    """``show``'s checks: a list of ``ClaimCheck`` that a notebook cell ending in ``show(...)`` does not print again
    (the box above is its display; the repr of every verdict ran to pages)."""

    def _ipython_display_(self) -> None:
        pass

    def __repr__(self) -> str:
        verdicts = [v.status for c in self for v in c.verdicts]
        return f"<{len(self)} claims: " + ", ".join(f"{verdicts.count(s)} {s}" for s in sorted(set(verdicts))) + ">"


def show(*items: Claim | str, title: str = "Takeaways", display=None) -> ClaimChecks:
    """Render claims in a notebook as a takeaway box: each sentence from the figures, marked per machine.

    A claim is evaluated on this run's figures (``figures.json`` of ``LABKIT_OUT``) for each machine class it applies
    to there, and on each committed machine of ``results/summary.json`` it applies to (another run: shown for
    reference). Under the ``gpu`` profile a claim that is false or refused on this run's own figures raises
    ``AssertionError`` (the run fails); a figure this run did not record (a notebook it did not run) is shown as not
    checked. Under ``ci`` and ``cpu`` nothing raises. A plain string among the claims is a statement of
    configuration or arithmetic (a constant is not a claim): rendered from the figures, not checked. ``display``:
    where the box's markdown text goes (default: IPython's ``display`` of it as ``Markdown``).
    """
    if display is None:
        from IPython.display import Markdown
        from IPython.display import display as ipython_display

        def display(text: str) -> None:
            ipython_display(Markdown(text))

    from labkit.bench import output_dir
    path = output_dir() / "figures.json"
    run = json.loads(path.read_text()) if path.exists() else {}
    by_class: dict[str, dict] = {}
    for name, e in run.items():
        by_class.setdefault(machine_class(e["machine"]), {})[name] = e
    committed = read_summary()
    lines, checks, bad = [f"**{title}**", ""], [], []
    for c in items:
        if isinstance(c, str):
            lines.append(_statement(c, by_class, committed))
            continue
        here = [evaluate(c, figs, m, "this run") for m, figs in by_class.items()
                if c.applies_to(m) and any(n in figs for n in c.figures())]
        before = check_claim(c, committed)
        checks.append(ClaimCheck(c, "", here + before))
        bad += [v for v in here if v.status in ("false", "refused")]
        shown = next((v for v in here + before if v.status in ("holds", "false")), None)
        mine = {id(v) for v in here}
        marks = [f"{_mark(v)} {v.machine} {'this run' if id(v) in mine else 'committed'}"
                 + (f" ({v.problem})" if v.problem else "" if id(v) in mine else f" ({v.source})")
                 for v in here + before]
        first = shown or next(iter(here + before), None)
        lines.append(f"- {first.sentence if first else c.text} <sub>{'; '.join(marks) or 'no figure yet'}</sub>")
        for v in here + before:
            if shown is not None and v is not shown and v.status in ("holds", "false") and v.sentence != shown.sentence:
                lines.append(f"  - {v.machine} {'this run' if id(v) in mine else 'committed'}: {v.sentence}")
    display("\n".join(lines))
    if os.environ.get("LABKIT_PROFILE") == "gpu":
        assert not bad, "claims not holding on this run's figures: " + "; ".join(
            f"{v.claim.text!r} on {v.machine} ({v.problem or v.claim.condition})" for v in bad)
    return ClaimChecks(checks)
