"""What holds labkit's flash prefill back against SDPA's cuDNN backend: the measured account of notebook 03.

``research/flash_prefill_study.py`` times, in one GPU run at batch 4, 32 query / 8 KV heads, 4096 tokens, head dim
128, causal, bf16, SDPA's backends, labkit's kernel, a ladder of changes to a copy of it (one change a rung) and two
probes that drop part of the softmax (wrong values: timing only). Its record is committed per GPU as
``results/<gpu>/records/flash_prefill_study.json``; this module reads it into the notebook's table and the sentence
the table supports, rendered from the record (nothing typed by hand).
"""

from __future__ import annotations

import json
from pathlib import Path

from labkit.data import REPO_ROOT

RESULTS = REPO_ROOT / "results"
RECORD_NAME = "flash_prefill_study.json"


def load_account(machine: str = "h100", results: Path = RESULTS) -> dict | None:
    """The committed flash-prefill study of ``machine`` (its whole record: ``env`` and ``data``), or None."""
    path = Path(results) / machine / "records" / RECORD_NAME
    return json.loads(path.read_text()) if path.exists() else None


def account_rows(record: dict) -> list[dict]:
    """One row per timed kernel of the study: what it is (baseline, product, a rung of the ladder, a probe), its
    median microseconds, TFLOP/s and speed as a fraction of SDPA-cuDNN's, the tile it ran (BLOCK_M, BLOCK_N, warps,
    stages) or why none ran."""
    rows = []
    for r in record["data"]["table"]:
        kind = "product" if r["name"] == "v0 product" else r["kind"]
        rows.append({"kernel": r["name"], "kind": kind, "us": r["us"], "TFLOP/s": r["tflop_s"],
                     "x cuDNN": r["x_cudnn"], "tile": "x".join(map(str, r["tile"])) if r["tile"] else "",
                     "note": r["error"] or ""})
    return rows


def _by_name(record: dict) -> dict[str, dict]:
    return {r["name"]: r for r in record["data"]["table"]}


def account_reading(record: dict) -> str:
    """The reading the table supports, from its numbers: the product against cuDNN, the best rung, and what the
    probes leave (the MMAs alone against cuDNN; the softmax's time over them, and the exp2's share of it)."""
    t = _by_name(record)
    cudnn, product = t["sdpa_cudnn_gqa"]["us"], t["v0 product"]["us"]
    rungs = [r for r in record["data"]["table"] if r["kind"] == "variant" and r["us"] and r["name"] != "v0 product"]
    best = min(rungs, key=lambda r: r["us"]) if rungs else None
    mma, no_exp = t.get("probe mma-only", {}).get("us"), t.get("probe no-exp", {}).get("us")
    failed = [r["name"] for r in record["data"]["table"] if r["kind"] == "variant" and not r["us"]]
    text = (f"On the {record['env']['device']} (commit {str(record['env'].get('git_commit'))[:7]}), labkit's prefill "
            f"runs at {cudnn / product:.2f}x SDPA-cuDNN ({product:.0f} against {cudnn:.0f} us).")
    if best:
        verb = "passes" if best["us"] < cudnn else "stays behind"
        text += f" The best rung, '{best['name']}', {verb} cuDNN at {cudnn / best['us']:.2f}x."
    if failed:
        text += f" Not timed (no tile ran correctly): {', '.join(failed)}."
    if mma and no_exp:
        text += (f" With the softmax removed the two MMAs alone take {mma:.0f} us, {cudnn / mma:.2f}x cuDNN; the "
                 f"softmax between them costs {product - mma:.0f} us a call, {product - no_exp:.0f} of it the exp2.")
        if mma < cudnn:
            text += (" So the tensor-core work alone beats cuDNN: what holds the kernel back is the softmax it does "
                     "not hide behind the next tile's MMAs, as cuDNN and FlashAttention-3 do with two warpgroups "
                     "taking turns (warp specialisation).")
        else:
            text += " Even the MMAs alone are behind cuDNN: the tensor-core loop itself is what to change first."
    return text
