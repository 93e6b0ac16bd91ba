"""Where an executed notebook came from: the hash of its source, the commit, the profile and the machine, stamped
into its metadata when it runs (``stamp_executed``), and which executed notebooks are stale because their source
changed since (``stale_executed``; the site and ``results/README.md`` mark them).
"""

from __future__ import annotations

import json
from pathlib import Path

from labkit.data import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"


def source_hash(nb: Path) -> str:
    """SHA-256 of a notebook's cells (kinds and sources, in order): what an executed copy was run from. The
    ``.ipynb`` in ``notebooks/`` is built from ``notebooks/src`` (a test checks they agree), so this hash changes
    exactly when a cell's source does."""
    import hashlib

    cells = json.loads(Path(nb).read_text()).get("cells", [])
    text = "\n\x00".join(c.get("cell_type", "") + "\x01" + "".join(c.get("source", "")) for c in cells
                          if "injected-parameters" not in c.get("metadata", {}).get("tags", []))
    return hashlib.sha256(text.encode()).hexdigest()


def stamp_executed(target: Path, source: Path, profile: str) -> None:
    """Write into the executed notebook ``target`` what it was run from: ``metadata.labkit`` = the source's hash,
    the commit, the profile and the machine (a run killed mid-way is stamped too: its cells are what ran)."""
    from labkit.bench import git_commit, machine_tag

    if not target.exists():
        return
    nb = json.loads(target.read_text())
    nb.setdefault("metadata", {})["labkit"] = {"source": source.name, "source_sha256": source_hash(source),
                                               "commit": git_commit(), "profile": profile, "machine": machine_tag()}
    target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def stale_executed(folder: Path, notebooks: Path = NOTEBOOK_DIR) -> dict[str, str]:
    """Executed notebooks under ``folder`` (``**/NN_*.ipynb``) whose source (the notebook of the same name in
    ``notebooks``) changed since they ran, or that carry no stamp (run before stamping existed): path relative to
    ``folder`` -> why. An executed notebook whose source no longer exists is stale too."""
    stale = {}
    for path in sorted(Path(folder).rglob("[0-9][0-9]_*.ipynb")):
        rel = path.relative_to(folder).as_posix()
        stamp = json.loads(path.read_text()).get("metadata", {}).get("labkit")
        source = Path(notebooks) / path.name
        if not source.exists():
            stale[rel] = f"no notebook {path.name} in notebooks/"
        elif not stamp:
            stale[rel] = "not stamped with its source's hash (run before stamping existed)"
        elif stamp.get("source_sha256") != source_hash(source):
            stale[rel] = f"stale: source changed after this run (commit {str(stamp.get('commit'))[:9]})"
    return stale


def records_markdown(results_root: Path) -> str:
    """One row per committed record under ``results_root`` (``<machine>/records/*.json``): the device, command,
    commit (``env.code_commit`` where the record has one: the device's copy of ``.git`` can be stale) and UTC time
    its ``env`` header names, so the table of what wrote each record is read from the records, never typed."""
    rows = ["| record | device | command | commit | UTC |", "| --- | --- | --- | --- | --- |"]
    for path in sorted(Path(results_root).glob("*/records/*.json")):
        env = json.loads(path.read_text()).get("env")
        rel = path.relative_to(results_root).as_posix()
        if not isinstance(env, dict):
            rows.append(f"| `{rel}` | | (no `env` header) | | |")
            continue
        command = str(env.get("command", "?")).replace("__main__.py", "python -m labkit")
        commit = str(env.get("code_commit") or env.get("git_commit") or "?")[:9]
        if env.get("code_note"):  # what the commit alone does not say (code run from an export of another commit)
            commit += f" ({env['code_note']})"
        rows.append(f"| `{rel}` | {env.get('device', '?')} | `{command}` | {commit} | {env.get('utc', '?')} |")
    return "\n".join(rows)
