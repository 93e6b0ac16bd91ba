"""Exercises and their cases, the registry, and the comparisons a checker reports (numbers, tensors, traces)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Case:
    """One input of an exercise: ``label`` is what the learner sees, ``data`` what ``run`` gets."""

    label: str
    data: Any


@dataclass
class Exercise:
    """A task, its reference ``solution``, how to build its ``cases`` and how to ``run`` one.

    ``run(impl, case_data)`` returns an observation; ``compare(expected, actual)`` returns ``None`` when they
    agree, else a short multi-line explanation (the default compares with ``diff``).
    """

    name: str
    title: str
    solution: Any
    cases: Callable[[], list[Case]]
    run: Callable[[Any, Any], Any]
    compare: Callable[[Any, Any], str | None] | None = None
    hint: str = ""
    kind: ClassVar[str] = "implement"  # what the learner does: see KINDS

    @property
    def notebook(self) -> str:
        return self.name.split(".")[0]


KINDS = ("implement", "decide", "predict-then-measure")
"""What an exercise asks: *implement* a piece of labkit (an allocator, a kernel, a scheduler step); *decide* (a group
size, a split, a rank, a k: the answer is a choice and the numbers that justify it); *predict-then-measure* (a number
from first principles, which the check then sets against a measurement of the run or the committed records)."""


@dataclass
class Decision(Exercise):
    """An exercise whose answer is a choice, returned with the numbers that justify it."""

    kind: ClassVar[str] = "decide"


@dataclass
class Measurement:
    """One measured number a prediction is set against.

    ``inputs`` is what the learner's function gets (as a case's data, through the exercise's ``run``) and ``pick``
    takes the predicted number out of what it returned. ``measured`` is the measurement (or, as ``measured_as``
    says, the reference it is set against), ``source`` where it comes from (this run's figures or the committed
    records, and the machine), ``tolerance`` the stated band on ``measured / predicted - 1`` (``None``: not a number,
    ``judge`` compares), and ``explain(predicted, measured)`` says why the two differ (what the first-principles
    model leaves out).
    """

    what: str
    inputs: Any
    measured: Any
    unit: str
    source: str
    tolerance: float | None
    explain: Callable[[Any, Any], str]
    pick: Callable[[Any], Any] = lambda obs: obs
    judge: Callable[[Any, Any], tuple[bool, str]] | None = None  # for non-numbers: (agrees, what it compared)
    measured_as: str = "measured"  # what the other side is, when it is not a measurement (the planner's answer)

    def compare(self, predicted: Any) -> tuple[bool, str]:
        """Whether ``predicted`` is inside the stated band around the measurement, and the line that says so."""
        if self.judge is not None:
            return self.judge(predicted, self.measured)
        if not isinstance(predicted, (int, float)) or isinstance(predicted, bool) or not predicted:
            return False, f"the prediction {predicted!r} is not a non-zero number"
        ratio = self.measured / predicted
        inside = abs(ratio - 1) <= self.tolerance
        return inside, (f"{self.measured_as} / predicted = {ratio:.3g}: {'inside' if inside else 'outside'} the "
                        f"stated band of ±{self.tolerance:.0%}")


@dataclass
class Prediction(Exercise):
    """A prediction from first principles: checked on cases like any exercise, then compared with a measurement.

    ``measure()`` returns the ``Measurement`` list to compare with (empty, or raising ``LookupError`` with the
    reason, when neither this run nor the committed records hold one).
    """

    measure: Callable[[], list[Measurement]] | None = None
    kind: ClassVar[str] = "predict-then-measure"


REGISTRY: dict[str, Exercise] = {}


def register(ex: Exercise) -> Exercise:
    if ex.name in REGISTRY:
        raise ValueError(f"exercise {ex.name!r} is registered twice")
    REGISTRY[ex.name] = ex
    return ex


# --- comparing ----------------------------------------------------------------------------------------------
def tensor_diff(expected: torch.Tensor, actual: Any, rtol: float = 1e-5, atol: float = 1e-6,
                show: int = 5) -> str | None:
    """``None`` when ``actual`` matches ``expected`` elementwise, else which elements differ and by how much."""
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor of shape {tuple(expected.shape)}, got {type(actual).__name__}: {_short(actual)}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape: expected {tuple(expected.shape)}, got {tuple(actual.shape)}"
    e, a = expected.detach().double().cpu(), actual.detach().double().cpu()
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=False)
    n_bad = int(bad.sum())
    if not n_bad:
        return None
    idx = bad.nonzero().tolist()
    lines = [f"{n_bad} of {e.numel()} elements differ (tolerance rtol={rtol:g}, atol={atol:g})",
             "first at " + ", ".join(str(i) for i in idx[:show]) + (" ..." if n_bad > show else "")]
    if e.dim() >= 2:
        rows = sorted({i[0] for i in idx})
        lines.append(f"in {len(rows)} of {e.shape[0]} rows along dim 0"
                     + (f": {rows[:8]}" + (" ..." if len(rows) > 8 else "") if len(rows) < e.shape[0] else ""))
    nan = bad & torch.isnan(a)
    if nan.any():
        lines.append(f"{int(nan.sum())} of them are NaN (never written? a masked-off or out-of-range load?)")
    lines += error_map(bad, nan)
    err = torch.where(bad & ~nan, (a - e).abs(), torch.full_like(a, -1.0))
    if (err >= 0).any():
        at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape)) if e.dim() else ()
        lines.append(f"max abs error {float(err[at]):.4g} at {list(at)}: expected {float(e[at]):.6g}, "
                     f"got {float(a[at]):.6g}")
    return "\n".join(lines)


def error_map(bad: torch.Tensor, nan: torch.Tensor, width: int = 64, max_lines: int = 8) -> list[str]:
    """A picture of where the wrong elements are, as Triton-Puzzles draws it: ``.`` right, ``x`` wrong, ``N`` NaN;
    one line per row (of the last two dims flattened), one character per run of columns when a row is long."""
    if bad.dim() >= 2:
        b, n = bad.reshape(-1, bad.shape[-1]), nan.reshape(-1, bad.shape[-1])
        per = -(-b.shape[1] // width)
    else:  # 1-D: wrap the elements over up to max_lines lines of width characters
        per = max(1, -(-bad.numel() // (width * max_lines)))
        b, n = bad.reshape(1, -1), nan.reshape(1, -1)
    chars = []
    for r in range(min(b.shape[0], max_lines)):
        row = "".join("N" if n[r, c:c + per].any() else "x" if b[r, c:c + per].any() else "."
                      for c in range(0, b.shape[1], per))
        chars.append(row)
    if bad.dim() < 2:
        chars = [chars[0][i:i + width] for i in range(0, len(chars[0]), width)]
    unit = "1 element" if per == 1 else f"{per} elements"
    head = f"where (. right, x wrong, N NaN; one character = {unit}" + (
        ", one line = one row)" if bad.dim() >= 2 else ")")
    more = [f"  ... {b.shape[0] - max_lines} more rows"] if bad.dim() >= 2 and b.shape[0] > max_lines else []
    return [head] + ["  " + c for c in chars[:max_lines]] + more


def _short(x: Any, n: int = 300) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + " ..."


NOTE = "note: "
"""Dict keys starting with this are shown in a report but never compared (what an exception said, say)."""


def diff(expected: Any, actual: Any, rtol: float = 1e-9, path: str = "") -> str | None:
    """Compare nested values (numbers with ``rtol``, tensors elementwise, lists step by step, dicts by key, except
    keys starting with ``NOTE``)."""
    where = f"{path}: " if path else ""
    if isinstance(expected, torch.Tensor):
        d = tensor_diff(expected, actual)
        return None if d is None else where + d
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return None if actual == expected else f"{where}expected {expected!r}, got {_short(actual)}"
    if isinstance(expected, (int, float)):
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return f"{where}expected the number {expected!r}, got {_short(actual)}"
        if abs(actual - expected) <= rtol * max(abs(expected), 1e-300) or actual == expected:
            return None
        return f"{where}expected {expected:.6g}, got {actual:.6g} (ratio {actual / expected:.4g})" \
            if expected else f"{where}expected 0, got {actual!r}"
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where}expected a dict with keys {sorted(expected)}, got {_short(actual)}"
        for k in expected:
            if isinstance(k, str) and k.startswith(NOTE):
                continue
            if k not in actual:
                return f"{where}missing key {k!r}"
            d = diff(expected[k], actual[k], rtol, f"{path}[{k!r}]" if path else repr(k))
            if d:
                return d
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            return f"{where}expected a {type(expected).__name__} of {len(expected)}, got {_short(actual)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            d = diff(e, a, rtol, f"{path}[{i}]")
            if d:
                return d
        if len(actual) != len(expected):
            return f"{where}expected {len(expected)} items, got {len(actual)}: {_short(actual)}"
        return None
    return None if actual == expected else f"{where}expected {_short(expected)}, got {_short(actual)}"


def whole_diff(expected: Any, actual: Any) -> str | None:
    """For small answers (a list of rows): both in full, then where they first differ."""
    d = diff(expected, actual)
    return None if d is None else f"expected {expected!r}\ngot      {_short(actual)}\nfirst difference: {d}"


def trace_diff(expected: list[tuple[str, Any]], actual: list[tuple[str, Any]]) -> str | None:
    """Compare two traces of ``(step, observation)``: the first step whose observation differs, and (when short)
    the whole observation of that step on both sides."""
    for i, ((step, e), (_, a)) in enumerate(zip(expected, actual)):
        d = diff(e, a)
        if d:
            done = "; ".join(s for s, _ in expected[max(0, i - 4):i])
            out = f"at step {i + 1} ({step})" + (f", after ... {done}" if done else "") + f"\n{d}"
            if len(repr(e)) <= 400:
                out += f"\nexpected after this step: {_state(e)}\nyours after this step:    {_state(a)}"
            return out
    if len(actual) < len(expected):
        return f"your run stopped after {len(actual)} of {len(expected)} steps"
    return None


def _state(obs: Any) -> str:
    if isinstance(obs, dict):
        return "; ".join(f"{k} {v}" for k, v in obs.items())
    return _short(obs)
