"""Serving predictions and the ranked plan: which layout serves a model on a cluster at a traffic and an SLO.

Serving model (continuous batching, one replica of ``tp x pp`` GPUs, ``replicas`` of them share the traffic): with
``n`` sequences decoding, a step takes ``t(n)``; prefills are interleaved and take a share ``rho = lambda_r *
t_prefill`` of the time, so a token takes ``tpot = t(n) / (1 - rho)`` and Little's law gives ``n = lambda_r x
output_mean x tpot``, solved by fixed-point iteration; the layout is saturated when ``n`` would exceed the batch
limit. Time to first token is the prefill of a p99-length prompt, one decode step of waiting for a step boundary,
and the queueing of an M/D/1 prefill server at p99 (``-ln(0.01)`` times its mean wait).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from labkit.bench.serving import SLO
from labkit.checks import check_number, check_positive_int
from labkit.model import ModelConfig, dtype_bytes, get_config
from labkit.parallel.cost_model import get_link, memory_per_device
from labkit.plan.inputs import KV_DTYPES, WEIGHT_DTYPES, Calibration, Cluster, Traffic, check_formats
from labkit.plan.steps import MULTI_GPU_CAVEAT, NO_PATH, decode_step_time, prefill_time


@dataclass
class Plan:
    """One candidate layout and what the model predicts for it."""

    tp: int
    pp: int
    replicas: int
    weights: str
    kv: str
    max_batch: int
    fits: bool
    mem_per_gpu_gb: float
    decode_step_ms: float
    prefill_ms: float
    tpot_ms: float
    ttft_p99_ms: float
    concurrent: float
    capacity_req_s: float
    meets_slo: bool
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def validated(self) -> bool:
        """False while a prediction for more than one GPU has no multi-GPU record behind it (``notes`` says so)."""
        return MULTI_GPU_CAVEAT not in self.notes

    @property
    def layout(self) -> str:
        return f"{self.replicas} x (TP{self.tp} x PP{self.pp}), weights {self.weights}, KV {self.kv}, " \
               f"batch <= {self.max_batch}"

    def to_dict(self) -> dict:
        return dict(asdict(self), gpus=self.gpus, layout=self.layout, validated=self.validated)


def _serve(step_time, spec, cluster, cal, tp, pp, batch, weights, kv, traffic, replicas) -> dict:
    lam = traffic.rate_req_s / replicas
    p_mean, o_mean = traffic.mean("prompt"), traffic.mean("output")
    ctx = int(p_mean + o_mean / 2)
    t_pre = prefill_time(spec, cluster, cal, tp, pp, int(p_mean), weights)
    rho = lam * t_pre
    n, tpot = 1.0, float("inf")
    for _ in range(100):
        step = step_time(tp, pp, max(1, math.ceil(n)), ctx, weights, kv)
        tpot = step / (1 - rho) if rho < 1 else float("inf")
        n_new = lam * o_mean * tpot
        if abs(n_new - n) < 1e-3:
            break
        n = min(n_new, 10 * batch)
    full = step_time(tp, pp, batch, ctx, weights, kv)
    capacity = replicas * batch / (o_mean * full + batch * t_pre)
    saturated = rho >= 1 or n > batch
    t_pre99 = prefill_time(spec, cluster, cal, tp, pp, int(traffic.quantile("prompt", 0.99)), weights)
    wait = rho * t_pre / (2 * (1 - rho)) if rho < 1 else float("inf")
    ttft = t_pre99 + (tpot * (1 - rho) if math.isfinite(tpot) else 0) + -math.log(0.01) * wait
    return {"tpot": tpot if not saturated else float("inf"), "ttft": ttft if not saturated else float("inf"),
            "n": n, "capacity": capacity, "t_pre": t_pre, "step": full}


def check_plan_inputs(cluster, traffic, slo, cal, weights, kv, batches) -> tuple:
    """Validate ``plan``'s arguments; returns (weights, kv, batches) as tuples."""
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r} must be a labkit.plan.Cluster")
    if not isinstance(traffic, Traffic):
        raise ValueError(f"traffic={traffic!r} must be a labkit.plan.Traffic")
    if not isinstance(slo, SLO):
        raise ValueError(f"slo={slo!r} must be a labkit.bench.serving.SLO")
    check_number("slo.ttft_s", slo.ttft_s, 0, low_open=True)
    check_number("slo.tpot_s", slo.tpot_s, 0, low_open=True)
    if cal is not None and not isinstance(cal, Calibration):
        raise ValueError(f"cal={cal!r} must be a labkit.plan.Calibration or None (the committed calibration)")
    weights = check_formats("weights", weights, WEIGHT_DTYPES)
    kv = check_formats("kv", kv, KV_DTYPES)
    if isinstance(batches, int) or not batches:
        raise ValueError(f"batches={batches!r} must be a non-empty tuple of integers >= 1")
    return weights, kv, tuple(check_positive_int("batches", b) for b in batches)


def plan(spec, cluster: Cluster, traffic: Traffic, slo: SLO, cal: Calibration | None = None,
         weights: tuple[str, ...] = WEIGHT_DTYPES, kv: tuple[str, ...] = KV_DTYPES,
         batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256)) -> list[Plan]:
    """Every layout that uses at most the cluster's GPUs, ranked: meeting the SLO first, then fewest GPUs, then
    most headroom (capacity over offered rate). ``tp`` divides the query heads and fits in a node, ``pp`` divides
    the layers; replicas share the traffic. Each weight format is planned with its own memory: smaller weights fit
    a narrower TP group (and leave more room for the KV cache: a larger batch), so the same GPUs hold more replicas,
    each at the speed of the format's fastest kernel measured at its batch. A format with no kernel measured at a
    candidate's micro-batch is not planned there (``NO_PATH``)."""
    from labkit.plan.calibration import load_calibration

    spec = get_config(spec, "spec")
    weights, kv, batches = check_plan_inputs(cluster, traffic, slo, cal, weights, kv, batches)
    cal = cal or load_calibration()[0]
    out = []
    ctx_max = int(traffic.quantile("prompt", 0.9) + traffic.quantile("output", 0.9))
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and spec.num_heads % t == 0]

    @functools.cache  # the fixed points of every candidate revisit the same steps
    def step_time(tp: int, pp: int, batch: int, context: int, w: str, k: str) -> float:
        return decode_step_time(spec, cluster, cal, tp, pp, batch, context, w, k)

    for tp in tps:
        for pp in [p for p in range(1, cluster.num_gpus // tp + 1) if spec.num_layers % p == 0]:
            for w in weights:
                for k in kv:
                    for b in batches:
                        out.append(_candidate(step_time, spec, cluster, cal, traffic, slo, tp, pp, w, k, b,
                                              ctx_max))
    out = [p for p in out if p is not None]
    return sorted(out, key=lambda p: (not p.meets_slo, not p.fits, NO_PATH in p.notes, p.gpus,
                                      -p.capacity_req_s / traffic.rate_req_s, p.tpot_ms))


def _candidate(step_time, spec, cluster, cal, traffic, slo, tp, pp, w, k, b, ctx_max) -> Plan | None:
    if tp * pp > cluster.num_gpus:
        return None
    mem = memory_per_device(spec, tp, pp, math.ceil(b / pp) * ctx_max * pp, dtype=w, kv_dtype=k)
    fits = mem["total"] <= 0.9 * cluster.gpu.mem_capacity
    if not fits:
        return Plan(tp, pp, 0, w, k, b, False, mem["total"] / 1e9, *(float("nan"),) * 6, False,
                    ["does not fit"])
    best = None
    caveat = [MULTI_GPU_CAVEAT] if tp * pp > 1 and not cal.multi_gpu else []
    if math.isinf(step_time(tp, pp, b, int(traffic.mean("prompt") + traffic.mean("output") / 2), w, k)):
        return Plan(tp, pp, 0, w, k, b, True, mem["total"] / 1e9, *(float("inf"),) * 4, 0.0, 0.0, False,
                    [NO_PATH, *caveat])  # no kernel of this format measured at this micro-batch: not planned
    for replicas in range(1, cluster.num_gpus // (tp * pp) + 1):
        s = _serve(step_time, spec, cluster, cal, tp, pp, b, w, k, traffic, replicas)
        ok = s["ttft"] <= slo.ttft_s and s["tpot"] <= slo.tpot_s
        best = Plan(tp, pp, replicas, w, k, b, True, mem["total"] / 1e9, s["step"] * 1e3, s["t_pre"] * 1e3,
                    s["tpot"] * 1e3, s["ttft"] * 1e3, s["n"], s["capacity"], ok, list(caveat))
        if ok:
            break
    return best


def best_by_format(plans: list[Plan], key: str = "weights") -> dict[str, Plan]:
    """The first plan meeting the SLO for each weight (or KV, ``key="kv"``) format, in the ranking's order."""
    if key not in ("weights", "kv"):
        raise ValueError(f"key={key!r} is unknown; allowed: ['weights', 'kv']")
    out: dict[str, Plan] = {}
    for p in plans:
        if p.fits and p.meets_slo and getattr(p, key) not in out:
            out[getattr(p, key)] = p
    return out


def explain(p: Plan, spec: ModelConfig, cluster: Cluster) -> str:
    """Why this layout, in the numbers that decide it."""
    weight_bytes = spec.weight_bytes(p.weights)
    need = math.ceil(weight_bytes / (0.9 * cluster.gpu.mem_capacity))
    parts = [f"{spec.name} holds {weight_bytes / 1e9:,.0f} GB of {p.weights} weights; {cluster.gpu.name} has "
             f"{cluster.gpu.mem_capacity / 1e9:.0f} GB, so " + (f"at least {need} GPUs must share them." if need > 1
                                                                 else "one GPU could hold them, with little room "
                                                                      "left for the KV cache.")]
    if p.tp > 1:
        parts.append(f"TP{p.tp} inside a node splits every weight read {p.tp} ways (decode is bandwidth-bound) over "
                     f"{get_link(cluster.intra).name}, at the cost of two all-reduces per layer.")
    if p.pp > 1:
        parts.append(f"PP{p.pp} adds memory across {'nodes' if p.tp * p.pp > cluster.gpus_per_node else 'GPUs'}; "
                     "it sends activations once per stage but does not speed up a single token.")
    parts.append(f"Weights {p.weights} and KV {p.kv}: {dtype_bytes(p.weights):g} and {dtype_bytes(p.kv):g} bytes "
                 f"per element; batch up to {p.max_batch}. Predicted: decode step {p.decode_step_ms:.1f} ms, "
                 f"TPOT {p.tpot_ms:.1f} ms, p99 TTFT {p.ttft_p99_ms:.0f} ms, capacity {p.capacity_req_s:.1f} req/s "
                 f"on {p.gpus} GPUs ({p.replicas} replica{'s' if p.replicas > 1 else ''})"
                 + ("." if p.validated else f", {MULTI_GPU_CAVEAT}."))
    return " ".join(parts)
