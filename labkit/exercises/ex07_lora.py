"""Notebook 07 (fine-tuning): choose a LoRA rank against a memory budget and a loss-against-rank table.

LoRA (``labkit.finetune.lora.LoRALinear``) adds ``A`` [r, in] and ``B`` [out, r] beside each adapted linear, so a
rank costs ``r (in + out)`` trainable numbers per linear per layer, each with an fp32 copy, an fp32 gradient and two
fp32 AdamW moments: 16 bytes (the memory model's ``finetune.full_ft_state_bytes_per_param`` for the same recipe).
The loss tables in the cases are what a rank sweep gives: falling fast, then flat, sometimes rising again.
"""

from __future__ import annotations

import random

from labkit.exercises.core import Case, Decision, diff, register
from labkit.model import ModelConfig, get_config

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(spec: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each linear of one layer of a Llama-family ``spec``."""
    h, q, kv, ff = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ff),
            "up_proj": (h, ff), "down_proj": (ff, h)}


def choose_lora_rank(spec: ModelConfig, losses: dict[int, float], budget_bytes: float, targets=LINEARS,
                     bytes_per_trainable: int = 16, loss_tolerance: float = 0.0) -> dict:
    """Solution: for each rank of ``losses`` (rank -> held-out loss after training), the trainable parameters of
    LoRA on the ``targets`` linears of every layer and their training-state bytes; the choice is the smallest rank
    whose state fits ``budget_bytes`` and whose loss is within ``loss_tolerance`` of the best loss that fits
    (``None`` when no rank fits)."""
    shapes = linear_shapes(spec)
    per_rank = spec.num_layers * sum(sum(shapes[t]) for t in targets)
    table = {r: {"trainable_params": r * per_rank, "bytes": r * per_rank * bytes_per_trainable, "loss": loss}
             for r, loss in sorted(losses.items())}
    fits = [r for r in table if table[r]["bytes"] <= budget_bytes]
    if not fits:
        return {"table": table, "choice": None}
    best = min(table[r]["loss"] for r in fits)
    return {"table": table, "choice": min(r for r in fits if table[r]["loss"] <= best + loss_tolerance)}


def _losses(ranks, floor, scale, seed, overfit_from=None) -> dict[int, float]:
    rng = random.Random(seed)
    out = {}
    for r in ranks:
        loss = floor + scale / r ** 0.7 + rng.uniform(-0.002, 0.002)
        if overfit_from and r >= overfit_from:
            loss += 0.01 * (r / overfit_from)
        out[r] = round(loss, 4)
    return out


def _cases() -> list[Case]:
    gemma_like = ModelConfig(name="gemma-like (head_dim 256, 16 heads on hidden 3072)", vocab_size=256000,
                             hidden_size=3072, num_layers=28, num_heads=16, num_kv_heads=16, head_dim=256,
                             intermediate_size=24576)
    ranks = [1, 2, 4, 8, 16, 32, 64, 128]
    rows = [("llama-3-8b", ranks, 1.2e9, LINEARS, 0.0, _losses(ranks, 1.9, 0.3, 0), "all 7 linears, 1.2 GB"),
            ("llama-3-8b", ranks, 1.2e9, LINEARS, 0.03, _losses(ranks, 1.9, 0.3, 0),
             "all 7 linears, 1.2 GB, within 0.03 of the best"),
            ("llama-3-8b", ranks, 0.4e9, ("q_proj", "v_proj"), 0.0, _losses(ranks, 2.0, 0.35, 1),
             "q and v only (the LoRA paper's choice), 400 MB"),
            ("llama-3-70b", [4, 8, 16, 64], 20e9, LINEARS, 0.0, _losses([4, 8, 16, 64], 1.5, 0.2, 2, overfit_from=16),
             "all 7 linears, 20 GB; rank 64 overfits"),
            (gemma_like, [2, 8, 32], 1e9, ("q_proj", "k_proj", "v_proj", "o_proj"), 0.04,
             _losses([2, 8, 32], 2.2, 0.25, 3), "attention only, head_dim 256, within 0.04"),
            ("gpt3-175b", [8, 16], 1e8, LINEARS, 0.0, _losses([8, 16], 1.7, 0.2, 4),
             "all 7 linears of the 175B, 100 MB: nothing fits")]
    return [Case(f"{get_config(s).name}: {label}; ranks {list(losses)}", (get_config(s), losses, b, tuple(t), tol))
            for s, _, b, t, tol, losses, label in rows]


def _run(fn, data):
    spec, losses, budget, targets, tol = data
    out = fn(spec, dict(losses), budget, tuple(targets), 16, tol)
    if isinstance(out, dict) and isinstance(out.get("table"), dict):
        out = {**out, "table": {int(r): v for r, v in out["table"].items()}}
    return out


register(Decision(
    "07.lora_rank", "choose the LoRA rank: training-state memory against held-out loss", choose_lora_rank, _cases,
    _run, lambda e, a: diff(e, a, rtol=1e-9),
    hint="per rank and layer: sum of (in + out) over the target linears (k and v project to num_kv_heads x head_dim, "
         "q to num_heads x head_dim); bytes = params x 16; among ranks that fit, the smallest within the tolerance "
         "of the best loss that fits"))
