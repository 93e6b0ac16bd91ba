"""Notebook 01 (diagnose): the roofline arithmetic of a linear layer, and the KV-cache bytes of a model."""

from __future__ import annotations

import random

from labkit.exercises.core import Case, Exercise, register
from labkit.models import ModelSpec, get_spec
from labkit.profiling import RooflineRow


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


def kv_cache_bytes(spec: ModelSpec, batch: int, context: int, dtype: str) -> float:
    """Solution: bytes of the KV cache of ``batch`` sequences of ``context`` tokens, stored in ``dtype``."""
    return spec.kv_bytes(batch * context, dtype)


def _kv_cases() -> list[Case]:
    gemma_like = ModelSpec(name="gemma-like (head_dim 256 != hidden / heads)", vocab_size=256000, hidden_size=3072,
                           num_layers=28, num_heads=16, num_kv_heads=16, head_dim=256, intermediate_size=24576)
    odd = ModelSpec(name="odd (GQA 6:1, head_dim 96)", vocab_size=32003, hidden_size=1152, num_layers=13,
                    num_heads=12, num_kv_heads=2, head_dim=96, intermediate_size=3000)
    rows = [("llama-2-7b", 1, 4096, "bf16"), ("llama-3-8b", 16, 8192, "bf16"), ("llama-3-70b", 3, 1000, "fp8"),
            (gemma_like, 5, 777, "fp32"), (odd, 9, 131, "int8"), ("gpt3-175b", 2, 2048, "bf16")]
    return [Case(f"{get_spec(s).name}: batch={b}, context={c}, {d}", (get_spec(s), b, c, d)) for s, b, c, d in rows]


register(Exercise(
    "01.kv_bytes", "KV-cache bytes of a model at a batch and context", kv_cache_bytes, _kv_cases,
    lambda fn, c: fn(*c),
    hint="K and V, every layer, one vector of head_dim per KV head (grouped-query attention has fewer KV heads)"))


def decode_floor(spec: ModelSpec, batch: int, context: int, dtype: str, bandwidth: float) -> float:
    """Solution: the bandwidth floor of one decode step (seconds): every weight read once (the embedding table
    only as a tied LM head), plus the KV cache of ``batch`` sequences of ``context`` tokens, over ``bandwidth``."""
    return (spec.decode_weight_bytes(dtype) + batch * spec.kv_bytes(context, dtype)) / bandwidth


def _floor_cases() -> list[Case]:
    tied = ModelSpec(name="small-tied (embeddings shared with the LM head)", vocab_size=49152, hidden_size=2048,
                     num_layers=30, num_heads=32, num_kv_heads=2, intermediate_size=8192, tie_embeddings=True)
    rows = [("llama-3-8b", 1, 512, "bf16", 4.8e12), ("llama-3-8b", 64, 512, "bf16", 3.35e12),
            (tied, 7, 3000, "bf16", 1.0e12), ("llama-3-70b", 16, 4096, "fp8", 4.8e12),
            ("gpt3-175b", 3, 2048, "int8", 3.35e12), ("llama-2-7b", 1, 1, "fp32", 80e9)]
    return [Case(f"{get_spec(s).name}: batch={b}, context={c}, {d}, {bw / 1e12:.2f} TB/s", (get_spec(s), b, c, d, bw))
            for s, b, c, d, bw in rows]


register(Exercise(
    "01.decode_floor", "the bandwidth floor of one decode step", decode_floor, _floor_cases, lambda fn, c: fn(*c),
    hint="a decode step reads each weight once, except the embedding table (one row per token) unless it is tied "
         "to the LM head; plus every sequence's KV cache"))
