"""The exercise cells of notebook ``NN``: ``notebooks/src/exercises/NN_<name>.py``, appended when notebooks are built.

``exercise_source("02_kv_cache")`` returns that file's percent-format text (or ``""`` when notebook 02 has none);
``labkit.workbook.build_notebooks`` appends it to the notebook's own source before converting, so the exercises come
after the notebook's takeaways, and the files the notebook engineers edit stay free of them.
"""

from __future__ import annotations

import re
from pathlib import Path

from labkit.data import REPO_ROOT

EXERCISE_DIR = REPO_ROOT / "notebooks" / "src" / "exercises"
_CHECK = re.compile(r"""check\(\s*["'](?P<name>\d\d\.\w+)["']""")


def exercise_file(stem: str, directory: Path = EXERCISE_DIR) -> Path | None:
    """The exercise source of the notebook whose file stem (``NN_topic``) or number (``NN``) is ``stem``."""
    number = stem[:2]
    found = sorted(directory.glob(f"{number}_*.py"))
    if len(found) > 1:
        raise ValueError(f"notebook {number} has {len(found)} exercise sources in {directory}; allowed: one")
    return found[0] if found else None


def exercise_source(stem: str, directory: Path = EXERCISE_DIR) -> str:
    """Percent-format cells to append to notebook ``stem`` (a leading newline keeps the last cell apart)."""
    f = exercise_file(stem, directory)
    return "" if f is None else "\n" + f.read_text()


def checked_names(stem: str, directory: Path = EXERCISE_DIR) -> list[str]:
    """The exercise names the check cells of notebook ``stem`` pass to ``check``, in order."""
    return _CHECK.findall(exercise_source(stem, directory))


def skeleton_source(name: str, directory: Path = EXERCISE_DIR) -> str:
    """The skeleton cell of exercise ``name`` as the notebook ships it: to start again, paste it over your cell."""
    cells = re.split(r"^# %%.*$", exercise_source(name[:2], directory), flags=re.M)
    for i, cell in enumerate(cells):
        if _CHECK.search(cell) and _CHECK.search(cell).group("name") == name:
            code = [c for c in cells[:i] if c.strip() and not c.lstrip().startswith("# ")]
            if code:
                return code[-1].strip("\n") + "\n"
    raise ValueError(f"exercise {name!r} has no skeleton cell in {directory}; allowed: "
                     f"{[n for nn in range(10) for n in checked_names(f'{nn:02d}', directory)]}")
