"""Notebook 08 (capstone): the planner's estimates for a new model: memory per GPU, and the largest batch that fits.

Solutions: labkit's ``memory_per_device`` (``labkit.parallel.cost_model``), which the planner (``labkit.plan``)
uses to decide whether a layout fits, and the batch it implies.
"""

from __future__ import annotations

from labkit.exercises.core import Case, Exercise, register
from labkit.models import ModelSpec, get_spec
from labkit.parallel.cost_model import memory_per_device

NEW_MODEL = ModelSpec(name="new-model-34b (GQA 7:1, 60 layers, untied)", vocab_size=102400, hidden_size=7168,
                      num_layers=60, num_heads=56, num_kv_heads=8, head_dim=128, intermediate_size=20480)
TIED = ModelSpec(name="small-tied (2 KV heads, tied embeddings)", vocab_size=49152, hidden_size=2048, num_layers=30,
                 num_heads=32, num_kv_heads=2, intermediate_size=8192, tie_embeddings=True)


def memory_per_gpu(spec: ModelSpec, tp: int, pp: int, kv_tokens: int, dtype: str = "bf16",
                   kv_dtype: str | None = None) -> dict:
    """Solution: ``{"weights": bytes, "kv": bytes}`` on the busiest GPU of a ``tp x pp`` layout."""
    m = memory_per_device(spec, tp, pp, kv_tokens, dtype, kv_dtype)
    return {"weights": m["weights"], "kv": m["kv"]}


def _mem_cases() -> list[Case]:
    rows = [(NEW_MODEL, 1, 1, 4096, "bf16", None), (NEW_MODEL, 4, 1, 100_000, "bf16", "fp8"),
            (NEW_MODEL, 8, 3, 8191, "int4", "bf16"), ("llama-3-8b", 2, 2, 12345, "bf16", None),
            (TIED, 1, 1, 777, "bf16", None), (TIED, 8, 1, 3000, "int8", None), (TIED, 4, 7, 50, "bf16", "int8"),
            ("llama-3-70b", 16, 4, 1_000_000, "fp8", "fp8")]
    return [Case(f"{get_spec(s).name}: TP{tp} x PP{pp}, {kv} KV tokens, weights {d}, KV {k or d}",
                 (get_spec(s), tp, pp, kv, d, k)) for s, tp, pp, kv, d, k in rows]


register(Exercise(
    "08.memory_per_gpu", "memory per GPU of a TP x PP layout: weights and KV cache", memory_per_gpu, _mem_cases,
    lambda fn, c: {k: v for k, v in fn(*c).items() if k in ("weights", "kv")},
    hint="a stage holds ceil(layers / pp) layers; matrices and the embedding/head split tp ways, norms are "
         "replicated; with pp == 1 one GPU holds embedding and head (one table if tied); KV heads per GPU are "
         "max(1, kv_heads // tp)"))


def max_batch(spec: ModelSpec, tp: int, context: int, gpu_bytes: float, dtype: str = "bf16",
              kv_dtype: str | None = None, headroom: float = 0.9) -> int:
    """Solution: the most sequences of ``context`` tokens a ``tp``-way layout (one stage) serves, using at most
    ``headroom`` of each GPU's ``gpu_bytes``; 0 when the weights alone do not fit."""
    weights = memory_per_device(spec, tp, 1, 0, dtype, kv_dtype)["weights"]
    per_seq = memory_per_device(spec, tp, 1, context, dtype, kv_dtype)["kv"]
    return max(0, int((headroom * gpu_bytes - weights) // per_seq))


def _batch_cases() -> list[Case]:
    h100, h200 = 80e9, 141e9
    rows = [(NEW_MODEL, 1, 4096, h200, "bf16", None), (NEW_MODEL, 2, 4096, h100, "bf16", None),
            (NEW_MODEL, 4, 32768, h100, "bf16", "fp8"), (NEW_MODEL, 8, 1000, h100, "int4", None),
            (TIED, 1, 8192, 24e9, "bf16", None), (TIED, 4, 2048, 24e9, "bf16", None),
            ("gpt3-175b", 8, 2048, h200, "int8", None), ("gpt3-175b", 4, 2048, h100, "bf16", None)]
    return [Case(f"{get_spec(s).name}: TP{tp}, context {c}, {g / 1e9:.0f} GB GPUs, weights {d}, KV {k or d}",
                 (get_spec(s), tp, c, g, d, k)) for s, tp, c, g, d, k in rows]


register(Exercise(
    "08.max_batch", "the largest batch a layout serves: KV memory left after the weights", max_batch, _batch_cases,
    lambda fn, c: fn(*c),
    hint="(headroom x GPU bytes - weight bytes per GPU) // KV bytes of one sequence per GPU, floored at 0"))
