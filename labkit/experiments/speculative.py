"""What notebook 09 runs: the speedup model of speculative decoding, the verify cost ratio, the table of predicted
speedup by batch size (measured ``c(k)`` x α, the published α of real draft pairs) and what a record's measured
speedup can and cannot be (``explain_speedup``). The engine runs (acceptance, timing over many prompts) are in
``labkit.experiments.speculative_runs``; the decoding itself is ``labkit.engine.speculative``.

The model (Leviathan et al. 2023, section 3). With per-token acceptance probability α, independent, a step that
proposes ``k`` tokens emits ``E = 1 + α + ... + α^k = (1 - α^(k+1)) / (1 - α)`` tokens on average (the accepted
run plus the target's own token). The step costs ``k`` draft steps and one target forward over ``k + 1`` tokens:
in units of a plain 1-token target step, ``k·c_draft + c_verify(k)``. So

    speedup = E / (k·c_draft + c_verify(k)).

At batch 1 on a GPU a target step reads every weight to make one token, so ``c_verify(k)`` is close to 1: the
``k`` extra rows ride on the same weight read. As the batch grows the step becomes compute-bound, ``c_verify``
tends to ``k + 1``, and the speedup falls below 1: where that happens is the batch size at which it stops paying.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from labkit.checks import check_int, check_number
from labkit.data import REPO_ROOT
from labkit.kvcache import SeqBlocks
from labkit.model.attention import ModelInput
from labkit.model.model import CausalLM


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """``(1 - α^(k+1)) / (1 - α)``: tokens one verify step emits on average (``k + 1`` at α = 1)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, verify_cost: float, draft_cost: float = 0.0) -> float:
    """Tokens per unit of plain-step time relative to plain decoding: ``E / (k·draft_cost + verify_cost)``;
    costs in units of one plain 1-token target step."""
    return expected_tokens_per_step(alpha, k) / (k * draft_cost + verify_cost)


def alpha_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """Invert ``expected_tokens_per_step`` by bisection: the α a measured mean of emitted tokens implies."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


@torch.inference_mode()
def verify_cost_ratio(model: CausalLM, k: int, batch: int = 1, context: int = 512, iters: int = 10,
                      block_size: int = 16, kernels: str = "auto", cuda_graph: bool = False) -> dict:
    """Time of one target forward over ``k + 1`` tokens per sequence against one over 1 token per sequence, for
    ``batch`` sequences of ``context`` cached tokens; median seconds and their ratio ``c_verify(k)``.

    ``kernels``: the model's ``FusionPlan`` for the measurement ('auto': the engine's choice for the device, Triton
    on CUDA). ``cuda_graph``: time graph replays, as the engine runs its steps (a step that cannot be captured is
    timed eagerly; ``timed`` says which). ``model`` itself keeps its plan (``CausalLM.use`` returns another view)."""
    from labkit.bench import time_fn

    cache = model.make_cache(batch * ((context + k + 1) // block_size + 2), block_size)
    model = model.use(kernels, cache)
    plan = model.plan
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for pool in cache.k_caches + cache.v_caches:
        pool.zero_()  # finite values where the context's K/V would be (the steps write only their own rows)
    seqs = [SeqBlocks(torch.randint(0, vocab, (context + k + 1,), generator=g).tolist(), s) for s in range(batch)]
    for seq in seqs:
        cache.allocate(seq)

    def step(q: int):
        for seq in seqs:  # the last q tokens are the step's (their K/V rewritten at each call)
            seq.num_computed = context + k + 1 - q
        inp = ModelInput.build(cache, seqs, [q] * batch, all_logits=True)  # every row's logits, as verify
        return lambda: model.forward_paged(inp, cache)

    def medians(graph: bool) -> tuple[float, float]:
        return tuple(time_fn(f, model.device, warmup=2, iters=iters, cuda_graph=graph).median_s
                     for f in (step(1), step(k + 1)))

    try:
        (t1, tk), timed = medians(cuda_graph), "cuda_graph" if cuda_graph else "eager"
    except RuntimeError:  # a capture the step does not survive: time it as launched
        if not cuda_graph:
            raise
        (t1, tk), timed = medians(False), "eager (capture failed)"
    return {"k": k, "batch": batch, "context": context, "t_1token_s": t1, "t_verify_s": tk, "ratio": tk / t1,
            "plan": "triton" if plan.attention == "triton" else "torch", "timed": timed}


def draft_cost_ratio(target: CausalLM, draft: CausalLM, context: int = 128, iters: int = 10) -> float:
    """A 1-token draft step over a 1-token target step at batch 1 (``c_draft``)."""
    t = verify_cost_ratio(target, 0, 1, context, iters)["t_1token_s"]
    d = verify_cost_ratio(draft, 0, 1, context, iters)["t_1token_s"]
    return d / t


def stop_paying_batch(alpha: float, k: int, verify_ratios: dict[int, float], draft_cost: float = 0.0) -> int | None:
    """The smallest measured batch size whose predicted speedup is below 1 (``None``: it pays at every one)."""
    for b in sorted(verify_ratios):
        if predicted_speedup(alpha, k, verify_ratios[b], draft_cost) < 1:
            return b
    return None


def wasted_flops_fraction(alpha: float, k: int) -> float:
    """Share of the verify forward's token rows whose result is thrown away: ``1 - E / (k + 1)``."""
    return 1 - expected_tokens_per_step(alpha, k) / (k + 1)


# --- when it pays: measured c(k) x alpha, by batch size ----------------------------------------------------------
PUBLISHED_ALPHA = (
    {"pair": "T5-XXL 11B / T5-small 77M, EnDe, greedy", "alpha": 0.75, "c_draft": 0.02},
    {"pair": "T5-XXL 11B / T5-small 77M, EnDe, sampled (T=1)", "alpha": 0.62, "c_draft": 0.02},
    {"pair": "T5-XXL 11B / T5-small 77M, CNN/DM, greedy", "alpha": 0.65, "c_draft": 0.02},
    {"pair": "T5-XXL 11B / T5-base 250M, EnDe, greedy", "alpha": 0.80, "c_draft": 0.04},
    {"pair": "T5-XXL 11B / bigram model, EnDe, greedy", "alpha": 0.20, "c_draft": 0.0},
    {"pair": "LaMDA 137B / LaMDA 100M, dialog, greedy", "alpha": 0.61, "c_draft": None},
    {"pair": "LaMDA 137B / LaMDA 8B, dialog, greedy", "alpha": 0.75, "c_draft": None},
)
"""Acceptance rates of real draft/target pairs as published: Leviathan, Kalman & Matias, "Fast Inference from
Transformers via Speculative Decoding" (ICML 2023), Table 3 (α, 10K tokens per setting) and Table 4 (``c``, the draft
step's cost relative to the target's, from profiler traces on TPU-v4; ``None`` where the paper gives none, the bigram's
0 from its section 4.2). Chen et al. (2023, Chinchilla 70B with a 4B draft) and the Medusa / EAGLE papers report
speedups and acceptance lengths of tree-shaped or multi-head drafts, not a per-token α of one chain: they are not
rows here."""
PUBLISHED_SOURCE = "Leviathan et al. 2023, Tables 3 and 4"


def gpu_verify_costs(record: Path | str | dict | None = None) -> dict:
    """The verify cost ratios ``c(k)`` by batch size of a GPU record of notebook 09 (default: the committed H200 one,
    ``results/h200/records/09_speculative.json``): ``{"device", "k", "context", "timed", "costs": {batch: c},
    "record"}``. ``ValueError`` for a record without a GPU measurement."""
    path = REPO_ROOT / "results" / "h200" / "records" / "09_speculative.json" if record is None else record
    rec = path if isinstance(path, dict) else json.loads(Path(path).read_text())
    rows = rec.get("data", {}).get("gpu_verify_cost")
    if not rows:
        raise ValueError(f"record {path if not isinstance(path, dict) else '(given)'} holds no gpu_verify_cost: it "
                         "was not run under the gpu profile")
    ks = {r["k"] for r in rows}
    if len(ks) != 1:
        raise ValueError(f"gpu_verify_cost mixes k={sorted(ks)}; expected one k")
    return {"device": rec["env"]["device"], "k": ks.pop(), "context": rows[0]["context"],
            "timed": rows[0].get("timed", "?"), "costs": {int(r["batch"]): float(r["ratio"]) for r in rows},
            "record": str(path) if not isinstance(path, dict) else None}


def speedup_by_batch(costs: dict[int, float], k: int, alphas=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8), c_draft: float = 0.0,
                  published=PUBLISHED_ALPHA, extra=()) -> pd.DataFrame:
    """Predicted speedup ``E(α, k) / (k·c_draft + c(k))`` for each batch size of ``costs`` (batch -> measured
    ``c(k)``: a ``k + 1``-token verify step over a 1-token step at that batch), one row per α: the sweep
    ``alphas`` (drafts of cost ``c_draft``), then ``published`` pairs (each its own ``c_draft``, the sweep's where
    it has none) and ``extra`` ones (dicts with ``pair``, ``alpha``, ``c_draft`` and optionally ``source``: this
    run's own pairs). Columns: ``draft``, ``alpha``, ``c_draft``, ``source``, then ``batch B`` per batch size."""
    check_int("k", k, 1)
    check_number("c_draft", c_draft, 0)
    if not costs:
        raise ValueError("costs is empty; give {batch: c(k)} for at least one batch size")
    for b, c in costs.items():
        check_int("batch", b, 1)
        check_number(f"costs[{b}]", c, 0, low_open=True)
    rows = [{"draft": f"alpha = {a:.1f}", "alpha": a, "c_draft": c_draft, "source": "sweep"} for a in alphas]
    for p, src in [(p, PUBLISHED_SOURCE) for p in published] + [(p, p.get("source", "this run")) for p in extra]:
        given = p.get("c_draft") is not None
        rows.append({"draft": p["pair"], "alpha": p["alpha"], "c_draft": p["c_draft"] if given else c_draft,
                     "source": src if given else f"{src} (c_draft not given: the sweep's)"})
    for r in rows:
        check_number("alpha", r["alpha"], 0, 1)
        for b in sorted(costs):
            r[f"batch {b}"] = predicted_speedup(r["alpha"], k, costs[b], r["c_draft"])
    return pd.DataFrame(rows)


# --- what a measured speedup can be -----------------------------------------------------------------------------
def explain_speedup(record: Path | str | dict, proposer: str = "prompt_lookup",
                    timed_tokens_per_step: float | None = None) -> dict:
    """Whether a notebook-09 record's measured batch-1 speedup of ``proposer`` can come from acceptance.

    A verify step emits ``E`` tokens on average (its accepted run plus the target's own) and costs ``c`` plain steps,
    so speculation cannot run more than ``E / c`` times faster. ``E``: the tokens per verify step of the timed prompt
    (``timed_tokens_per_step``, recomputed by the caller) or, without it, of the record's prompts at its largest
    ``k``; ``c``: the cheapest verify step the record timed at any batch size, and at most 1 (the most generous
    bound its own data allow). A measured speedup above ``bound = E / c`` is the timing's. The record's eager
    1-token steps show how much a host-bound step varied by itself: the largest inversion (a step of a larger batch
    faster than one of a smaller batch). Returns the figures and ``sentence``, one sentence saying so."""
    rec = record if isinstance(record, dict) else json.loads(Path(record).read_text())
    data, device = rec["data"], rec["env"]["device"]
    k = max(data["sizes"]["ks"])
    row = next(r for r in data["acceptance"] if r["proposer"] == proposer and r["k"] == k)
    e = float(timed_tokens_per_step if timed_tokens_per_step is not None else row["tokens/step"])
    cheapest = min(data["verify_cost"], key=lambda r: r["ratio"])
    c = min(1.0, float(cheapest["ratio"]))
    steps = sorted((int(r["batch"]), float(r["t_1token_s"])) for r in data["verify_cost"])
    inv = max(((a, b) for i, a in enumerate(steps) for b in steps[i + 1:] if a[1] > b[1]),
              key=lambda ab: ab[0][1] / ab[1][1], default=None)
    m, p = float(data["measured"][proposer]), float(data["predicted"][proposer])
    out = {"device": device, "proposer": proposer, "k": k, "measured": m, "predicted": p, "tokens_per_step": e,
           "cheapest_verify_cost": c, "cheapest_at_batch": int(cheapest["batch"]), "bound": e / c,
           "new_tokens": data["sizes"]["new"], "timing_artefact": m > e / c,
           "inversion": None if inv is None else {"small_batch": inv[0][0], "small_s": inv[0][1],
                                                   "large_batch": inv[1][0], "large_s": inv[1][1]}}
    who = "the timed prompt's" if timed_tokens_per_step is not None else "the record's"
    name = proposer.replace("_", " ")
    if not out["timing_artefact"]:
        out["sentence"] = (f"On the {device} {name} measured {m:.2f}x against a predicted {p:.2f}x, within the "
                           f"{e / c:.2f}x that {who} {e:.2f} tokens per verify step allow.")
        return out
    noise = ""
    if inv is not None:
        noise = (f" (in that run a 1-token step of batch {inv[0][0]} took {inv[0][1] * 1e3:.1f} ms and one of batch "
                 f"{inv[1][0]} {inv[1][1] * 1e3:.1f} ms: the host-bound eager step's time swung by itself)")
    out["sentence"] = (
        f"The {device}'s {m:.2f}x for {name} (predicted {p:.2f}x) is a timing artefact, not acceptance: {who} "
        f"proposals emit {e:.2f} tokens per verify step, so even at the cheapest verify step that record timed "
        f"({c:.2f} of a plain step, batch {out['cheapest_at_batch']}) no speedup above {e / c:.2f}x is possible; its "
        f"baseline and its speculative run were each timed once, on one prompt of {out['new_tokens']} tokens, the "
        f"baseline before the notebook's other measurements and the speculative run after them{noise}.")
    return out
