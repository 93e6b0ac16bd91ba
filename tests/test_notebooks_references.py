"""The notebooks refer only to what a reader has: no issue numbers (the tracker is not in the repository) and no
file that is not in it (a design note, a journal, a record that moved). Scanned: every notebook source, every
exercise source and every appendix file, prose and code alike."""

import re
from pathlib import Path

from labkit.data import REPO_ROOT

SOURCES = sorted([*(REPO_ROOT / "notebooks" / "src").glob("*.py"), *(REPO_ROOT / "notebooks" / "src" /
                                                                     "exercises").glob("*.py"),
                  *(p for p in (REPO_ROOT / "notebooks" / "appendix").iterdir() if p.is_file())])

ISSUE = re.compile(r"\bissues?\s+#?\d+|\bissue\s+[A-Z]?\d|(?<![\w&])#\d{1,6}\b|\bPR\s+#?\d+", re.I)
PATH = re.compile(r"[A-Za-z0-9_~./*${}\[\]-]+\.(?:md|py|json|ipynb|sh|txt|toml|csv|yaml|yml|html|log|nsys-rep)\b")
WRITTEN_BY_A_RUN = {"figures.json", "summary.md", "summary.json", "format_gemm.json", "quantization_passes.json",
                    "index.html", "exercises.json", "decode_bs1.nsys-rep"}
"""Files a run writes under its output folder (``--out``, ``LABKIT_OUT``, ``~/.labkit``): named, never committed."""


def issue_references(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE.finditer(text)]


def missing_files(text: str, here: Path) -> list[str]:
    """Path-like names in ``text`` that exist neither under the repository root nor beside ``here``; patterns
    (``*``, ``{...}``, ``$VAR``, ``NN_``) and files a run writes are not files to look for."""
    out = []
    for name in dict.fromkeys(m.group(0).strip("./") for m in PATH.finditer(text)):
        if any(c in name for c in "*{}$[]") or "NN_" in name or name.startswith(("out/", "~")):
            continue
        if Path(name).name in WRITTEN_BY_A_RUN and "/" not in name.replace("records/", ""):
            continue
        if not ((REPO_ROOT / name).exists() or (here.parent / name).exists()):
            out.append(name)
    return out


def test_the_scan_finds_issue_numbers_and_missing_files(tmp_path):
    text = ("# see issue 11 and issues #30; (#44) fixed it. DESIGN.md says so; results/h200/NOTES.md too.\n"
            "# notebooks/src/08_capstone.py exists, out/workbook/index.html and records/x_*.json are patterns,\n"
            "# figures.json is written by a run; the instruction issue rate is not an issue number.\n")
    assert issue_references(text) == ["issue 11", "issues #30", "#44"]
    assert missing_files(text, tmp_path / "nb.py") == ["DESIGN.md", "results/h200/NOTES.md"]


def test_no_notebook_refers_to_an_issue_number_or_a_file_not_in_the_repository():
    assert SOURCES and any(p.parent.name == "exercises" for p in SOURCES)
    found = []
    for path in SOURCES:
        text = path.read_text()
        found += [f"{path.relative_to(REPO_ROOT)}: issue reference {r!r}" for r in issue_references(text)]
        found += [f"{path.relative_to(REPO_ROOT)}: no such file {f!r}" for f in missing_files(text, path)]
    assert not found, "say what is meant instead:\n" + "\n".join(found)
