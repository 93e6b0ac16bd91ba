"""Serving benchmarks: a workload's arrivals replayed against ``LLMEngine.step``, on a virtual or a real clock, and
the serving metrics (time to first token, time per output token, percentiles, throughput, goodput).

The engine stamps each request's arrival and each token with its ``clock`` (``LLMEngine.clock``: a function that
returns seconds); ``serve`` lends it one of these for the run:

* ``VirtualClock`` (the default): wall time with the idle gaps cut out. While requests run it advances with the wall
  clock (each step takes what it took, the device synchronised by the sampled tokens reaching the host); when the
  engine is idle it jumps to the next arrival instead of sleeping. The queueing is that of a real server whose steps
  take what they took, without waiting through idle gaps (which at low load would be most of a run) and without the
  noise of a shared machine's sleeps; ``labkit.experiments.baseline`` replays HF ``generate`` the same way.
* ``RealClock``: seconds since the run started; waiting sleeps. The honest end-to-end mode on a dedicated machine.

Each step is timed here too, from outside the engine (``step_s``, ``busy_s``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from labkit.bench.workload import RequestSpec
from labkit.engine import LLMEngine, RequestMetrics, RequestOutput, SamplingParams, TokenOutput

CLOCKS = ("virtual", "real")
"""Serving clocks: 'virtual' (idle gaps skipped) or 'real' (wall clock, waits sleep)."""


class VirtualClock:
    """Seconds of wall time since the start, idle gaps skipped (``wait_until`` jumps instead of sleeping)."""

    name = "virtual"

    def __init__(self) -> None:
        self.start, self.skipped = time.perf_counter(), 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.start + self.skipped

    def wait_until(self, t: float) -> None:
        self.skipped += max(0.0, t - self())


class RealClock:
    """Seconds since the start (``perf_counter``); waiting sleeps."""

    name = "real"

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self()))


@dataclass
class ServeResult:
    """A served workload: per-request metrics and outputs, and what the engine did (``stats``: the engine's
    ``run_stats`` with the run's times: ``busy_s``, ``step_s``, ``makespan_s``, ``busy_frac``, memory)."""

    metrics: list[RequestMetrics]
    outputs: list[RequestOutput]
    stats: dict = field(default_factory=dict)


def serve(engine: LLMEngine, workload: Sequence[RequestSpec],
          params: SamplingParams | Callable[[RequestSpec], SamplingParams] | None = None, clock: str = "virtual",
          on_token: Callable[[TokenOutput], None] | None = None, progress: bool = True) -> ServeResult:
    """Online: requests arrive at their ``arrival_s`` (Poisson in ``make_workload``) while the engine steps.

    ``params``: one ``SamplingParams``, a function of the ``RequestSpec``, or ``None`` (greedy, exactly
    ``max_new_tokens`` tokens: EOS ignored, as a benchmark wants). ``on_token`` sees every streamed token. Every
    request is checked before the run starts (``LLMEngine.add_request``'s rules); a bad one raises and nothing runs.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is unknown; allowed: {CLOCKS}")
    if params is not None and not (isinstance(params, SamplingParams) or callable(params)):
        raise TypeError(f"params={params!r} must be a SamplingParams, a function of the RequestSpec or None")
    specs = sorted(workload, key=lambda r: (r.arrival_s, r.request_id))
    ids = [r.request_id for r in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"workload: request ids repeat ({len(ids) - len(set(ids))} duplicates); each needs its own")
    engine.reset()
    pending = [(list(r.prompt_ids), _params_for(r, params), r.arrival_s, r.request_id) for r in specs]
    for prompt, p, _, rid in pending:  # every request checked before any runs
        engine.check_request(prompt, p, rid)
    run_clock = VirtualClock() if clock == "virtual" else RealClock()
    before, engine.clock = engine.clock, run_clock
    step_s: list[float] = []
    # a step whose tokens did not reach the host (a prefill chunk) ends at the sync; with async scheduling a step's
    # time is its host work plus the wait for the previous step's tokens, and a sync would undo the overlap
    overlap = engine.config.async_scheduling
    sync = torch.cuda.synchronize if engine.device.type == "cuda" and not overlap else (lambda *a: None)
    i = 0
    try:
        with tqdm(total=len(pending), desc=f"serve ({engine.config.scheduler})", unit="req",
                  disable=not progress) as bar:
            while i < len(pending) or engine.has_unfinished():
                while i < len(pending) and pending[i][2] <= run_clock():
                    engine.add_request(*pending[i])
                    i += 1
                if not engine.has_unfinished():
                    run_clock.wait_until(pending[i][2])
                    continue
                t0 = time.perf_counter()
                outs = engine.step()
                sync(engine.device)
                step_s.append(time.perf_counter() - t0)
                for out in outs:
                    bar.update(int(out.finished))
                    if on_token is not None:
                        on_token(out)
    except BaseException:
        engine.scheduler.abort_all()  # never leave the engine wedged
        raise
    finally:
        engine.clock = before
    return result(engine, step_s, run_clock.name)


def result(engine: LLMEngine, step_s: Sequence[float] = (), clock: str = "") -> ServeResult:
    """Metrics, outputs and statistics of the engine's current run (every request of it finished), with the step
    times ``step_s`` measured around it. ``metrics`` holds the requests that produced tokens; ``outputs`` every
    request, failed and aborted ones included."""
    outputs = engine.outputs()
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    start = min((m.arrival_s for m in metrics), default=0.0)
    makespan = max((m.finish_s for m in metrics), default=start) - start
    busy = float(sum(step_s))
    cache = engine.cache
    stats = {**engine.run_stats(), "clock": clock, "busy_s": busy, "step_s": list(step_s), "makespan_s": makespan,
             "busy_frac": busy / makespan if makespan > 0 else math.nan,
             "peak_device_bytes": (torch.cuda.max_memory_allocated(engine.device)
                                   if engine.device.type == "cuda" else None),
             "peak_kv_bytes": engine.scheduler.peak_blocks_used * cache.bytes_per_block,
             "kv_capacity_bytes": engine.scheduler.usable_blocks * cache.bytes_per_block,
             "config": asdict(engine.config)}
    return ServeResult(metrics, outputs, stats)


def _params_for(spec: RequestSpec, params) -> SamplingParams:
    if params is None:
        return SamplingParams(max_tokens=spec.max_new_tokens, ignore_eos=True)
    return params(spec) if callable(params) else params


# --- serving metrics -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    """A latency objective: a request is good if both bounds hold."""

    ttft_s: float
    tpot_s: float

    def met(self, m: RequestMetrics) -> bool:
        return m.ttft_s <= self.ttft_s and m.tpot_s <= self.tpot_s


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for an empty list."""
    if not values:
        return float("nan")
    return torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100).item()


def summarize(metrics: list[RequestMetrics], slo: SLO | None = None) -> dict:
    """Percentiles of TTFT, TPOT and end-to-end latency (p50/p90/p99), throughput over the makespan, goodput."""
    if not metrics:
        raise ValueError("metrics is empty: no request finished")
    start = min(m.arrival_s for m in metrics)
    makespan = max(m.finish_s for m in metrics) - start
    out = {"requests": len(metrics), "makespan_s": makespan,
           "output_tokens": sum(m.output_tokens for m in metrics),
           "prompt_tokens": sum(m.prompt_tokens for m in metrics)}
    for name in ("ttft_s", "tpot_s", "e2e_s"):
        vals = [getattr(m, name) for m in metrics]
        for q in (50, 90, 99):
            out[f"{name[:-2]}_p{q}_s"] = percentile(vals, q)
        out[f"{name[:-2]}_mean_s"] = sum(vals) / len(vals)
    out["output_tok_s"] = out["output_tokens"] / makespan if makespan > 0 else float("nan")
    out["requests_s"] = len(metrics) / makespan if makespan > 0 else float("nan")
    if slo is not None:
        good = sum(slo.met(m) for m in metrics)
        out["slo_attained_frac"] = good / len(metrics)
        out["goodput_requests_s"] = good / makespan if makespan > 0 else float("nan")
    return out
