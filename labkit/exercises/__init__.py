"""Exercises: the learner writes the key pieces of each technique; labkit checks them against its own code.

The notebooks end with exercises (``notebooks/src/exercises/NN_<name>.py``, appended when the notebooks are built)
of three kinds (``core.KINDS``): *implement* a piece of labkit, *decide* (a choice and the numbers behind it),
and *predict-then-measure* (a number from first principles, then compared with a measurement of the run or the
committed records, with the gap explained). Each is a task, a skeleton cell that raises ``NotImplementedError``, and
a check cell::

    from labkit.exercises import check
    check("02.allocator", MyAllocator)

``check`` runs the learner's function, class or Triton kernel and labkit's solution on the same irregular cases,
prints which passed and, for the first failure, the expected and actual values (for tensors: which elements differ
and by how much). It never prints the solution. Under ``python -m labkit run`` and CI (non-interactive) a skeleton
that was not filled in is replaced by the solution, and the check says so. ``python -m labkit exercises`` lists every
exercise with this learner's status (``labkit.exercises.status``).
"""

from labkit.exercises.cells import exercise_source, skeleton_source
from labkit.exercises.core import KINDS, REGISTRY, Exercise, tensor_diff
from labkit.exercises.status import load_status, status_file


def check(name: str, impl, **options):
    """Check ``impl`` against exercise ``name`` and print the report; see ``labkit.exercises.checker.run_check``
    (imported here on first use: building notebooks needs this package, not the kernels and models the exercises
    load)."""
    from labkit.exercises.checker import run_check

    return run_check(name, impl, **options)


def exercises() -> list[Exercise]:
    """Every exercise in notebook order."""
    from labkit.exercises import catalogue  # noqa: F401  (registers them)

    return sorted(REGISTRY.values(), key=lambda e: e.name.split(".")[0])


def solution(name: str):
    """labkit's reference implementation of exercise ``name`` (to read after solving it)."""
    from labkit.exercises.checker import get_exercise

    return get_exercise(name).solution


def report(status_path=None) -> str:
    """A table of every exercise with the learner's status: pass, fail or not tried."""
    stored, all_ex = load_status(status_path), exercises()
    rows = [f"{'exercise':<22} {'kind':<21} {'status':<10} {'cases':<7} title"]
    for ex in all_ex:
        s = stored.get(ex.name, {})
        cases = f"{s['passed']}/{s['total']}" if "total" in s else ""
        rows.append(f"{ex.name:<22} {ex.kind:<21} {s.get('status', 'not tried'):<10} {cases:<7} {ex.title}")
    done = sum(1 for ex in all_ex if stored.get(ex.name, {}).get("status") == "pass")
    kinds = ", ".join(f"{sum(ex.kind == k for ex in all_ex)} {k}" for k in KINDS)
    rows.append(f"\n{done} of {len(all_ex)} passed ({kinds}); status kept in {status_file(status_path)}")
    return "\n".join(rows)


__all__ = ["Exercise", "check", "exercise_source", "exercises", "load_status", "report", "skeleton_source", "solution",
           "status_file", "tensor_diff"]
