"""Notebook 00 (baseline): how a FIFO queue's p99 time to first token grows with traffic (predicted, then set against
the load sweep the notebook measured), and whether static batches beat one-at-a-time serving.

Both are queueing arithmetic: the notebook's FIFO server is HF ``generate`` taking one request at a time, with
Poisson arrivals at ``offered load x`` its capacity; the static server runs ``batch`` requests together until the
longest one ends.
"""

from __future__ import annotations

import math
import random

from labkit.exercises.core import Case, Decision, Measurement, Prediction, diff, register
from labkit.exercises.measured import NoMeasurement, data_of, figure

P99 = 0.99


def fifo_p99_ttft(n_requests: int, rate_req_s: float, service_s: float, prefill_s: float) -> float:
    """Solution: the predicted p99 time to first token (seconds) of ``n_requests`` Poisson arrivals at ``rate_req_s``
    served one at a time, each taking ``service_s`` on average; a request's own first token comes ``prefill_s``
    after it starts.

    Below capacity (``rho = rate x service < 1``) the wait is M/M/1's: ``P(wait > t) = rho exp(-(1 - rho) t /
    service)``, so the p99 wait is ``service ln(100 rho) / (1 - rho)`` (0 when ``100 rho <= 1``). At or above
    capacity the queue grows as long as requests arrive: request ``i`` (from 0, evenly spaced arrivals) waits
    ``i (service - 1 / rate)``, and the p99 request is ``i = 0.99 (n - 1)``.
    """
    rho = rate_req_s * service_s
    if rho < 1:
        wait = service_s * max(0.0, math.log(100 * rho)) / (1 - rho)
    else:
        wait = P99 * (n_requests - 1) * (service_s - 1 / rate_req_s)
    return wait + prefill_s


def _fifo_cases() -> list[Case]:
    rows = [(200, 6.46, 0.0774, 0.044, "half capacity (the notebook's low load)"),
            (200, 25.85, 0.0774, 0.044, "twice capacity (the notebook's high load)"),
            (16, 3.0, 0.31, 0.02, "ci size: 16 requests, rho 0.93"),
            (1000, 0.05, 0.1, 0.0, "almost idle: rho 0.005, nobody waits at the p99"),
            (37, 9.0, 0.2, 0.05, "overloaded 1.8x, 37 requests"),
            (12, 2.7294, 0.5496, 0.12, "the H200 record's shape: 12 requests, 1.5x")]
    return [Case(f"{label}: n={n}, rate={r} req/s, service={s} s, prefill={p} s", (n, r, s, p))
            for n, r, s, p, label in rows]


def _fifo_rows() -> tuple[list[dict], str, float, str]:
    """The FIFO rows of the load sweep, where they come from, the prefill time and where that comes from."""
    _, rec, source = figure("baseline.fifo_ttft_p99_peak_s")
    data = data_of(rec, "notebook 00's load sweep")
    rows = [r for r in data["load_sweep"] if str(r["policy"]).startswith("FIFO")]
    if not rows:
        raise NoMeasurement("the record has no FIFO rows in its load sweep")
    probe = [r for r in data.get("hf_probe", []) if r.get("HF generate") == "eager" and r.get("batch") == 1]
    if probe:
        return rows, source, probe[0]["TTFT (ms)"] / 1e3, "the record's batch-1 eager generate probe"
    return rows, source, 0.0, "not in this record: 0"


def _fifo_measure() -> list[Measurement]:
    rows, source, prefill, prefill_from = _fifo_rows()
    out = []
    for r in sorted(rows, key=lambda r: r["offered_load"]):
        service = r["server_util"] * r["makespan_s"] / r["requests"]  # busy seconds per request
        rho = r["rate_req_s"] * service

        def explain(pred, meas, rho=rho, n=r["requests"], service=service):
            if rho < 1:
                start = ("far from the steady state the formula describes: the run starts with an empty queue and "
                         f"{n} requests never fill it" if n < 100 else f"{n} requests: near the steady state")
                side = ("less variable service (a prefill plus a clipped exponential number of decode steps, not an "
                        "exponential time) and" if meas < pred else "bursts of arrivals the mean hides, and")
                return (f"below capacity (rho = {rho:.2f}) the M/M/1 tail is the steady state of a queue with "
                        f"exponential service times; the measured tail is {'shorter' if meas < pred else 'longer'}: "
                        f"{side} {start}. The 99th percentile of {n} waits is set by the "
                        f"{'longest one' if n <= 100 else f'{round(n / 100)} longest'}: noisy")
            return (f"above capacity (rho = {rho:.2f}) the queue grows while requests arrive, so the p99 is set by "
                    f"how many arrived ({n}), not by the server alone. The fluid model spaces arrivals evenly and "
                    f"uses the mean service time ({service * 1e3:.0f} ms); Poisson arrivals bunch and service times "
                    f"vary, which moves the p99 request's wait by about sqrt(n) service times either way")
        out.append(Measurement(
            f"FIFO p99 TTFT at offered load {r['offered_load']} (rho = {rho:.2f}; service {service * 1e3:.1f} ms "
            f"= busy time / requests; prefill {prefill * 1e3:.1f} ms from {prefill_from})",
            (r["requests"], r["rate_req_s"], service, prefill), r["ttft_p99_s"], "s", source, 0.5, explain))
    return out


register(Prediction(
    "00.fifo_p99_ttft", "predict the FIFO queue's p99 time to first token from service time and arrival rate",
    fifo_p99_ttft, _fifo_cases, lambda fn, c: fn(*c), measure=_fifo_measure,
    hint="rho = rate x service; below 1: service x ln(100 rho) / (1 - rho), floored at 0; at or above 1: "
         "0.99 (n - 1) x (service - 1 / rate); then add the prefill"))


def static_vs_fifo(output_lens: list[int], batch: int, step_s: dict[int, float]) -> dict:
    """Solution: serve ``output_lens`` (decode steps per request, in arrival order) one at a time (FIFO) or in
    static batches of ``batch`` consecutive requests, each batch running until its longest request ends; a decode
    step of ``b`` requests takes ``step_s[b]`` seconds. Returns the two times, the speed-up of static batches,
    the fraction of batch slots that decode a live request, and the choice (``"static"`` when it is faster, else
    ``"FIFO"``)."""
    fifo = sum(output_lens) * step_s[1]
    static, slots = 0.0, 0
    for i in range(0, len(output_lens), batch):
        group = output_lens[i:i + batch]
        static += max(group) * step_s[len(group)]
        slots += len(group) * max(group)
    return {"fifo_s": fifo, "static_s": static, "speedup": fifo / static, "useful_slot_frac": sum(output_lens) / slots,
            "choice": "static" if static < fifo else "FIFO"}


def _static_cases() -> list[Case]:
    gpu = {b: 0.008 + 0.0002 * b for b in range(1, 65)}  # decode at small batch: memory-bound, nearly flat
    cpu = {b: 0.012 * b ** 0.9 for b in range(1, 65)}  # a small model on a CPU: every row costs almost as much
    cases = [Case("8 requests of 10 tokens, batch 4, GPU-like steps (flat in batch)", ([10] * 8, 4, gpu)),
             Case("one long request (200) among short ones (3), batch 8: padding eats the gain",
                  ([3, 3, 200, 3, 3, 3, 3, 3, 3, 3], 8, gpu)),
             Case("CPU-like steps (time ~ batch^0.9), 12 requests, batch 4", ([5, 9, 2, 7, 7, 3, 12, 4, 6, 1, 8, 5],
                                                                                4, cpu))]
    rng = random.Random(0)
    for seed, (n, b, table) in enumerate(((37, 8, gpu), (19, 5, cpu), (64, 16, gpu))):
        rng.seed(seed)
        lens = [max(1, min(64, int(rng.expovariate(1 / 6)))) for _ in range(n)]
        kind = "GPU" if table is gpu else "CPU"
        cases.append(Case(f"{n} requests, exponential lengths (mean 6, 1..64), batch {b}, {kind}-like steps; the "
                          f"last batch is partial", (lens, b, table)))
    return cases


register(Decision(
    "00.static_vs_fifo", "static batches or one at a time: padding against the cost of a bigger step",
    static_vs_fifo, _static_cases, lambda fn, c: fn(list(c[0]), c[1], dict(c[2])),
    lambda e, a: diff(e, a, rtol=1e-9),
    hint="a static batch runs max(its lengths) steps at step_s[its size] (the last batch may be smaller); useful "
         "slots = sum of lengths / sum over batches of size x max length"))
