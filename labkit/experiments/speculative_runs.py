"""Notebook 09's engine runs: acceptance of each proposer over many prompts, and the speedup timed prompt by prompt
with its spread, all through ``LLMEngine`` (``EngineConfig.speculative``) against the same engine decoding plainly.

Timing, both sides the same way: one engine per configuration (built once, warmed up on the first prompt), each
prompt generated alone (batch 1, the latency case speculation is for) by every configuration in turn, the order
rotated from prompt to prompt so that a drift of the machine (clocks, other load) falls on all of them alike;
``repeats`` runs per prompt and configuration, their median kept. The speedup of a prompt is the plain engine's
seconds over the configuration's; the summary gives its median, 10th and 90th percentiles and quartiles over the
prompts, never one prompt's ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from labkit.checks import check_int
from labkit.engine import LLMEngine, SamplingParams, SpeculativeConfig
from labkit.experiments.speculative import alpha_from_tokens_per_step

PLAIN = "plain"
"""The configuration name of plain decoding (no speculation), the baseline of every speedup."""


def make_engines(target, configs: Mapping[str, SpeculativeConfig | None], max_prompt: int, max_tokens: int,
                 max_num_seqs: int = 1, **engine_kw) -> dict[str, LLMEngine]:
    """One engine per configuration (``None``: plain decoding), each with a cache sized for ``max_num_seqs``
    sequences of ``max_prompt + max_tokens`` tokens (and the draft's as large); ``engine_kw``: other
    ``EngineConfig`` fields (the same for all)."""
    block = engine_kw.pop("block_size", 16)
    blocks = max_num_seqs * -(-(max_prompt + max_tokens) // block) + 2
    kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(256, max_num_seqs * (max_prompt + 8)),
              block_size=block, num_blocks=blocks, **engine_kw)
    return {name: LLMEngine(target, speculative=cfg, **kw) for name, cfg in configs.items()}


def acceptance(engines: Mapping[str, LLMEngine], prompts: Sequence[Sequence[int]], max_tokens: int,
               ks: Mapping[str, int]) -> tuple[pd.DataFrame, bool]:
    """Every prompt at once through each engine (greedy, ``max_tokens`` each, EOS ignored): per speculating
    configuration its tokens proposed and accepted, the acceptance rate, tokens per verify step (``E``) and the α
    that ``E`` implies at its ``k`` (``ks[name]``); and whether every greedy output equals the plain engine's."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs, rows = {}, []
    for name, eng in engines.items():
        outs[name] = [o.output_token_ids for o in eng.generate(list(prompts), params, progress=False)]
        s = eng.stats
        if name != PLAIN:
            e = s.tokens_per_spec_decode
            rows.append({"proposer": name, "k": ks[name], "prompts": len(prompts), "proposed": s.draft_tokens,
                         "accepted": s.accepted_tokens, "alpha (accepted/proposed)": s.acceptance_rate,
                         "tokens/step": e, "alpha implied by tokens/step": alpha_from_tokens_per_step(e, ks[name])})
    same = all(o == outs[PLAIN] for o in outs.values())
    return pd.DataFrame(rows), same


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_prompts(engines: Mapping[str, LLMEngine], prompts: Sequence[Sequence[int]], max_tokens: int,
                 repeats: int = 1) -> pd.DataFrame:
    """Each prompt alone through every engine, interleaved (module docstring); one row per prompt and
    configuration: ``prompt``, ``config``, ``seconds`` (median of ``repeats``), ``tokens`` (output tokens),
    ``tokens/step`` (of speculating decodes; 1 for plain) and ``same_output`` (greedy output equals the plain
    engine's). Needs a ``'plain'`` engine."""
    check_int("repeats", repeats, 1)
    if PLAIN not in engines:
        raise ValueError(f"engines={sorted(engines)} needs a {PLAIN!r} one: the baseline of every speedup")
    if not prompts:
        raise ValueError("prompts is empty; time at least one")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    names = list(engines)
    for eng in engines.values():  # warm-up: allocator, kernels, the draft's cache
        eng.generate([list(prompts[0])], params, progress=False)
    rows = []
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        out, secs, eps = {}, {n: [] for n in names}, {}
        for _ in range(repeats):
            for name in order:
                eng = engines[name]
                _sync(eng)
                t0 = time.perf_counter()
                res = eng.generate([list(prompt)], params, progress=False)
                _sync(eng)
                secs[name].append(time.perf_counter() - t0)
                out[name] = res[0].output_token_ids
                eps[name] = eng.stats.tokens_per_spec_decode or 1.0
        for name in names:
            rows.append({"prompt": i, "config": name, "seconds": statistics.median(secs[name]),
                         "tokens": len(out[name]), "tokens/step": eps[name], "same_output": out[name] == out[PLAIN]})
    return pd.DataFrame(rows)


def speedup_spread(times: pd.DataFrame) -> pd.DataFrame:
    """Per configuration but plain, over the prompts of ``time_prompts``: the per-prompt speedup (plain seconds over
    its seconds) as median, p10, p90, quartiles, min and max; the median tokens per verify step; the prompts timed and
    whether every output matched plain decoding."""
    base = times[times.config == PLAIN].set_index("prompt").seconds
    rows = []
    for name, g in times[times.config != PLAIN].groupby("config", sort=False):
        ratio = (base / g.set_index("prompt").seconds).dropna().to_numpy()
        q = np.percentile(ratio, [10, 25, 50, 75, 90])
        rows.append({"config": name, "prompts": len(ratio), "median": q[2], "p10": q[0], "p90": q[4], "q25": q[1],
                     "q75": q[3], "min": ratio.min(), "max": ratio.max(),
                     "tokens/step (median)": float(g["tokens/step"].median()),
                     "same_output": bool(g.same_output.all())})
    return pd.DataFrame(rows)


def tokens_per_step(target, prompt: Sequence[int], config: SpeculativeConfig, max_tokens: int) -> float:
    """Tokens a speculating decode step of ``prompt`` emits on average under ``config`` (greedy, ``max_tokens``):
    the ``E`` of one prompt (``explain_speedup`` compares a record's single-prompt timing with it)."""
    eng = make_engines(target, {"spec": config}, len(prompt), max_tokens)["spec"]
    eng.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True), progress=False)
    return eng.stats.tokens_per_spec_decode
