"""Step times of one replica (``tp x pp`` GPUs): a decode step and a prefill, from the roofline floors scaled by a
``Calibration``.

A decode step's weight read takes the fastest path measured for its format at its micro-batch: the step sweep's
fitted engine path (``bandwidth_eff`` and the batched dequantising cost) or a ``KernelPath`` (the bf16 read times
the path's measured ratio to bf16); its KV read likewise per KV format.
"""

from __future__ import annotations

import math

from labkit.models import ModelSpec
from labkit.parallel.cost_model import memory_per_device, pp_comm, tp_comm
from labkit.plan.inputs import KV_DTYPES, WEIGHT_DTYPES, Calibration, Cluster, check_formats, check_positive_int


def check_layout(tp, pp, batch: int | None = None, weights: str | None = None, kv: str | None = None) -> None:
    """A ValueError naming the argument when a layout, batch or format cannot be planned."""
    check_positive_int("tp", tp)
    check_positive_int("pp", pp)
    if batch is not None:
        check_positive_int("batch", batch)
    if weights is not None:
        check_formats("weights", weights, WEIGHT_DTYPES)
    if kv is not None:
        check_formats("kv", kv, KV_DTYPES)


def decode_parts(spec: ModelSpec, tp: int, pp: int, batch: int, context: int, weights: str,
                 kv: str) -> tuple[float, float]:
    """(weight bytes, KV bytes) one stage reads per micro-batch: the planner's floor of a decode step."""
    mb = max(1, math.ceil(batch / pp))
    m = memory_per_device(spec, tp, pp, mb * context, dtype=weights, kv_dtype=kv)
    return m["weights"], m["kv"]


def links(cluster: Cluster, tp: int, pp: int) -> tuple[str, str]:
    """The link TP's all-reduces and PP's sends cross: inside a node while the group fits in one."""
    tp_link = cluster.intra if tp <= cluster.gpus_per_node else cluster.inter
    pp_link = cluster.intra if tp * pp <= cluster.gpus_per_node else cluster.inter
    return tp_link, pp_link


def weight_paths(spec: ModelSpec, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int, context: int,
                 weights: str) -> dict[str, float]:
    """Seconds one stage spends reading (and multiplying) its weights per micro-batch, by every measured path
    of ``weights`` at this micro-batch: ``{path: seconds}``. The step uses the smallest."""
    check_layout(tp, pp, batch, weights)
    mb = max(1, math.ceil(batch / pp))
    layers = math.ceil(spec.num_layers / pp)
    bw = cluster.gpu.mem_bandwidth
    out = {}
    if weights == "bf16" or cal.swept(weights) or not cal.paths(weights, mb):
        w_bytes = decode_parts(spec, tp, pp, batch, context, weights, "bf16")[0]
        t = w_bytes / (bw * cal.bw(weights))
        if mb > 1:  # quantised weights times more than one row: the dequantising GEMM's per-weight cost
            t += cal.dequant(weights) * spec.matmul_params * layers / spec.num_layers / tp
        out["engine (step sweep)" if cal.swept(weights) else "assumed (no measured path)"] = t
    if weights != "bf16":
        bf16 = decode_parts(spec, tp, pp, batch, context, "bf16", "bf16")[0] / (bw * cal.bw("bf16"))
        for p in cal.paths(weights, mb):
            out[f"{p.path} (batch {p.batch})"] = bf16 * p.ratio
    return out


def kv_read_time(spec: ModelSpec, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int, context: int,
                 kv: str) -> float:
    """Seconds one stage reads its micro-batch's KV cache: the bf16 read, times the best measured ratio of
    ``kv`` (1 where none is measured: the memory saving counts, an unmeasured speed-up does not)."""
    check_layout(tp, pp, batch, kv=kv)
    mb = max(1, math.ceil(batch / pp))
    bf16 = decode_parts(spec, tp, pp, batch, context, "bf16", "bf16")[1] / (cluster.gpu.mem_bandwidth * cal.kv_eff)
    if kv == "bf16":
        return bf16
    return bf16 * min([p.ratio for p in cal.paths(kv, mb, kv=True)], default=1.0)


def decode_step_time(spec: ModelSpec, cluster: Cluster, cal: Calibration, tp: int, pp: int, batch: int,
                     context: int, weights: str, kv: str) -> float:
    """Seconds for every one of ``batch`` sequences to gain a token (``pp`` micro-batches in flight).

    Each stage reads its weights and KV once per micro-batch; a token passes all ``pp`` stages."""
    check_layout(tp, pp, batch, weights, kv)
    mb = max(1, math.ceil(batch / pp))
    layers = math.ceil(spec.num_layers / pp)
    flops = mb * (2 * spec.matmul_params + spec.attention_flops_per_token(context)) * layers / spec.num_layers / tp
    read_s = min(weight_paths(spec, cluster, cal, tp, pp, batch, context, weights).values()) + \
        kv_read_time(spec, cluster, cal, tp, pp, batch, context, kv)
    compute_s = flops / (cluster.gpu.bf16_flops * cal.compute(weights))
    tp_link, pp_link = links(cluster, tp, pp)
    comm_s = tp_comm(spec, tp, mb, tp_link, layers=layers)["time_s"] if tp > 1 else 0.0
    stage_s = layers * cal.layer_overhead_s + max(read_s, compute_s) + comm_s
    return pp * stage_s + pp_comm(spec, pp, mb, pp_link)["time_s"]


def prefill_time(spec: ModelSpec, cluster: Cluster, cal: Calibration, tp: int, pp: int, prompt_len: int,
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
