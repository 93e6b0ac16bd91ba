"""Notebook 01 (diagnose): the roofline arithmetic of a linear layer, the KV-cache bytes of a model, the floor of a
decode step, and a profile table classified by what bounds each row (set against the notebook's regimes test)."""

from __future__ import annotations

import random

from labkit.exercises.core import Case, Exercise, Measurement, Prediction, register
from labkit.exercises.measured import data_of, figure
from labkit.model import ModelConfig, get_config
from labkit.roofline import RooflineRow


def linear_roofline(tokens: int, d_in: int, d_out: int, bytes_per_el: float, peak_flops: float,
                    bandwidth: float) -> tuple[float, float, float, str]:
    """Solution: ``(flops, bytes, seconds, bound)`` of ``y = x @ W.T`` for ``tokens`` rows, ``W`` ``[d_out, d_in]``,
    moving W, x and y once each at ``bytes_per_el``; the time of the binding ceiling; 'compute' or 'memory'."""
    row = RooflineRow("linear", 2 * tokens * d_in * d_out, (d_in * d_out + tokens * (d_in + d_out)) * bytes_per_el,
                      peak_flops, bandwidth)
    return row.flops, row.bytes, row.time_s, row.bound


def _roofline_cases() -> list[Case]:
    rng = random.Random(1)
    gpus = [("H100", 989e12, 3.35e12), ("H200", 989e12, 4.8e12), ("laptop CPU", 1.2e12, 80e9)]
    shapes = [(1, 4096, 14336, 2.0), (7, 5120, 1536, 2.0), (333, 8192, 8192, 1.0), (4096, 4096, 4096, 2.0),
              (1, 12288, 49152, 0.5), (65536, 2048, 11008, 2.0)]
    cases = []
    for t, i, o, b in shapes:
        name, peak, bw = rng.choice(gpus)
        cases.append(Case(f"tokens={t}, W [{o}, {i}], {b} bytes/element on {name} ({peak / 1e12:.0f} TFLOP/s, "
                          f"{bw / 1e12:.2f} TB/s)", (t, i, o, b, peak, bw)))
    return cases


register(Exercise(
    "01.linear_roofline", "roofline of one linear layer: FLOPs, bytes, time, bound", linear_roofline,
    _roofline_cases, lambda fn, c: tuple(fn(*c)),
    hint="a multiply-add is 2 FLOPs; bytes = weight + input + output, each read or written once"))


def kv_cache_bytes(spec: ModelConfig, batch: int, context: int, dtype: str) -> float:
    """Solution: bytes of the KV cache of ``batch`` sequences of ``context`` tokens, stored in ``dtype``."""
    return spec.kv_bytes(batch * context, dtype)


def _kv_cases() -> list[Case]:
    gemma_like = ModelConfig(name="gemma-like (head_dim 256 != hidden / heads)", vocab_size=256000, hidden_size=3072,
                             num_layers=28, num_heads=16, num_kv_heads=16, head_dim=256, intermediate_size=24576)
    odd = ModelConfig(name="odd (GQA 6:1, head_dim 96)", vocab_size=32003, hidden_size=1152, num_layers=13,
                      num_heads=12, num_kv_heads=2, head_dim=96, intermediate_size=3000)
    rows = [("llama-2-7b", 1, 4096, "bf16"), ("llama-3-8b", 16, 8192, "bf16"), ("llama-3-70b", 3, 1000, "fp8"),
            (gemma_like, 5, 777, "fp32"), (odd, 9, 131, "int8"), ("gpt3-175b", 2, 2048, "bf16")]
    return [Case(f"{get_config(s).name}: batch={b}, context={c}, {d}", (get_config(s), b, c, d)) for s, b, c, d in rows]


register(Exercise(
    "01.kv_bytes", "KV-cache bytes of a model at a batch and context", kv_cache_bytes, _kv_cases,
    lambda fn, c: fn(*c),
    hint="K and V, every layer, one vector of head_dim per KV head (grouped-query attention has fewer KV heads)"))


def decode_floor(spec: ModelConfig, batch: int, context: int, dtype: str, bandwidth: float) -> float:
    """Solution: the bandwidth floor of one decode step (seconds): every weight read once (the embedding table
    only as a tied LM head), plus the KV cache of ``batch`` sequences of ``context`` tokens, over ``bandwidth``."""
    return (spec.decode_weight_bytes(dtype) + batch * spec.kv_bytes(context, dtype)) / bandwidth


def _floor_cases() -> list[Case]:
    tied = ModelConfig(name="small-tied (embeddings shared with the LM head)", vocab_size=49152, hidden_size=2048,
                       num_layers=30, num_heads=32, num_kv_heads=2, intermediate_size=8192, tie_word_embeddings=True)
    rows = [("llama-3-8b", 1, 512, "bf16", 4.8e12), ("llama-3-8b", 64, 512, "bf16", 3.35e12),
            (tied, 7, 3000, "bf16", 1.0e12), ("llama-3-70b", 16, 4096, "fp8", 4.8e12),
            ("gpt3-175b", 3, 2048, "int8", 3.35e12), ("llama-2-7b", 1, 1, "fp32", 80e9)]
    return [Case(f"{get_config(s).name}: batch={b}, context={c}, {d}, {bw / 1e12:.2f} TB/s",
                 (get_config(s), b, c, d, bw)) for s, b, c, d, bw in rows]


register(Exercise(
    "01.decode_floor", "the bandwidth floor of one decode step", decode_floor, _floor_cases, lambda fn, c: fn(*c),
    hint="a decode step reads each weight once, except the embedding table (one row per token) unless it is tied "
         "to the LM head; plus every sequence's KV cache"))


BOUNDS = ("memory-bound", "compute-bound", "launch-bound")
REGIME_AS_BOUND = {"bandwidth-bound": "memory-bound", "compute-bound": "compute-bound",
                   "overhead-bound": "launch-bound"}  # the regimes test's words for the same three ceilings


def classify_ops(ops: list[dict], peak_flops: float, bandwidth: float, overhead_factor: float = 5.0) -> dict:
    """Solution: ``{op: bound}`` for a profile table, each row ``{"op", "time_s", "flops", "bytes"}``.

    The roofline floor of a row is ``max(flops / peak_flops, bytes / bandwidth)``. A row whose measured time is
    more than ``overhead_factor`` times its floor (or whose floor is 0) is 'launch-bound': neither its FLOPs nor its
    bytes explain its time, a per-call cost does. Otherwise it is 'compute-bound' when its intensity ``flops /
    bytes`` reaches the ridge point ``peak_flops / bandwidth``, else 'memory-bound'."""
    out = {}
    for row in ops:
        floor = max(row["flops"] / peak_flops, row["bytes"] / bandwidth)
        if floor <= 0 or row["time_s"] > overhead_factor * floor:
            out[row["op"]] = "launch-bound"
        elif row["bytes"] == 0 or row["flops"] / row["bytes"] >= peak_flops / bandwidth:
            out[row["op"]] = "compute-bound"
        else:
            out[row["op"]] = "memory-bound"
    return out


def _op(op, time_s, flops, nbytes):
    return {"op": op, "time_s": time_s, "flops": flops, "bytes": nbytes}


def _classify_cases() -> list[Case]:
    h200, cpu = (989e12, 4.8e12), (44.8e9, 13.9e9)
    decode_h200 = [  # Llama-3-8B, batch 1, HF eager on an H200: per decode step
        _op("QKV/O projections", 0.00095, 2 * 1.34e9, 2.68e9), _op("MLP", 0.0021, 2 * 5.64e9, 11.3e9),
        _op("attention", 0.00031, 2 * 32 * 128 * 512 * 2 * 32, 2 * 32 * 8 * 128 * 512 * 2),
        _op("RMSNorm (65 calls)", 0.00046, 65 * 4096 * 4, 65 * 4096 * 2 * 3),
        _op("rotary (64 calls)", 0.00029, 2e6, 4e6),
        _op("idle (host)", 0.074, 0, 0)]
    prefill_h200 = [_op("MLP, 8192 tokens", 0.12, 2 * 8192 * 5.64e9, 11.3e9 + 8192 * 3 * 14336 * 2),
                    _op("flash attention, 8192 tokens", 0.0026, 4 * 8192 * 8192 * 4096 / 2, 3 * 8192 * 4096 * 2),
                    _op("embedding gather", 0.000012, 0, 8192 * 4096 * 2)]
    edge_hw = (2.0 ** 50, 2.0 ** 42)  # 1.13 PFLOP/s, 4.4 TB/s: ridge 256, floors exact in binary
    edges = [_op("exactly at the ridge", 2.0 ** -10, 2.0 ** 40, 2.0 ** 32),
             _op("just under the ridge", 2.0 ** -10, 2.0 ** 40 - 2.0 ** 20, 2.0 ** 32),
             _op("exactly 5x its floor", 5 * 2.0 ** -10, 0, 2.0 ** 32),
             _op("just over 5x its floor", 5.001 * 2.0 ** -10, 0, 2.0 ** 32),
             _op("FLOPs and no bytes (operands in registers)", 2.0 ** -20, 2.0 ** 30, 0)]
    cpu_rows = [_op("aten::mm", 0.0096, 21e6, 34e6), _op("aten::cat (KV copy)", 0.0022, 0, 0),
                _op("aten::mul", 0.00062, 2e5, 2.4e6), _op("sdpa", 0.0035, 4.2e6, 16.8e6)]
    return [Case("decode step, Llama-3-8B shape, H200 (989 TFLOP/s, 4.8 TB/s)", (decode_h200, *h200, 5.0)),
            Case("prefill of 8192 tokens, H200", (prefill_h200, *h200, 5.0)),
            Case("rows at the edges (2^50 FLOP/s, 2^42 B/s: ridge 256): intensity at the ridge, time at exactly 5x "
                 "the floor, no bytes at all", (edges, *edge_hw, 5.0)),
            Case("the embedded model on a CPU (44.8 GFLOP/s, 13.9 GB/s), overhead factor 3", (cpu_rows, *cpu, 3.0)),
            Case("the same CPU rows, overhead factor 20", (cpu_rows, *cpu, 20.0))]


def _classify_measure() -> list[Measurement]:
    _, rec, source = figure("diagnose.regime_matmul")
    data = data_of(rec, "notebook 01's regimes test")
    peak, bw = data["ceilings"]["matmul_flops"], data["ceilings"]["copy_bytes_per_s"]
    rows = data["regimes"]["rows"]
    ops = []
    for r in rows:  # rebuild FLOPs and bytes from the floor and the intensity the record holds
        floor, inten = r["floor ms/step"] / 1e3, r["FLOP/byte"]
        if floor <= 0:
            flops = nbytes = 0.0
        elif inten < peak / bw:
            nbytes = floor * bw
            flops = inten * nbytes
        else:
            flops = floor * peak
            nbytes = flops / inten if inten else 0.0
        ops.append(_op(r["category"], r["base ms/step"] / 1e3, flops, nbytes))
    measured = {r["category"]: r["regime"] for r in rows}
    by_cat = {r["category"]: r for r in rows}

    def judge(pred, meas):
        same = [c for c, m in meas.items() if REGIME_AS_BOUND.get(m) and pred.get(c) == REGIME_AS_BOUND[m]]
        comparable = [c for c, m in meas.items() if REGIME_AS_BOUND.get(m)]
        inside = 2 * len(same) >= len(comparable)
        return inside, (f"the table agrees with the regimes test on {len(same)} of {len(comparable)} categories"
                        f" ({', '.join(same) or 'none'}): {'inside' if inside else 'outside'} the stated band of at "
                        f"least half")

    def explain(pred, meas):
        why = []
        for c, m in meas.items():
            r, p = by_cat[c], pred.get(c)
            if REGIME_AS_BOUND.get(m) == p:
                continue
            moved = f"x{r['ratio 2x batch']:.2f} at twice the batch, x{r['ratio 2x context']:.2f} at twice the context"
            if p == "launch-bound" and r["floor ms/step"] <= 0:
                why.append(f"{c}: the roofline counts no work for it (floor 0), so one profile must call it "
                           f"launch-bound, but its time moved {moved}: it does work the roofline leaves out (HF's "
                           f"dynamic cache copies the whole KV cache as it grows)")
            elif p == "launch-bound":
                why.append(f"{c}: {r['base ms/step'] / r['floor ms/step']:.0f}x its floor in one profile, yet its "
                           f"time moved {moved}: it follows the work, so the excess is slow or unfused kernels, "
                           f"not per-call cost; one profile cannot tell the two apart, doubling the work can")
            else:
                why.append(f"{c}: you say {p}, the regimes test says {m} ({moved})")
        return "; ".join(why) or "none: the single profile and the scaling test agree on every category"

    return [Measurement(f"bounds of the decode step's categories (batch {data['regimes']['batch']}, context "
                        f"{data['regimes']['context']}), one profile against the regimes test's doubling",
                        (ops, peak, bw, 5.0), measured, "", source, None, explain, judge=judge)]


register(Prediction(
    "01.classify_ops", "classify a profile table: memory-, compute- or launch-bound against the ridge point",
    classify_ops, _classify_cases, lambda fn, c: fn([dict(r) for r in c[0]], *c[1:]), measure=_classify_measure,
    hint="floor = max(flops / peak, bytes / bandwidth); time > factor x floor (or a floor of 0): launch-bound; "
         "else compare flops / bytes with the ridge peak / bandwidth (at the ridge: compute-bound)"))
