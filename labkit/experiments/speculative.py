"""What notebook 09 runs: the speedup model of speculative decoding, acceptance rates, the verify cost ratio and the
measured speedup (``labkit.engine.speculative``: through ``LLMEngine``).

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

import torch

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


def run_decoder(target: CausalLM, proposer, prompts, k: int, max_new_tokens: int, num_blocks: int = 512):
    """Greedy generation of ``prompts`` through ``LLMEngine`` speculating with ``proposer``'s method (``None`` or
    ``k = 0``: plain decoding); ``(outputs, stats, seconds)``, ``stats`` with ``acceptance_rate`` and
    ``tokens_per_step``. The notebook's former entry point, kept as a thin wrapper over the engine until notebook 09
    moves to ``labkit.experiments.speculative_runs``."""
    import time
    from types import SimpleNamespace

    from labkit.engine import DraftModelProposer, LLMEngine, SamplingParams, SpeculativeConfig

    spec = None
    if proposer is not None and k > 0:
        spec = (SpeculativeConfig("draft", k, draft_model=proposer.draft) if isinstance(proposer, DraftModelProposer)
                else SpeculativeConfig("prompt_lookup", k, prompt_lookup_max=proposer.max_ngram,
                                       prompt_lookup_min=proposer.min_ngram))
    eng = LLMEngine(target, num_blocks=num_blocks, max_num_seqs=len(prompts), speculative=spec)
    t0 = time.perf_counter()
    outs = eng.generate([list(p) for p in prompts], SamplingParams(max_tokens=max_new_tokens, ignore_eos=True),
                        progress=False)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    seconds = time.perf_counter() - t0
    st = eng.stats
    return ([o.output_token_ids for o in outs],
            SimpleNamespace(acceptance_rate=st.acceptance_rate, tokens_per_step=st.tokens_per_spec_decode or 1.0),
            seconds)


@torch.inference_mode()
def verify_cost_ratio(model: CausalLM, k: int, batch: int = 1, context: int = 512, iters: int = 10,
                      block_size: int = 16, kernels: str = "auto", cuda_graph: bool = False) -> dict:
    """Time of one target forward over ``k + 1`` tokens per sequence against one over 1 token per sequence, for
    ``batch`` sequences of ``context`` cached tokens; median seconds and their ratio ``c_verify(k)``.

    ``kernels``: the model's ``FusionPlan`` for the measurement ('auto': the engine's choice for the device, Triton
    on CUDA). ``cuda_graph``: time graph replays, as the engine runs its steps (a step that cannot be captured is
    timed eagerly; ``timed`` says which). The model's own plan is restored afterwards."""
    from labkit.bench import time_fn
    from labkit.model import FusionPlan

    previous = model.plan
    plan = model.use(FusionPlan.named(kernels, model.device, model.config).fit(model.config))
    cache = model.make_cache(batch * ((context + k + 1) // block_size + 2), block_size)
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
        try:
            (t1, tk), timed = medians(cuda_graph), "cuda_graph" if cuda_graph else "eager"
        except RuntimeError:  # a capture the step does not survive: time it as launched
            if not cuda_graph:
                raise
            (t1, tk), timed = medians(False), "eager (capture failed)"
    finally:
        model.use(previous)
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

