"""Notebook 00's baseline, the peer of every serving measurement after it (notebooks 01 and 05, ``bench serve``):
the naive server of the scenario, Hugging Face ``generate``, one request at a time (FIFO) or in static batches,
beside labkit's engine (continuous batching) on the same requests.

``generate`` runs in one of ``HF_MODES``: ``eager`` (the default dynamic cache), ``static`` (``StaticCache``,
eager) and ``static+compile`` (``StaticCache`` with HF's own ``torch.compile`` of the decode step; CUDA only: HF
compiles on accelerators, and on the CPU the compile would take longer than the notebook).

Each execution is real (the model runs, every token's time is taken by a streamer); the queue around it is
replayed on a virtual clock from the workload's arrival times (trace-driven simulation). For FIFO the service time
of a request does not depend on when it arrived, so one measurement per request serves every arrival rate; static
batches depend on who was waiting, so each distinct batch is executed (and cached by its members).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from tqdm.auto import tqdm

from labkit.bench.serving import serve, summarize
from labkit.bench.workload import RequestSpec, at_rate
from labkit.engine import RequestMetrics
from labkit.profiling import profile_run


class StepTimer:
    """A ``generate`` streamer that records when each new token reaches the host (the first ``put`` is the
    prompt and is skipped). Moving the token to the host synchronises the device, as a server sending it would."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        value.cpu()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class Execution:
    """One ``generate`` call: offsets (seconds from its start) of each generated token, and its total time."""

    batch_size: int
    token_times_s: list[float]
    total_s: float

    @property
    def first_token_s(self) -> float:
        return self.token_times_s[0]

    def decode_tok_s(self) -> float:
        """Decode tokens/s of the whole batch, prefill excluded: (steps after the first) / their time."""
        steps = len(self.token_times_s) - 1
        if steps < 1:
            return float("nan")
        return self.batch_size * steps / (self.token_times_s[-1] - self.token_times_s[0])


def _left_pad(prompts: list[tuple[int, ...]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


HF_MODES = {"eager": {}, "static": {"cache_implementation": "static", "disable_compile": True},
            "static+compile": {"cache_implementation": "static"}}


def hf_modes(device) -> tuple[str, ...]:
    """The ``HF_MODES`` that run on ``device``: all three on CUDA, ``eager`` and ``static`` elsewhere."""
    return tuple(HF_MODES) if torch.device(device).type == "cuda" else ("eager", "static")


@torch.no_grad()
def run_generate(model, prompts: list[tuple[int, ...]], max_new_tokens: int, pad_token_id: int = 0,
                 mode: str = "eager") -> tuple[Execution, torch.Tensor]:
    """Greedy HF ``generate`` of exactly ``max_new_tokens`` tokens for a left-padded batch of prompts, with the
    cache and compilation of ``mode`` (one of ``HF_MODES``).

    Returns the timed ``Execution`` and the generated ids ``[batch, max_new_tokens]`` (int64).
    """
    if not prompts or max_new_tokens < 1:
        raise ValueError(f"need at least one prompt and max_new_tokens >= 1, got {len(prompts)} and {max_new_tokens}")
    if mode not in HF_MODES:
        raise ValueError(f"mode={mode!r} is unknown; allowed: {list(HF_MODES)}")
    device = next(model.parameters()).device
    if mode not in hf_modes(device):
        raise ValueError(f"mode={mode!r} runs on CUDA only (HF compiles generate on accelerators); on "
                         f"{device.type} use one of {list(hf_modes(device))}")
    ids, mask = _left_pad(prompts, pad_token_id, device)
    timer = StepTimer()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, streamer=timer,
                         pad_token_id=pad_token_id, **HF_MODES[mode])
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return Execution(len(prompts), [t - t0 for t in timer.times], total), out[:, ids.shape[1]:].cpu()


class _StopAfter:
    """A ``generate`` stopping criterion: every sequence stops once ``length`` ids (prompt included) exist."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


@torch.no_grad()
def warm_up(model, prompts: list[tuple[int, ...]], max_new_tokens: int, pad_token_id: int = 0, mode: str = "eager",
            steps: int = 8) -> None:
    """Run ``generate`` in ``mode`` once, as a call for ``max_new_tokens`` tokens that stops after ``steps``: HF
    compiles the decode step (static+compile) and sizes its static cache for ``max_new_tokens`` (it keeps the
    largest length it has made, so later calls of up to that many tokens neither reallocate nor recompile), without
    paying for the whole generation."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    if mode not in HF_MODES:
        raise ValueError(f"mode={mode!r} is unknown; allowed: {list(HF_MODES)}")
    ids, mask = _left_pad(prompts, pad_token_id, next(model.parameters()).device)
    stop = type("StopAfter", (_StopAfter, StoppingCriteria), {})(ids.shape[1] + min(steps, max_new_tokens))
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                   pad_token_id=pad_token_id, stopping_criteria=StoppingCriteriaList([stop]), **HF_MODES[mode])


def replay_fifo(workload: list[RequestSpec], executions: dict[int, Execution]) -> list[RequestMetrics]:
    """Queue the requests in arrival order on one server that runs ``executions[request_id]`` for each."""
    clock, out = 0.0, []
    for r in sorted(workload, key=lambda r: (r.arrival_s, r.request_id)):
        e = executions[r.request_id]
        start = max(clock, r.arrival_s)
        clock = start + e.total_s
        out.append(RequestMetrics(r.request_id, r.arrival_s, start + e.first_token_s, clock, r.prompt_len,
                                  r.max_new_tokens, [start + t for t in e.token_times_s]))
    return out


def measure_fifo(model, workload: list[RequestSpec], pad_token_id: int = 0, progress: bool = True,
                 mode: str = "eager") -> dict[int, Execution]:
    """Execute every request alone (batch 1); the service times that ``replay_fifo`` queues."""
    return {r.request_id: run_generate(model, [r.prompt_ids], r.max_new_tokens, pad_token_id, mode)[0]
            for r in tqdm(workload, desc="HF generate, batch 1", disable=not progress)}


def _static_batches(workload: list[RequestSpec], batch_size: int, cache: dict, run: Callable):
    """Yield ``(start_s, batch, execution)`` as a static-batching server forms and runs its batches."""
    queue = sorted(workload, key=lambda r: (r.arrival_s, r.request_id))
    clock, i = 0.0, 0
    while i < len(queue):
        clock = max(clock, queue[i].arrival_s)
        j = i
        while j < len(queue) and j - i < batch_size and queue[j].arrival_s <= clock:
            j += 1
        batch = queue[i:j]
        key = tuple(r.request_id for r in batch)
        if key not in cache:
            cache[key] = run([r.prompt_ids for r in batch], max(r.max_new_tokens for r in batch))
        yield clock, batch, cache[key]
        clock += cache[key].total_s
        i = j


def serve_static(model, workload: list[RequestSpec], batch_size: int, pad_token_id: int = 0,
                 cache: dict | None = None, run: Callable | None = None) -> tuple[list[RequestMetrics], float]:
    """Static batching: when the server is free it takes up to ``batch_size`` waiting requests (waiting for the
    next arrival if none), runs them together until the longest finishes, and returns them all at the end.

    Returns the per-request metrics and the seconds the server spent executing. ``cache`` (a dict) reuses
    executions of identical batches across calls; ``run(prompts, max_new_tokens)`` replaces ``run_generate``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    run = run or (lambda prompts, n: run_generate(model, prompts, n, pad_token_id)[0])
    cache = {} if cache is None else cache
    out, busy = [], 0.0
    for start, batch, e in _static_batches(workload, batch_size, cache, run):
        busy += e.total_s
        out += [RequestMetrics(r.request_id, r.arrival_s, start + e.first_token_s, start + e.total_s,
                               r.prompt_len, r.max_new_tokens) for r in batch]
    return out, busy


def fifo_capacity(executions: dict[int, Execution]) -> float:
    """Requests/s one batch-1 server completes back to back: 1 / mean service time."""
    return len(executions) / sum(e.total_s for e in executions.values())


def kernel_share(fn: Callable[[], object]) -> float:
    """The share of ``fn``'s wall time that the device spends in kernels, from the profiler's timeline (the union
    of kernel intervals on CUDA; on the CPU the aten operators' self time): the rest is the device waiting for
    the host (Python, the framework, launches)."""
    res = profile_run(fn, steps=1, warmup=1)
    return min(1.0, res.busy_s / res.wall_s)


def sweep_load(model, workload: list[RequestSpec], loads: list[float], static_batch: int, engine_kwargs: dict,
               pad_token_id: int = 0, progress: bool = True, seed: int = 0) -> tuple[list[dict], dict]:
    """FIFO (HF ``generate``, batch 1), static batching (HF ``generate``, ``static_batch``) and continuous batching
    (``LLMEngine(model, **engine_kwargs)``) at offered loads given as multiples of the FIFO capacity, on the same
    requests with the same Poisson arrivals (``at_rate(workload, load * capacity, seed)``).

    Each policy's device busy fraction is measured on two timelines: the served one (seconds the server executed
    over the makespan; FIFO and static replay measured executions on a virtual clock, the engine steps for real and
    skips idle time on its virtual clock) times the share of an execution the device spends in kernels, profiled
    on that policy's own execution (``kernel_share``: one batch-1 ``generate``, one static batch, one offline
    engine run over the first ``4 * static_batch`` requests). Returns one row per (policy, load) with the
    ``summarize`` metrics, ``server_util`` and ``device_busy_frac``, and the per-policy kernel shares.
    """
    from labkit.engine import LLMEngine

    fifo_exec = measure_fifo(model, workload, pad_token_id, progress)
    capacity = fifo_capacity(fifo_exec)
    first = sorted(workload, key=lambda r: r.request_id)
    median = sorted(first, key=lambda r: r.max_new_tokens)[len(first) // 2]
    head = first[:static_batch]
    engine = LLMEngine(model, **engine_kwargs)
    warm = at_rate(first[:4 * static_batch], math.inf, seed)
    shares = {
        "FIFO": kernel_share(lambda: run_generate(model, [median.prompt_ids], median.max_new_tokens, pad_token_id)),
        "static": kernel_share(lambda: run_generate(model, [r.prompt_ids for r in head],
                                                    max(r.max_new_tokens for r in head), pad_token_id)),
        "continuous": kernel_share(partial(serve, engine, warm, progress=False)),
    }
    cache: dict = {}
    rows = []
    for load in tqdm(loads, desc="offered loads", disable=not progress):
        wl = at_rate(workload, load * capacity, seed)
        static_metrics, static_busy = serve_static(model, wl, static_batch, pad_token_id, cache)
        served = serve(engine, wl, progress=False)
        fifo_busy = sum(fifo_exec[r.request_id].total_s for r in wl)
        for policy, metrics, busy in (("FIFO", replay_fifo(wl, fifo_exec), fifo_busy),
                                      ("static", static_metrics, static_busy),
                                      ("continuous", served.metrics, served.stats["busy_s"])):
            s = summarize(metrics)
            s.update(policy=policy, offered_load=load, rate_req_s=load * capacity,
                     server_util=min(1.0, busy / s["makespan_s"]), kernel_share=shares[policy])
            s["device_busy_frac"] = s["server_util"] * shares[policy]
            rows.append(s)
    del engine
    return rows, shares


def offline_throughput(model, workload: list[RequestSpec], batch_size: int, engine_kwargs: dict,
                       modes: tuple[str, ...], pad_token_id: int = 0, progress: bool = True) -> list[dict]:
    """Every request of ``workload`` queued at once, served by HF ``generate`` in static batches of ``batch_size``
    (arrival order, each batch runs to its longest request) in each of ``modes``, and by the engine: every request
    measured on both sides, nothing extrapolated.

    Output tokens/s count each request's own tokens (a static batch's padding steps are its cost, not output).
    Each HF mode is warmed up first; a static-cache mode on the widest batch for the longest output of the workload,
    so that HF sizes its static cache once for every batch and its compiled decode step is not compiled again
    (HF keeps the largest static cache length it has made; keep ``len(workload)`` a multiple of ``batch_size`` so
    the batch dimension does not change either). Returns one row per server.
    """
    from labkit.engine import LLMEngine

    order = sorted(workload, key=lambda r: (r.arrival_s, r.request_id))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    tokens = sum(r.max_new_tokens for r in order)
    widest = max(batches, key=lambda b: (len(b), max(len(r.prompt_ids) for r in b)))
    longest = max(r.max_new_tokens for r in order)
    rows = []
    for mode in modes:  # warm-up: compile, and size the static cache for the longest batch (a few steps of it)
        warm_up(model, [r.prompt_ids for r in widest], longest, pad_token_id, mode)
        total = sum(run_generate(model, [r.prompt_ids for r in b], max(r.max_new_tokens for r in b), pad_token_id,
                                 mode)[0].total_s for b in tqdm(batches, desc=f"HF {mode}", disable=not progress))
        rows.append({"server": f"HF generate ({mode}), static batches of {batch_size}", "mode": mode,
                     "requests": len(order), "seconds": total, "output_tok_s": tokens / total})
    if "static+compile" in modes:  # HF's compiled step and its CUDA-graph pool are done with: free them first
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engine sizes its KV cache from what is free
    engine = LLMEngine(model, **engine_kwargs)
    serve(engine, at_rate(order[:batch_size], math.inf), progress=False)  # warm-up
    res = serve(engine, at_rate(order, math.inf), progress=False)
    rows.append({"server": "labkit engine (continuous batching)", "mode": "engine", "requests": len(order),
                 "seconds": res.stats["busy_s"], "output_tok_s": tokens / res.stats["busy_s"],
                 "peak_kv_bytes": res.stats.get("peak_kv_bytes"), "preemptions": res.stats.get("preemptions")})
    del engine
    return rows


def offline_speedups(rows: list[dict]) -> dict[str, float]:
    """From ``offline_throughput``'s rows: the engine's output tokens/s over each HF mode's (``{mode: ratio}``)
    and over the best HF mode (``"best"``, the headline: the strongest baseline measured)."""
    engine = next(r for r in rows if r.get("mode") == "engine")["output_tok_s"]
    hf = {r["mode"]: r["output_tok_s"] for r in rows if r.get("mode") not in (None, "engine")}
    if not hf:
        raise ValueError("rows hold no HF mode: nothing to compare the engine with")
    return {**{m: engine / v for m, v in hf.items()}, "best": engine / max(hf.values())}
