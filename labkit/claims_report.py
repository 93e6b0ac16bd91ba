"""The claims check as the command prints and records it: ``python -m labkit claims`` (``report``: a table claim x
machine and every claim that does not hold) and ``--write`` (``write_figures``: ``workbook.claims_*`` and
``workbook.executed_stale`` in the summary). The checking itself is ``labkit.claims``.
"""

from __future__ import annotations

from pathlib import Path

from labkit.claims import ClaimCheck, RefusedClaim
from labkit.figures import class_order, put_figure, read_summary, write_summary

_CELL = {"holds": "holds", "false": "FALSE", "missing": "missing", "cross-run": "cross-run", "refused": "REFUSED"}


def claims_table(checks: list[ClaimCheck], width: int = 72) -> str:
    """A table claim x machine (holds / FALSE / missing / cross-run / REFUSED; blank: the machine measured none of
    its figures, or the claim is not about it), then every claim that is false, refused or evaluated nowhere."""
    classes = []
    for ch in checks:
        classes += [v.machine for v in ch.verdicts if v.machine not in classes]
    classes = class_order(classes)
    count = {s: sum(ch.status == s for ch in checks) for s in ("holds", "false", "refused", "unchecked")}
    lines = [f"{len(checks)} claims checked against results/summary.json on {', '.join(classes) or 'no machine'}: "
             f"{count['holds']} hold, {count['false']} false, {count['refused']} refused, {count['unchecked']} "
             f"evaluated on no machine (missing or cross-run figures)", ""]
    wide = max([len(ch.where) for ch in checks] + [5])
    head = f"{'where':<{wide}} | " + " | ".join(f"{c:<9}" for c in classes) + " | claim"
    lines += [head, "-" * len(head)]
    for ch in checks:
        by = {v.machine: v.status for v in ch.verdicts}
        cells = ["REFUSED" if isinstance(ch.claim, RefusedClaim) else _CELL.get(by.get(c, ""), "") for c in classes]
        text = ch.claim.text if len(ch.claim.text) <= width else ch.claim.text[:width - 3] + "..."
        lines.append(f"{ch.where:<{wide}} | " + " | ".join(f"{x:<9}" for x in cells) + f" | {text}")
    bad = [ch for ch in checks if ch.status in ("false", "refused", "unchecked")]
    if bad:
        lines += ["", "Not holding:"]
        for ch in bad:
            lines.append(f"  {ch.status.upper()} {ch.where}: {ch.problem or 'no machine measured its figures'}")
    return "\n".join(lines)


def write_figures(checks: list[ClaimCheck], summary: Path | str | None = None) -> Path:
    """Record the check in a record beside the summary (``<summary's folder>/cpu/records``) and merge its figures into
    it: ``workbook.claims_checked`` (claims evaluated on at least one machine), ``workbook.claims_false`` and
    ``workbook.claims_vacuous`` (claims the checker refuses), and ``workbook.executed_stale`` of that folder."""
    from labkit.bench import SUMMARY_PATH, run_id, write_record
    from labkit.provenance import stale_executed

    summary = Path(summary or SUMMARY_PATH)
    results = summary.parent
    rows = [{"where": ch.where, "text": ch.claim.text, "condition": ch.claim.condition, "machine": ch.claim.machine,
             "status": ch.status, "problem": ch.problem,
             "machines": {v.machine: {"status": v.status, "sentence": v.sentence, "source": v.source,
                                      "problem": v.problem} for v in ch.verdicts}} for ch in checks]
    path = write_record("claims", {"claims": rows}, out_dir=results / "cpu")
    data = read_summary(summary)
    rel = path.relative_to(summary.parent.parent).as_posix() if summary.parent.parent in path.parents else str(path)
    counts = {"workbook.claims_checked": (sum(ch.status in ("holds", "false") for ch in checks), ">= 60"),
              "workbook.claims_false": (sum(ch.status == "false" for ch in checks), "== 0"),
              "workbook.claims_vacuous": (sum(ch.status == "refused" for ch in checks), "== 0")}
    for name, (value, bar) in counts.items():
        put_figure(data, name, "cpu", value, "claims", rel, run_id(), bar)
    put_figure(data, "workbook.executed_stale", "cpu", len(stale_executed(results)), "executed notebooks", rel,
               run_id(), "== 0")
    write_summary(data, summary)
    return path
