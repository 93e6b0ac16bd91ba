"""An analytical planner: which layout serves a model on a cluster at a given traffic and latency objective.

For a ``ModelSpec``, a ``Cluster`` (GPU type, GPUs per node, nodes, links), ``Traffic`` (arrival rate, prompt and
output lengths) and an ``SLO`` (p99 time to first token, time per output token), ``plan`` enumerates
tensor-parallel x pipeline-parallel layouts, weight and KV precisions and maximum batch sizes, and predicts for
each: memory per GPU (does it fit), the decode and prefill step times, communication, throughput and latency. The
step times are roofline floors (``labkit.parallel.cost_model``) scaled by efficiencies *calibrated from measured
H200 steps* (``scripts/bench_step_sweep.py``), so the prediction says what this software achieves, not what the
datasheet allows; ``validate`` reports how far the predictions land from the measurements.

Serving model (continuous batching, one replica of ``tp x pp`` GPUs, ``replicas`` of them share the traffic): with
``n`` sequences decoding, a step takes ``t(n)``; prefills are interleaved and take a share ``rho = lambda_r *
t_prefill`` of the time, so a token takes ``tpot = t(n) / (1 - rho)`` and Little's law gives ``n = lambda_r x
output_mean x tpot``, solved by fixed-point iteration; the layout is saturated when ``n`` would exceed the batch
limit. Time to first token is the prefill of a p99-length prompt, one decode step of waiting for a step boundary,
and the queueing of an M/D/1 prefill server at p99 (``-ln(0.01)`` times its mean wait). These are approximations,
stated as such; the engine notebook measures the real thing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from labkit.engine.metrics import SLO
from labkit.engine.workload import LengthDist
from labkit.hardware import Hardware
from labkit.models import REPO_ROOT, ModelSpec, dtype_bytes, get_spec
from labkit.parallel.cost_model import get_link, memory_per_device, pp_comm, tp_comm

STEP_SWEEP_RECORD = REPO_ROOT / "results" / "h200" / "records" / "step_sweep.json"
WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4")
KV_DTYPES = ("bf16", "fp8", "int8")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs; ``intra`` links GPUs inside a node, ``inter`` across nodes."""

    gpu: Hardware
    gpus_per_node: int = 8
    nodes: int = 1
    intra: str = "nvlink4"
    inter: str = "ib-ndr"

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Traffic:
    """Poisson arrivals at ``rate_req_s`` with prompt and output lengths from two distributions."""

    rate_req_s: float
    prompt_len: LengthDist
    output_len: LengthDist

    def quantile(self, which: str, q: float) -> float:
        xs = _samples(self.prompt_len if which == "prompt" else self.output_len)
        return float(xs[min(len(xs) - 1, int(q * len(xs)))])

    def mean(self, which: str) -> float:
        xs = _samples(self.prompt_len if which == "prompt" else self.output_len)
        return sum(xs) / len(xs)


@lru_cache(maxsize=64)
def _samples(dist: LengthDist, n: int = 20000) -> tuple[int, ...]:
    """Sorted draws of a length distribution (seeded), shared by every candidate of a plan."""
    import torch

    return tuple(sorted(dist.sample(n, torch.Generator().manual_seed(0))))


@dataclass(frozen=True)
class Calibration:
    """How this software's steps relate to the roofline, fitted to measured single-GPU steps.

    Decode, per stage and micro-batch: ``layers x layer_overhead_s + weight bytes / (bandwidth x
    bandwidth_eff[w]) + KV bytes / (bandwidth x kv_eff)``, plus ``params x dequant_s_per_param[w]`` when quantised
    weights multiply more than one row (the dequantising GEMM path, which costs compute per weight that the
    batch-1 GEMV does not); never less than the FLOPs at ``compute_eff``. Prefill: ``layers x
    prefill_layer_overhead_s + FLOPs / (matmul rate x compute_eff[w])``. Every efficiency is at most 1 (time
    is never below its floor) and every overhead at least 0. ``layer_overhead_s`` is the fixed cost of a layer's
    kernels (launches, tails, small kernels that never reach bandwidth); it scales with the layers a stage holds.
    """

    bandwidth_eff: dict
    compute_eff: dict
    layer_overhead_s: float
    source: str
    kv_eff: float = 1.0
    dequant_s_per_param: dict = field(default_factory=dict)
    prefill_layer_overhead_s: float = 0.0

    def bw(self, weights: str) -> float:
        return self.bandwidth_eff.get(weights, min(self.bandwidth_eff.values()))

    def compute(self, weights: str) -> float:
        return self.compute_eff.get(weights, min(self.compute_eff.values()))

    def dequant(self, weights: str) -> float:
        """Seconds per weight parameter of the batched dequantising path (0 for unquantised weights)."""
        if weights in ("bf16", "fp16"):
            return 0.0
        return self.dequant_s_per_param.get(weights, max(self.dequant_s_per_param.values(), default=0.0))


NOMINAL = Calibration({"bf16": 0.8}, {"bf16": 0.6}, 1e-6, "nominal (no measured record): 80% of bandwidth, 60% "
                      "of matmul rate, 1 us per layer")


# --- calibration and validation ---------------------------------------------------------------------------
def _decode_parts(spec: ModelSpec, tp: int, pp: int, batch: int, context: int, weights: str,
                  kv: str) -> tuple[float, float]:
    """(weight bytes, KV bytes) one stage reads per micro-batch: the planner's floor of a decode step."""
    mb = max(1, math.ceil(batch / pp))
    m = memory_per_device(spec, tp, pp, mb * context, dtype=weights, kv_dtype=kv)
    return m["weights"], m["kv"]


def _nnls(a, b):
    """Non-negative least squares (Lawson-Hanson active set) on float64 tensors: ``argmin |a x - b|, x >= 0``."""
    import torch

    n = a.shape[1]
    active = torch.zeros(n, dtype=torch.bool)
    x = torch.zeros(n, dtype=torch.float64)
    for _ in range(10 * n):
        grad = a.T @ (b - a @ x)
        if active.all() or grad[~active].max() <= 1e-12 * max(1.0, float(grad.abs().max())):
            break
        active[torch.where(~active, grad, torch.tensor(-math.inf, dtype=torch.float64)).argmax()] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[active] = torch.linalg.lstsq(a[:, active], b[:, None]).solution[:, 0]
            if (z[active] > 0).all():
                x = z
                break
            neg = active & (z <= 0)
            alpha = (x[neg] / (x[neg] - z[neg])).min()
            x = x + alpha * (z - x)
            active &= x > 1e-15
    return x


def _fit_excess(floors: list[float], features: list[list[float]], times: list[float]):
    """Non-negative coefficients ``c`` of ``time = floor + features . c``, minimising *relative* errors (a 7 ms
    and a 340 ms step count alike)."""
    import torch

    t = torch.tensor(times, dtype=torch.float64)
    a = torch.tensor(features, dtype=torch.float64) / t[:, None]
    b = (t - torch.tensor(floors, dtype=torch.float64)) / t
    return [float(c) for c in _nnls(a, b)]


def fit_calibration(rows: list[dict], spec, bandwidth: float, peak: float, source: str = "") -> Calibration:
    """Fit a ``Calibration`` to measured single-GPU steps (rows of ``scripts/bench_step_sweep.py``).

    Decode: ``t = W/B + KV/B + [W/B per precision, KV/B, params x (quantised and batch > 1) per precision] . c``
    with ``c >= 0``, so every efficiency ``1 / (1 + c)`` is at most 1; prefill likewise with ``FLOPs / peak`` per
    precision and a per-layer intercept. Both by relative-error non-negative least squares.

    A sweep varies batch and context but not the weight bytes of a precision, so a fixed per-step cost cannot be
    told apart from a lower weight-read efficiency: decode's ``layer_overhead_s`` is left at 0 and that cost is
    folded into ``bandwidth_eff`` (what a step pays besides the bytes' floor then scales with the weights, which
    under-states it for wide tensor-parallel layouts whose shards are small).
    """
    spec = get_spec(spec)
    dec = [r for r in rows if r["phase"] == "decode"]
    pre = [r for r in rows if r["phase"] == "prefill"]
    if not dec or not pre:
        raise ValueError("rows must hold decode and prefill measurements (scripts/bench_step_sweep.py)")
    ws = sorted({r["weights"] for r in rows})
    quant = [w for w in ws if w not in ("bf16", "fp16")]
    floors, feats = [], []
    for r in dec:
        wb, kvb = (x / bandwidth for x in _decode_parts(spec, 1, 1, r["batch"], r["context"] + 1, r["weights"],
                                                        "bf16"))
        batched = r["batch"] > 1
        floors.append(wb + kvb)
        feats.append([wb * (r["weights"] == w) for w in ws] + [kvb] +
                     [spec.matmul_params * (batched and r["weights"] == w) for w in quant])
    c = _fit_excess(floors, feats, [r["median_s"] for r in dec])
    n = len(ws)
    eff = {w: 1.0 / (1.0 + c[i]) for i, w in enumerate(ws)}
    kv_eff = 1.0 / (1.0 + c[n])
    dequant = {w: c[1 + n + i] for i, w in enumerate(quant)}
    pfl = [spec.prefill_flops(r["context"]) / peak for r in pre]
    cp = _fit_excess(pfl, [[spec.num_layers] + [f * (r["weights"] == w) for w in ws] for f, r in zip(pfl, pre)],
                     [r["median_s"] for r in pre])
    comp = {w: 1.0 / (1.0 + cp[1 + i]) for i, w in enumerate(ws) if any(r["weights"] == w for r in pre)}
    return Calibration(eff, comp, 0.0, source, kv_eff=kv_eff, dequant_s_per_param=dequant,
                       prefill_layer_overhead_s=cp[0])


def load_calibration(path: Path | str = STEP_SWEEP_RECORD) -> tuple[Calibration, dict | None]:
    """Calibration from a committed step-sweep record, or ``NOMINAL`` (and ``None``) when there is none."""
    path = Path(path)
    if not path.exists():
        return NOMINAL, None
    rec = json.loads(path.read_text())
    try:
        shown = str(path.relative_to(REPO_ROOT))
    except ValueError:
        shown = str(path)
    return calibration_of(rec, shown), rec


def calibration_of(record: dict, source: str = "", rows: list[dict] | None = None) -> Calibration:
    """``fit_calibration`` on a step-sweep record's rows (or on ``rows``, a subset of them)."""
    data = record["data"]
    c = data["ceilings"]
    return fit_calibration(data["rows"] if rows is None else rows, data["preset"], c["copy_bytes_per_s"],
                           c["matmul_flops"], source=source)


def validate(record: dict, cal: Calibration, gpu: Hardware, held_out: bool = False) -> list[dict]:
    """Predicted against measured step times for every single-GPU configuration in a step-sweep record.

    ``held_out=True`` predicts each row from a calibration fitted to the *other* rows (leave-one-out), the honest
    error of a model with several fitted parameters; ``cal`` is then not used."""
    spec = get_spec(record["data"]["preset"])
    cluster = Cluster(gpu, gpus_per_node=1, nodes=1)
    rows = record["data"]["rows"]
    out = []
    for i, r in enumerate(rows):
        if held_out:
            cal = calibration_of(record, "leave-one-out", rows[:i] + rows[i + 1:])
        if r["phase"] == "decode":
            pred = decode_step_time(spec, cluster, cal, 1, 1, r["batch"], r["context"] + 1, r["weights"], "bf16")
        else:
            pred = prefill_time(spec, cluster, cal, 1, 1, r["context"], r["weights"])
        out.append({"phase": r["phase"], "weights": r["weights"], "batch": r["batch"], "context": r["context"],
                    "measured_ms": r["median_s"] * 1e3, "predicted_ms": pred * 1e3,
                    "abs_pct_err": abs(pred - r["median_s"]) / r["median_s"]})
    return out


def mape(rows: list[dict]) -> float:
    return sum(r["abs_pct_err"] for r in rows) / len(rows)


# --- step times ---------------------------------------------------------------------------------------------
def _links(cluster: Cluster, tp: int, pp: int) -> tuple[str, str]:
    tp_link = cluster.intra if tp <= cluster.gpus_per_node else cluster.inter
    pp_link = cluster.intra if tp * pp <= cluster.gpus_per_node else cluster.inter
    return tp_link, pp_link


def decode_step_time(spec: ModelSpec, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int,
                     context: int, weights: str, kv: str) -> float:
    """Seconds for every one of ``batch`` sequences to gain a token (``pp`` micro-batches in flight).

    Each stage reads its weights and KV once per micro-batch; a token passes all ``pp`` stages."""
    mb = max(1, math.ceil(batch / pp))
    layers = math.ceil(spec.num_layers / pp)
    flops = mb * (2 * spec.matmul_params + spec.attention_flops_per_token(context)) * layers / spec.num_layers / tp
    w_bytes, kv_bytes = _decode_parts(spec, tp, pp, batch, context, weights, kv)
    bw = cluster.gpu.mem_bandwidth
    read_s = w_bytes / (bw * cal.bw(weights)) + kv_bytes / (bw * cal.kv_eff)
    if mb > 1:  # quantised weights times more than one row: the dequantising GEMM's per-weight cost
        read_s += cal.dequant(weights) * spec.matmul_params * layers / spec.num_layers / tp
    compute_s = flops / (cluster.gpu.bf16_flops * cal.compute(weights))
    tp_link, pp_link = _links(cluster, tp, pp)
    comm_s = tp_comm(spec, tp, mb, tp_link, layers=layers)["time_s"] if tp > 1 else 0.0
    stage_s = layers * cal.layer_overhead_s + max(read_s, compute_s) + comm_s
    return pp * stage_s + pp_comm(spec, pp, mb, pp_link)["time_s"]


def prefill_time(spec: ModelSpec, cluster: Cluster, cal: Calibration, tp: int, pp: int, prompt_len: int,
                 weights: str) -> float:
    """Seconds to prefill one prompt of ``prompt_len`` tokens through all stages (compute-bound)."""
    flops = spec.prefill_flops(prompt_len) / tp
    wbytes = memory_per_device(spec, tp, pp, 0, dtype=weights)["weights"] * pp
    tp_link, pp_link = _links(cluster, tp, pp)
    compute_s = max(flops / (cluster.gpu.bf16_flops * cal.compute(weights)),
                    wbytes / (cluster.gpu.mem_bandwidth * cal.bw(weights)))
    comm_s = tp_comm(spec, tp, prompt_len, tp_link)["time_s"] if tp > 1 else 0.0
    return (compute_s + comm_s + pp_comm(spec, pp, prompt_len, pp_link)["time_s"] +
            spec.num_layers * cal.prefill_layer_overhead_s)


# --- serving ------------------------------------------------------------------------------------------------
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
    def layout(self) -> str:
        return f"{self.replicas} x (TP{self.tp} x PP{self.pp}), weights {self.weights}, KV {self.kv}, " \
               f"batch <= {self.max_batch}"

    def to_dict(self) -> dict:
        return dict(asdict(self), gpus=self.gpus, layout=self.layout)


def _serve(spec, cluster, cal, tp, pp, batch, weights, kv, traffic, replicas) -> dict:
    lam = traffic.rate_req_s / replicas
    p_mean, o_mean = traffic.mean("prompt"), traffic.mean("output")
    ctx = int(p_mean + o_mean / 2)
    t_pre = prefill_time(spec, cluster, cal, tp, pp, int(p_mean), weights)
    rho = lam * t_pre
    n, tpot = 1.0, float("inf")
    for _ in range(100):
        step = decode_step_time(spec, cluster, cal, tp, pp, max(1, math.ceil(n)), ctx, weights, kv)
        tpot = step / (1 - rho) if rho < 1 else float("inf")
        n_new = lam * o_mean * tpot
        if abs(n_new - n) < 1e-3:
            break
        n = min(n_new, 10 * batch)
    full = decode_step_time(spec, cluster, cal, tp, pp, batch, ctx, weights, kv)
    capacity = replicas * batch / (o_mean * full + batch * t_pre)
    saturated = rho >= 1 or n > batch
    t_pre99 = prefill_time(spec, cluster, cal, tp, pp, int(traffic.quantile("prompt", 0.99)), weights)
    wait = rho * t_pre / (2 * (1 - rho)) if rho < 1 else float("inf")
    ttft = t_pre99 + (tpot * (1 - rho) if math.isfinite(tpot) else 0) + -math.log(0.01) * wait
    return {"tpot": tpot if not saturated else float("inf"), "ttft": ttft if not saturated else float("inf"),
            "n": n, "capacity": capacity, "t_pre": t_pre, "step": full}


def plan(spec, cluster: Cluster, traffic: Traffic, slo: SLO, cal: Calibration | None = None,
         weights: tuple[str, ...] = WEIGHT_DTYPES, kv: tuple[str, ...] = KV_DTYPES,
         batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256)) -> list[Plan]:
    """Every layout that uses at most the cluster's GPUs, ranked: meeting the SLO first, then fewest GPUs, then
    most headroom (capacity over offered rate). ``tp`` divides the query heads and fits in a node, ``pp`` divides
    the layers; replicas share the traffic."""
    spec = get_spec(spec)
    cal = cal or load_calibration()[0]
    for w in weights:
        if w not in WEIGHT_DTYPES:
            raise ValueError(f"weights={w!r} is unknown; allowed: {list(WEIGHT_DTYPES)}")
    for k in kv:
        if k not in KV_DTYPES:
            raise ValueError(f"kv={k!r} is unknown; allowed: {list(KV_DTYPES)}")
    if traffic.rate_req_s <= 0:
        raise ValueError(f"rate_req_s={traffic.rate_req_s} must be positive")
    out = []
    ctx_max = int(traffic.quantile("prompt", 0.9) + traffic.quantile("output", 0.9))
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and spec.num_heads % t == 0]
    for tp in tps:
        for pp in [p for p in range(1, cluster.nodes * cluster.gpus_per_node // tp + 1) if spec.num_layers % p == 0]:
            for w in weights:
                for k in kv:
                    for b in batches:
                        out.append(_candidate(spec, cluster, cal, traffic, slo, tp, pp, w, k, b, ctx_max))
    out = [p for p in out if p is not None]
    return sorted(out, key=lambda p: (not p.meets_slo, not p.fits, p.gpus,
                                      -p.capacity_req_s / traffic.rate_req_s, p.tpot_ms))


def _candidate(spec, cluster, cal, traffic, slo, tp, pp, w, k, b, ctx_max) -> Plan | None:
    if tp * pp > cluster.num_gpus:
        return None
    mem = memory_per_device(spec, tp, pp, math.ceil(b / pp) * ctx_max * pp, dtype=w, kv_dtype=k)
    fits = mem["total"] <= 0.9 * cluster.gpu.mem_capacity
    if not fits:
        return Plan(tp, pp, 0, w, k, b, False, mem["total"] / 1e9, *(float("nan"),) * 6, False,
                    ["does not fit"])
    best = None
    for replicas in range(1, cluster.num_gpus // (tp * pp) + 1):
        s = _serve(spec, cluster, cal, tp, pp, b, w, k, traffic, replicas)
        ok = s["ttft"] <= slo.ttft_s and s["tpot"] <= slo.tpot_s
        best = Plan(tp, pp, replicas, w, k, b, True, mem["total"] / 1e9, s["step"] * 1e3, s["t_pre"] * 1e3,
                    s["tpot"] * 1e3, s["ttft"] * 1e3, s["n"], s["capacity"], ok)
        if ok:
            break
    return best


def explain(p: Plan, spec: ModelSpec, cluster: Cluster) -> str:
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
                 f"on {p.gpus} GPUs ({p.replicas} replica{'s' if p.replicas > 1 else ''}).")
    return " ".join(parts)


# --- the capstone's reading of the results ------------------------------------------------------------------
TIERS = [
    ("1 measure", "profile and roofline (01)", ["diagnose.decode_bs1_idle_frac", "diagnose.decode_intensity",
                                               "diagnose.prefill_intensity", "baseline.hf_decode_bs1_mbu"]),
    ("2 scheduling and CUDA graphs", "continuous batching, graph replay (05)",
     ["engine.decode_bs1_mbu", "engine.continuous_vs_static_throughput", "engine.offline_speedup_vs_hf"]),
    ("3 KV memory", "paged cache, prefix sharing, int8/fp8 KV (02)",
     ["kvcache.paged_waste_frac", "kvcache.max_seqs_ratio", "kvcache.int8_ppl_delta_frac"]),
    ("4 fused kernels", "Triton RMSNorm, SwiGLU, RoPE, attention (03)",
     ["kernels.rmsnorm_speedup_vs_eager", "kernels.flash_attn_vs_sdpa", "kernels.paged_attn_bw_frac"]),
    ("5 weight quantisation", "int8 / int4 / GPTQ / NF4 / FP8 (04)",
     ["quant.int8_ppl_delta_frac", "quant.int4_calibrated_ppl_delta_frac", "quant.int4_weight_bytes_ratio",
      "quant.int4_decode_speedup"]),
    ("6 parallel layout", "TP in a node, PP across nodes (06)",
     ["parallel.tp_logits_rel_err", "parallel.pp_bubble_measured", "parallel.pp_bubble_formula"]),
]


def load_summary(path: Path | str | None = None) -> dict:
    """The figures of ``results/summary.json`` (name -> entry with value, unit, machine, record)."""
    from labkit.bench import SUMMARY_PATH

    path = Path(path or SUMMARY_PATH)
    return json.loads(path.read_text())["figures"] if path.exists() else {}


def strategy_table(figures: dict) -> list[dict]:
    """One row per tier and figure: the committed value with its machine and record, or what is still missing."""
    rows = []
    for tier, technique, names in TIERS:
        for name in names:
            e = figures.get(name)
            rows.append({"tier": tier, "technique": technique, "figure": name,
                         "value": e["value"] if e else None, "unit": e["unit"] if e else "",
                         "bar": (e or {}).get("bar", ""), "machine": e["machine"] if e else "not measured yet",
                         "record": e["record"] if e else ""})
    return rows
