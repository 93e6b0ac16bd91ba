"""The checker behind every exercise: run the learner's code and the reference on the same irregular cases.

An ``Exercise`` names its ``solution`` (labkit's own code where it exists), its ``cases`` (built from a seeded
generator, irregular on purpose: odd sizes, ragged batches, shared blocks) and a ``run(impl, case)`` that drives an
implementation through one case and returns what it observed (a value, a tensor, or a trace of steps). ``check``
runs the solution and the learner's code through the same ``run``, compares, prints which cases passed and, for
the first one that failed, the expected and actual values (for tensors: how many elements differ, where, and the
largest error); it never prints the solution.

A predict-then-measure exercise (``core.Prediction``) that passes its cases then sets the prediction against a
measurement (``labkit.exercises.measured``: this run's figures, else the committed records, and it says which): the
predicted and measured numbers, their ratio against the stated band, and why they differ. The band informs; it does
not fail the check (a first-principles model is allowed to miss, as long as the gap is explained).

Non-interactive runs (``python -m labkit run``, CI: the runner sets ``LABKIT_PROFILE``; or ``LABKIT_EXERCISES=
solutions``) meet skeletons that still raise ``NotImplementedError``: there ``check`` checks the solution instead
and says so, so the workbook's main job stays green and still proves every checker runs.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.exercises import catalogue  # noqa: F401  (registers every exercise)
from labkit.exercises.core import REGISTRY, Exercise, Prediction, diff
from labkit.exercises.status import record_status

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # labkit/: frames inside it are not the learner's


class ExerciseError(AssertionError):
    """The reference solution failed its own checker in a non-interactive run: a labkit bug, not the learner's."""


@dataclass
class Result:
    """What ``check`` found: ``status`` is 'pass', 'fail' or 'not tried'; ``message`` the report it printed."""

    name: str
    status: str
    passed: int
    total: int
    message: str
    used_solution: bool = False
    failures: list[str] = field(default_factory=list)
    measurements: list[dict] = field(default_factory=list)  # predict-then-measure: what was compared, and the band

    def __bool__(self) -> bool:
        return self.status == "pass"

    def __repr__(self) -> str:
        return f"Result({self.name!r}, {self.status!r}, {self.passed}/{self.total})"


def get_exercise(name: str | Exercise) -> Exercise:
    """The registered exercise ``name`` (an ``Exercise`` is returned as it is: one of your own, unregistered)."""
    if isinstance(name, Exercise):
        return name
    if name not in REGISTRY:
        raise ValueError(f"exercise {name!r} is unknown; allowed: {sorted(REGISTRY)}")
    return REGISTRY[name]


# --- running ------------------------------------------------------------------------------------------------
def _is_not_implemented(exc: BaseException, impl: Any) -> bool:
    """The skeleton's ``NotImplementedError``, even wrapped: Triton's interpreter wraps a kernel's exceptions, and
    its compiler (on a GPU) refuses ``raise`` altogether, so a kernel whose source still raises it counts too."""
    seen = exc
    while seen is not None:
        if isinstance(seen, NotImplementedError) or "NotImplementedError" in repr(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return "raise NotImplementedError" in (getattr(impl, "src", None) or "")  # a @triton.jit kernel's source


def _learner_frame(exc: BaseException) -> str:
    """The last traceback line that is not inside labkit or torch: where in the learner's code it raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_PACKAGE_DIR) and "site-packages" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"\n  at {f.filename}:{f.lineno}: {f.line}" if f.line else ""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text[:120] if text else type(exc).__name__


def run_cases(ex: Exercise, impl: Any) -> tuple[int, int, list[str], BaseException | None]:
    """Run every case until the first failure: (passed, total, report lines, the exception the impl raised)."""
    compare = ex.compare or diff
    cases = ex.cases()
    lines, passed = [], 0
    for i, case in enumerate(cases, 1):
        expected = ex.run(ex.solution, case.data)
        try:
            actual = ex.run(impl, case.data)
        except Exception as e:  # the learner's code raised: show what and where, then stop
            lines.append(f"  FAILED case {i}/{len(cases)}: {case.label}")
            lines.append(f"    your code raised {type(e).__name__}: {e}{_learner_frame(e)}")
            return passed, len(cases), lines, e
        problem = compare(expected, actual)
        if problem:
            lines.append(f"  FAILED case {i}/{len(cases)}: {case.label}")
            lines += ["    " + ln for ln in problem.split("\n")]
            if ex.hint:
                lines.append(f"    hint: {ex.hint}")
            return passed, len(cases), lines, None
        passed += 1
        lines.append(f"  passed case {i}/{len(cases)}: {case.label}")
    return passed, len(cases), lines, None


def _show(value: Any, unit: str = "") -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return f"{text} {unit}".rstrip()


def measure_lines(ex: Prediction, impl: Any, whose: str) -> tuple[list[str], list[dict]]:
    """Run ``impl`` on the inputs of each measurement of ``ex`` and compare: report lines and one dict per row."""
    try:
        rows = ex.measure()
    except (LookupError, TypeError, ValueError) as e:  # no record, or one of an older shape
        return [f"  predict then measure: no measurement to compare with ({e})"], []
    if not rows:
        return ["  predict then measure: no measurement to compare with in this run or the committed records"], []
    lines, out = [], []
    for m in rows:
        try:
            predicted = m.pick(ex.run(impl, m.inputs))
        except Exception as e:  # the inputs of a real run can differ from the cases: show, never hide
            lines.append(f"  predict then measure: {m.what}: your code raised {type(e).__name__}: {e}")
            out.append({"what": m.what, "error": f"{type(e).__name__}: {e}"})
            continue
        inside, verdict = m.compare(predicted)
        width = max(len(whose) + 11, len(m.measured_as)) + 1
        lines += [f"  predict then measure: {m.what}",
                  f"    {whose + ' prediction:':<{width}} {_show(predicted, m.unit)}",
                  f"    {m.measured_as + ':':<{width}} {_show(m.measured, m.unit)}  (from {m.source})",
                  f"    {verdict}",
                  f"    why they differ: {m.explain(predicted, m.measured)}"]
        out.append({"what": m.what, "predicted": predicted, "measured": m.measured, "inside": inside,
                    "source": m.source})
    return lines, out


def non_interactive() -> bool:
    """True under the workbook runner (it sets ``LABKIT_PROFILE``) or with ``LABKIT_EXERCISES=solutions``."""
    return bool(os.environ.get("LABKIT_PROFILE")) or os.environ.get("LABKIT_EXERCISES") == "solutions"


def run_check(name: str | Exercise, impl: Any, *, verbose: bool = True, record: bool | None = None,
          status_path: str | os.PathLike | None = None, solution_if_skeleton: bool | None = None) -> Result:
    """Check ``impl`` (a function, class or Triton kernel, as the exercise asks) against exercise ``name``.

    Prints which cases passed and the first that failed (expected vs actual) unless ``verbose=False``; returns a
    ``Result`` (truthy on a pass). ``record`` (default: when interactive) stores the status for ``python -m labkit
    exercises`` in ``status_path`` (default ``labkit.exercises.status.status_file()``). ``solution_if_skeleton``
    (default: when non-interactive) checks the reference solution when ``impl`` is still the skeleton.
    """
    ex = get_exercise(name)
    auto = non_interactive()
    record = (not auto) if record is None else record
    solution_if_skeleton = auto if solution_if_skeleton is None else solution_if_skeleton
    passed, total, lines, exc = run_cases(ex, impl)
    used_solution = False
    if exc is not None and _is_not_implemented(exc, impl):
        if solution_if_skeleton:
            used_solution = True
            passed, total, lines, exc = run_cases(ex, ex.solution)
            lines.insert(0, "  the skeleton is not filled in and this run is non-interactive: checking labkit's "
                            "reference solution instead")
            status = "pass" if passed == total else "fail"
        else:
            lines = [f"  not tried yet: your code still raises NotImplementedError ({_reason(exc)}); {total} cases "
                     f"wait"]
            status = "not tried"
    else:
        status = "pass" if passed == total else "fail"
    head = f"{ex.name}: {ex.title}"
    tail = (f"all {total} cases passed" if status == "pass" else
            f"{passed} of {total} cases passed" if status == "fail" else "")
    measured, compared = [], []
    if isinstance(ex, Prediction) and ex.measure is not None:
        if status == "pass":
            measured, compared = measure_lines(ex, ex.solution if used_solution else impl,
                                               "labkit's" if used_solution else "your")
        elif status == "fail":
            measured = ["  predict then measure: waits until every case passes"]
    message = "\n".join([head, *lines] + ([tail] if tail else []) + measured)
    if verbose:
        print(message)
    if record and not used_solution:
        record_status(ex.name, status, passed, total, status_path)
    if used_solution and status != "pass":
        raise ExerciseError(f"labkit's reference solution of {ex.name} fails its own checker:\n{message}")
    return Result(ex.name, status, passed, total, message, used_solution,
                  [ln for ln in lines if "FAILED" in ln], compared)
