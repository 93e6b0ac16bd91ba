"""Serving metrics: time to first token, time per output token, latency percentiles, throughput, goodput."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestMetrics:
    """What happened to one request, in seconds on the serving clock (arrival at ``arrival_s``)."""

    request_id: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Time to first token: queueing plus prefill."""
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (0 for a one-token output)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


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
