"""Step times of one replica (``tp x pp`` GPUs): a decode step and a prefill, from the roofline floors scaled by a
``Calibration``. ``decode_step_parts`` is the one cost model of a TP x PP layout's decode step: the planner
(``labkit.plan.serve``), notebook 06's 175B tables (``labkit.plan.layouts``) and the capstone all call it.

A decode step's weight read takes the fastest path measured for its format at its micro-batch: the step sweep's
fitted engine path (``bandwidth_eff`` and the batched dequantising cost, inside the batches the sweep measured) or a
``KernelPath`` measured at that batch, or at the next measured batch above it, padded up as the engine pads a step
to its captured graph (the bf16 read times the path's measured ratio to bf16, on the measured layer shape nearest
the stage's per-GPU layer). A quantised format with no path measured at or above the micro-batch is not planned
there (its step is infinite: ``NO_PATH``); one with no measured path at all (the nominal calibration) is charged its
bytes at bf16's efficiency, labelled as assumed. Its KV read likewise per KV format (at its measured batch only).
Communication follows the ring collectives of ``labkit.parallel.cost_model`` on the datasheet links, or on the
alpha-beta fits of a multi-GPU record where the calibration holds one (``Calibration.collectives``). Every
efficiency comes from single-GPU records, so a layout of more than one GPU is a prediction ``MULTI_GPU_CAVEAT`` until
a multi-GPU record validates it (``Calibration.multi_gpu``).
"""

from __future__ import annotations

import math

from labkit.checks import check_choice, check_positive_int
from labkit.model import ModelConfig
from labkit.parallel.cost_model import memory_per_device, pp_comm, tp_comm
from labkit.plan.inputs import KV_DTYPES, WEIGHT_DTYPES, Calibration, Cluster

NO_PATH = "no kernel measured at this batch"
"""The note of a step whose quantised format has no path measured at its micro-batch (its time is infinite)."""
MULTI_GPU_CAVEAT = "not validated on multi-GPU"
"""How a prediction for more than one GPU is labelled while no multi-GPU record has checked the step model."""


def check_layout(tp, pp, weights: str | None = None, kv: str | None = None) -> None:
    """A ValueError naming the argument when a layout or a format (one name each) cannot be planned."""
    check_positive_int("tp", tp)
    check_positive_int("pp", pp)
    if weights is not None:
        check_choice("weights", weights, WEIGHT_DTYPES)
    if kv is not None:
        check_choice("kv", kv, KV_DTYPES)


def check_step(tp, pp, batch, context, weights: str | None = None, kv: str | None = None) -> None:
    """``check_layout``, and a decode step's ``batch`` (sequences) and ``context`` (the tokens each attends to, its
    own included): ints >= 1."""
    check_layout(tp, pp, weights, kv)
    check_positive_int("batch", batch)
    check_positive_int("context", context)


def micro_batch(batch: int, pp: int, microbatches: int | None = None) -> int:
    """Sequences per micro-batch: ``batch`` over ``microbatches`` (default ``pp``: one micro-batch per stage)."""
    m = pp if microbatches is None else check_positive_int("microbatches", microbatches)
    return max(1, math.ceil(batch / m))


def decode_parts(spec: ModelConfig, tp: int, pp: int, batch: int, context: int, weights: str,
                 kv: str, microbatches: int | None = None) -> tuple[float, float]:
    """(weight bytes, KV bytes) one stage reads per micro-batch: the planner's floor of a decode step."""
    return _parts(spec, tp, pp, micro_batch(batch, pp, microbatches), context, weights, kv)


def _parts(spec, tp, pp, mb, context, weights, kv) -> tuple[float, float]:
    m = memory_per_device(spec, tp, pp, mb * context, dtype=weights, kv_dtype=kv)
    return m["weights"], m["kv"]


def links(cluster: Cluster, tp: int, pp: int) -> tuple[str, str]:
    """The link TP's all-reduces and PP's sends cross: inside a node while the group fits in one."""
    tp_link = cluster.intra if tp <= cluster.gpus_per_node else cluster.inter
    pp_link = cluster.intra if tp * pp <= cluster.gpus_per_node else cluster.inter
    return tp_link, pp_link


def weight_paths(spec: ModelConfig, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int, context: int,
                 weights: str, microbatches: int | None = None) -> dict[str, float]:
    """Seconds one stage spends reading (and multiplying) its weights per micro-batch, by every measured path
    of ``weights`` at this micro-batch: ``{path: seconds}``. The step uses the smallest; empty where a quantised
    format has no path measured at this micro-batch (the step is then not planned: ``NO_PATH``)."""
    check_step(tp, pp, batch, context, weights)
    return _weight_paths(spec, cluster, cal, tp, pp, batch, context, weights, micro_batch(batch, pp, microbatches))


def _weight_paths(spec, cluster, cal, tp, pp, batch, context, weights, mb) -> dict[str, float]:
    layers = math.ceil(spec.num_layers / pp)
    bw = cluster.gpu.mem_bandwidth
    out = {}
    padded = None if weights == "bf16" else cal.padded_batch(weights, mb)
    measured = [] if padded is None else cal.paths(weights, padded, params=_shard_params(spec, tp))
    swept = cal.swept(weights, mb)
    if swept or (not measured and not cal.measured(weights) and not cal.swept(weights)):
        w_bytes = _parts(spec, tp, pp, mb, context, weights, "bf16")[0]
        t = w_bytes / (bw * cal.bw(weights))
        if mb > 1:  # quantised weights times more than one row: the dequantising GEMM's per-weight cost
            t += cal.dequant(weights) * spec.matmul_params * layers / spec.num_layers / tp
        out["labkit engine step (step-sweep fit)" if swept else "assumed (no measured path)"] = t
    if measured:
        bf16 = _parts(spec, tp, pp, mb, context, "bf16", "bf16")[0] / (bw * cal.bw("bf16"))
        for p in measured:
            out[f"{p.path} (batch {p.batch}{'' if p.batch == mb else f', {mb} padded'})"] = bf16 * p.ratio
    return out


def _shard_params(spec: ModelConfig, tp: int) -> int:
    """Weights of one layer's linears on one GPU of a TP group (what a measured layer shape is matched against)."""
    return max(1, (spec.attn_params_per_layer + spec.mlp_params_per_layer) // tp)


def kv_read_time(spec: ModelConfig, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int, context: int,
                 kv: str, microbatches: int | None = None) -> float:
    """Seconds one stage reads its micro-batch's KV cache: the bf16 read, times the best measured ratio of
    ``kv`` (1 where none is measured: the memory saving counts, an unmeasured speed-up does not)."""
    check_step(tp, pp, batch, context, kv=kv)
    return _kv_read(spec, cluster, cal, tp, pp, batch, context, kv, micro_batch(batch, pp, microbatches))


def _kv_read(spec, cluster, cal, tp, pp, batch, context, kv, mb) -> float:
    bf16 = _parts(spec, tp, pp, mb, context, "bf16", "bf16")[1] / (cluster.gpu.mem_bandwidth * cal.kv_eff)
    if kv == "bf16":
        return bf16
    return bf16 * min([p.ratio for p in cal.paths(kv, mb, kv=True)], default=1.0)


def decode_step_parts(spec: ModelConfig, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int,
                      context: int, weights: str = "bf16", kv: str = "bf16", microbatches: int | None = None,
                      memory: bool = True) -> dict:
    """The one cost model of a decode step (every one of ``batch`` sequences gains a token) on ``tp x pp`` GPUs,
    with its parts.

    The batch runs as ``microbatches`` micro-batches (default ``pp``). Each stage reads its weights and its
    micro-batch's KV once per micro-batch (the fastest measured path of each format), never faster than its FLOPs
    at the calibrated matmul rate, then all-reduces twice per layer (TP: on NVLink while the group fits in a node,
    else on the network); a token passes all ``pp`` stages, so a step takes ``max(microbatches, pp)`` stage times
    plus the sends between stages. Memory is ``memory_per_device`` with every sequence's KV (``batch x
    context`` tokens) on each stage (``memory=False`` leaves it out: the planner sizes memory at its own maximum
    context and calls this hundreds of thousands of times). ``validated`` is False (and ``caveat`` says so) for
    more than one GPU while the calibration holds no multi-GPU record.
    """
    check_step(tp, pp, batch, context, weights, kv)
    m = pp if microbatches is None else check_positive_int("microbatches", microbatches)
    mb = micro_batch(batch, pp, m)
    layers = math.ceil(spec.num_layers / pp)
    flops = mb * (2 * spec.matmul_params + spec.attention_flops_per_token(context)) * layers / spec.num_layers / tp
    wpaths = _weight_paths(spec, cluster, cal, tp, pp, batch, context, weights, mb)
    weights_path, weights_s = min(wpaths.items(), key=lambda kv: kv[1]) if wpaths else (NO_PATH, math.inf)
    kv_s = _kv_read(spec, cluster, cal, tp, pp, batch, context, kv, mb)
    compute_s = flops / (cluster.gpu.bf16_flops * cal.compute(weights))
    tp_link, pp_link = links(cluster, tp, pp)
    measured = cal.collectives if tp_link == cluster.intra else None
    tp_s = tp_comm(spec, tp, mb, tp_link, layers=layers, fits=measured)["time_s"] if tp > 1 else 0.0
    overhead_s = layers * cal.layer_overhead_s
    stage_s = overhead_s + max(weights_s + kv_s, compute_s) + tp_s
    pp_s = pp_comm(spec, pp, mb, pp_link)["time_s"]
    step_s = max(m, pp) * stage_s + pp_s
    validated = tp * pp == 1 or bool(cal.multi_gpu)
    out = {"tp": tp, "pp": pp, "gpus": tp * pp, "batch": batch, "context": context, "microbatches": m,
           "weights": weights, "kv": kv, "weights_path": weights_path, "weights_read_s": weights_s,
           "kv_read_s": kv_s, "compute_s": compute_s,
           "overhead_s": overhead_s, "tp_comm_s": tp_s, "pp_comm_s": pp_s, "stage_s": stage_s, "step_s": step_s,
           "tokens_per_s": batch / step_s, "comm_frac": (max(m, pp) * tp_s + pp_s) / step_s,
           "tp_link": tp_link, "pp_link": pp_link,
           "collectives": "measured" if measured and tp > 1 else "datasheet links", "calibration": cal.source,
           "calibrated_on": cal.machine, "validated": validated, "caveat": "" if validated else MULTI_GPU_CAVEAT}
    if memory:
        mem = memory_per_device(spec, tp, pp, batch * context, dtype=weights, kv_dtype=kv)
        out.update(weights_gb=mem["weights"] / 1e9, kv_gb=mem["kv"] / 1e9, mem_gb=mem["total"] / 1e9,
                   fits=mem["total"] <= 0.9 * cluster.gpu.mem_capacity)
    return out


def decode_step_time(spec: ModelConfig, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int,
                     context: int, weights: str, kv: str, microbatches: int | None = None) -> float:
    """Seconds for every one of ``batch`` sequences to gain a token: ``decode_step_parts(...)["step_s"]``."""
    return decode_step_parts(spec, cluster, cal, tp, pp, batch, context, weights, kv, microbatches,
                             memory=False)["step_s"]


def prefill_time(spec: ModelConfig, cluster: Cluster, cal: Calibration, tp: int, pp: int, prompt_len: int,
                 weights: str) -> float:
    """Seconds to prefill one prompt of ``prompt_len`` tokens through all stages (compute-bound)."""
    check_layout(tp, pp, weights=weights)
    check_positive_int("prompt_len", prompt_len)
    flops = spec.prefill_flops(prompt_len) / tp
    wbytes = memory_per_device(spec, tp, pp, 0, dtype=weights)["weights"] * pp
    tp_link, pp_link = links(cluster, tp, pp)
    compute_s = max(flops / (cluster.gpu.bf16_flops * cal.compute(weights)),
                    wbytes / (cluster.gpu.mem_bandwidth * cal.bw(weights)))
    comm_s = tp_comm(spec, tp, prompt_len, tp_link)["time_s"] if tp > 1 else 0.0
    return (compute_s + comm_s + pp_comm(spec, pp, prompt_len, pp_link)["time_s"] +
            spec.num_layers * cal.prefill_layer_overhead_s)
