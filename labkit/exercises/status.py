"""Each learner's exercise status, kept in one JSON file outside the repository.

The file is ``~/.labkit/exercises.json`` (the learner's, not the project's: a fresh clone or ``git clean`` keeps
it), or the path in ``LABKIT_EXERCISES_STATUS``. It maps an exercise name to ``{"status": "pass" | "fail" |
"not tried", "passed": n, "total": n, "when": ISO time}``; an exercise never checked is "not tried".
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

STATUSES = ("pass", "fail", "not tried")


def status_file(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$LABKIT_EXERCISES_STATUS``, else ``~/.labkit/exercises.json``."""
    if path is not None:
        return Path(path)
    env = os.environ.get("LABKIT_EXERCISES_STATUS")
    return Path(env) if env else Path.home() / ".labkit" / "exercises.json"


def load_status(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """The stored statuses (empty when the file is absent or unreadable: nothing was tried)."""
    f = status_file(path)
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_status(name: str, status: str, passed: int, total: int, path: str | os.PathLike | None = None) -> None:
    """Store one exercise's latest status. A pass stays a pass only until a later check fails: the file says
    what the learner's current code does."""
    if status not in STATUSES:
        raise ValueError(f"status={status!r} is unknown; allowed: {STATUSES}")
    f = status_file(path)
    data = load_status(f)
    data[name] = {"status": status, "passed": passed, "total": total,
                  "when": datetime.now(UTC).isoformat(timespec="seconds")}
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(f)
    except OSError as e:  # a read-only home must not break a check cell
        print(f"(could not record the status in {f}: {e})")
