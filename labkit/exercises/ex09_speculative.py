"""Notebook 09 (speculative decoding): the speed-up model, predicted from alpha and the measured costs (then set
against the measured speed-up), and the k that maximises it at each batch size, or none.

The model is Leviathan et al. (2023): with acceptance rate ``alpha`` a step proposing ``k`` tokens emits
``E = (1 - alpha^(k+1)) / (1 - alpha)`` tokens and costs ``k c_d + c(k)`` plain target steps (``c_d``: one draft
step; ``c(k)``: one target forward over ``k + 1`` tokens). labkit's version is ``labkit.experiments.speculative``.
"""

from __future__ import annotations

from labkit.exercises.core import Case, Decision, Measurement, Prediction, diff, register
from labkit.exercises.measured import data_of, figure


def spec_speedup(alpha: float, k: int, verify_cost: float, draft_cost: float = 0.0) -> dict:
    """Solution: ``{"tokens_per_step": E, "speedup": E / (k draft_cost + verify_cost)}`` (``E = k + 1`` at
    ``alpha = 1``)."""
    e = float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return {"tokens_per_step": e, "speedup": e / (k * draft_cost + verify_cost)}


def _speedup_cases() -> list[Case]:
    rows = [(0.8, 4, 1.0, 0.0, "prompt lookup on a bandwidth-bound GPU step"),
            (0.259, 4, 1.26, 0.233, "the CPU's draft model (this notebook's cpu record)"),
            (1.0, 3, 1.1, 0.05, "every token accepted"), (0.0, 2, 1.0, 0.1, "nothing accepted: pure cost"),
            (0.6, 7, 1.63, 0.02, "batch 64 on the GPU: the verify step is no longer free"),
            (0.93, 1, 1.002, 0.26, "k = 1")]
    return [Case(f"{label}: alpha={a}, k={k}, c(k)={c}, c_d={d}", (a, k, c, d)) for a, k, c, d, label in rows]


def _speedup_measure() -> list[Measurement]:
    _, rec, source = figure("spec.measured_speedup_b1")
    data = data_of(rec, "notebook 09's measurements")
    k = max(data["sizes"]["ks"])
    alpha = {r["proposer"]: r["alpha implied by tokens/step"] for r in data["acceptance"] if r["k"] == k}
    c1 = next(r["ratio"] for r in data["verify_cost"] if r["batch"] == 1)
    out = []
    for proposer, c_d in (("draft", data["c_draft"]), ("prompt_lookup", 0.0)):
        def explain(pred, meas, proposer=proposer):
            extra = ("the draft model keeps its own cache" if proposer == "draft" else
                     "n-gram matching over the prompt and output, on the host")
            return (f"alpha here is the one the measured tokens per step imply, so E is right by construction; the "
                    f"gap is in the costs: c(k) and c_d were timed alone on fresh caches, while the measured run "
                    f"also pays the proposer's bookkeeping ({extra}), "
                    f"the rejection and the cache roll-back of every step, and its time includes the prefill; "
                    f"short runs on a shared machine add noise of their own (the record's spread over prompts, "
                    f"where it has one, shows how much)")
        out.append(Measurement(f"speed-up of speculative decoding over plain decoding, batch 1, {proposer}, k={k} "
                               f"(alpha {alpha[proposer]:.3f}, c(k) {c1:.3f}, c_d {c_d:.3f}: the record's own)",
                               (alpha[proposer], k, c1, c_d), data["measured"][proposer], "x", source, 0.25, explain,
                               pick=lambda obs: obs["speedup"]))
    return out


register(Prediction(
    "09.spec_speedup", "predict the speculative speed-up from alpha, k, the verify cost and the draft cost",
    spec_speedup, _speedup_cases, lambda fn, c: fn(*c), measure=_speedup_measure,
    hint="E = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha), k + 1 when alpha = 1; the step costs k "
         "draft steps and one verify, both in plain-step units"))


def best_k(alpha: float, verify_cost: dict[int, dict[int, float]], draft_cost: float = 0.0) -> dict:
    """Solution: for each batch size of ``verify_cost`` (batch -> {k -> c(k)}), the ``k`` with the highest predicted
    speed-up and that speed-up; ``(0, 1.0)`` where no ``k`` beats plain decoding (speed-up <= 1). On a tie the
    smaller ``k`` (fewer wasted rows)."""
    out = {}
    for batch, costs in sorted(verify_cost.items()):
        k, s = 0, 1.0
        for kk in sorted(costs):
            sp = spec_speedup(alpha, kk, costs[kk], draft_cost)["speedup"]
            if sp > s:
                k, s = kk, sp
        out[batch] = (k, s)
    return out


def _gpu_costs(batches=(1, 4, 16, 64, 256), ks=(1, 2, 4, 8)) -> dict[int, dict[int, float]]:
    """c(k) of a decode step that is bandwidth-bound until ``batch x (k + 1)`` rows reach a ridge of ~160."""
    return {b: {k: max(1.0, b * (k + 1) / 160) * (1 + 0.01 * k) for k in ks} for b in batches}


def _best_k_cases() -> list[Case]:
    cpu = {1: {1: 1.1, 2: 1.19, 4: 1.26}, 4: {1: 1.02, 2: 1.05, 4: 1.08}, 16: {1: 1.2, 2: 1.3, 4: 1.34},
           64: {1: 1.3, 2: 1.4, 4: 1.45}}
    rows = [(0.8, _gpu_costs(), 0.0, "alpha 0.8, GPU-like c(k), prompt lookup (free proposer)"),
            (0.8, _gpu_costs(), 0.1, "alpha 0.8, GPU-like c(k), a draft at 0.1 of a step"),
            (0.4, _gpu_costs(), 0.05, "alpha 0.4, GPU-like c(k), a cheap draft"),
            (0.26, cpu, 0.23, "the CPU record: alpha 0.26, c_d 0.23: it pays, barely, only where c(k) is lowest"),
            (0.95, {1: {1: 1.0, 3: 1.0, 5: 1.0, 7: 1.0}, 8: {1: 1.0, 3: 1.0, 5: 1.3, 7: 2.0}}, 0.0,
             "alpha 0.95, verification free at batch 1, not at batch 8"),
            (1.0, {2: {1: 1.0, 3: 2.0}, 3: {1: 2.0, 3: 4.0}}, 0.0,
             "alpha 1: a tie (k = 1 and k = 3 both 2x) at batch 2, and a tie at exactly 1x at batch 3")]
    return [Case(f"{label}; batches {sorted(c)}", (a, c, d)) for a, c, d, label in rows]


def _run_best_k(fn, data):
    alpha, costs, c_d = data
    out = fn(alpha, {b: dict(v) for b, v in costs.items()}, c_d)
    return {int(b): tuple(v) for b, v in out.items()} if isinstance(out, dict) else out


register(Decision(
    "09.best_k", "choose k at each batch size, or no speculation where it does not pay", best_k, _best_k_cases,
    _run_best_k, lambda e, a: diff(e, a, rtol=1e-9),
    hint="speed-up(k) = E(alpha, k) / (k c_d + c(k)) with c(k) of that batch; keep the best k, and (0, 1.0) when "
         "none is above 1; a tie keeps the smaller k"))
