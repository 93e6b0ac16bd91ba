"""Notebook 08 (capstone): the planner's estimates for a new model: memory per GPU, the largest batch that fits, and
the 175B plan's GPU count by hand (set against the planner's).

Solutions: labkit's ``memory_per_device`` (``labkit.parallel.cost_model``), which the planner (``labkit.plan``)
uses to decide whether a layout fits, and the batch it implies.
"""

from __future__ import annotations

import math

from labkit.exercises.core import Case, Exercise, Measurement, Prediction, register
from labkit.exercises.measured import data_of, figure
from labkit.model import ModelConfig, dtype_bytes, get_config
from labkit.parallel.cost_model import memory_per_device

NEW_MODEL = ModelConfig(name="new-model-34b (GQA 7:1, 60 layers, untied)", vocab_size=102400, hidden_size=7168,
                        num_layers=60, num_heads=56, num_kv_heads=8, head_dim=128, intermediate_size=20480)
TIED = ModelConfig(name="small-tied (2 KV heads, tied embeddings)", vocab_size=49152, hidden_size=2048, num_layers=30,
                   num_heads=32, num_kv_heads=2, intermediate_size=8192, tie_word_embeddings=True)


def memory_per_gpu(spec: ModelConfig, tp: int, pp: int, kv_tokens: int, dtype: str = "bf16",
                   kv_dtype: str | None = None) -> dict:
    """Solution: ``{"weights": bytes, "kv": bytes}`` on the busiest GPU of a ``tp x pp`` layout."""
    m = memory_per_device(spec, tp, pp, kv_tokens, dtype, kv_dtype)
    return {"weights": m["weights"], "kv": m["kv"]}


def _mem_cases() -> list[Case]:
    rows = [(NEW_MODEL, 1, 1, 4096, "bf16", None), (NEW_MODEL, 4, 1, 100_000, "bf16", "fp8"),
            (NEW_MODEL, 8, 3, 8191, "int4", "bf16"), ("llama-3-8b", 2, 2, 12345, "bf16", None),
            (TIED, 1, 1, 777, "bf16", None), (TIED, 8, 1, 3000, "int8", None), (TIED, 4, 7, 50, "bf16", "int8"),
            ("llama-3-70b", 16, 4, 1_000_000, "fp8", "fp8")]
    return [Case(f"{get_config(s).name}: TP{tp} x PP{pp}, {kv} KV tokens, weights {d}, KV {k or d}",
                 (get_config(s), tp, pp, kv, d, k)) for s, tp, pp, kv, d, k in rows]


register(Exercise(
    "08.memory_per_gpu", "memory per GPU of a TP x PP layout: weights and KV cache", memory_per_gpu, _mem_cases,
    lambda fn, c: {k: v for k, v in fn(*c).items() if k in ("weights", "kv")},
    hint="a stage holds ceil(layers / pp) layers; matrices and the embedding/head split tp ways, norms are "
         "replicated; with pp == 1 one GPU holds embedding and head (one table if tied); KV heads per GPU are "
         "max(1, kv_heads // tp)"))


def max_batch(spec: ModelConfig, tp: int, context: int, gpu_bytes: float, dtype: str = "bf16",
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
    return [Case(f"{get_config(s).name}: TP{tp}, context {c}, {g / 1e9:.0f} GB GPUs, weights {d}, KV {k or d}",
                 (get_config(s), tp, c, g, d, k)) for s, tp, c, g, d, k in rows]


register(Exercise(
    "08.max_batch", "the largest batch a layout serves: KV memory left after the weights", max_batch, _batch_cases,
    lambda fn, c: fn(*c),
    hint="(headroom x GPU bytes - weight bytes per GPU) // KV bytes of one sequence per GPU, floored at 0"))


def gpus_for_slo(spec: ModelConfig, batch: int, context: int, weights: str, kv: str, gpu_bytes: float,
                 rate_req_s: float, output_mean: float, tpot_s: float, headroom: float = 0.9,
                 gpus_per_node: int = 8) -> dict:
    """Solution: GPUs to serve ``rate_req_s`` by hand, from memory and Little's law.

    * KV bytes per token: K and V, every layer, every KV head (``2 x layers x kv_heads x head_dim x bytes``).
    * One replica holds all the weights (``num_params`` in ``weights``) and the KV of ``batch`` sequences of
      ``context`` tokens, split over ``tp`` GPUs: the smallest ``tp`` (a power of two that divides the query heads,
      at most ``gpus_per_node``, as the planner's) that brings it under ``headroom x gpu_bytes`` per GPU.
    * Requests in decode at once: ``rate x output_mean x tpot`` (Little's law); replicas: that over ``batch``,
      rounded up. GPUs: ``tp x replicas`` (``None`` everywhere when no ``tp`` fits)."""
    kv_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes(kv)
    need = spec.num_params * dtype_bytes(weights) + batch * context * kv_token
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpus_per_node and spec.num_heads % t == 0]
    tp = next((t for t in tps if need / t <= headroom * gpu_bytes), None)
    replicas = math.ceil(rate_req_s * output_mean * tpot_s / batch)
    return {"kv_bytes_per_token": kv_token, "mem_per_gpu": need / tp if tp else None, "tp": tp,
            "replicas": replicas if tp else None, "gpus": tp * replicas if tp else None}


def _slo_cases() -> list[Case]:
    h200, h100 = 141e9, 80e9
    rows = [("gpt3-175b", 32, 1682, "bf16", "int8", h200, 20.0, 111.76, 0.0687, 8, "the scenario, bf16 weights"),
            ("gpt3-175b", 64, 1682, "int8", "int8", h200, 20.0, 111.76, 0.0828, 8, "int8 weights, batch 64"),
            ("gpt3-175b", 32, 2048, "bf16", "bf16", h100, 5.0, 128, 0.05, 8, "H100s, bf16 KV: does it fit a node?"),
            (NEW_MODEL, 64, 8192, "bf16", "bf16", h100, 12.5, 300, 0.04, 8, "the 34B model: TP 3 would fit, "
                                                                              "but TP comes in powers of two"),
            (TIED, 128, 1000, "bf16", "fp8", 24e9, 40.0, 64, 0.02, 4, "a small model on 24 GB GPUs, 4 per node"),
            ("llama-3-70b", 8, 8192, "bf16", "bf16", h100, 0.7, 512, 0.03, 8, "70B, long contexts, light traffic"),
            ("gpt3-175b", 64, 2048, "int4", "fp8", h100, 3.0, 100, 0.1, 8, "int4 weights, fp8 KV on H100s")]
    return [Case(f"{get_config(s).name}: {label}; batch {b}, context {c}, weights {w}, KV {k}, {g / 1e9:.0f} GB GPUs, "
                 f"{r} req/s, {o} output tokens, TPOT {t * 1e3:.1f} ms, {n} GPUs per node",
                 (get_config(s), b, c, w, k, g, r, o, t, 0.9, n)) for s, b, c, w, k, g, r, o, t, n, label in rows]


def _slo_measure() -> list[Measurement]:
    from labkit.hardware import get_hardware
    from labkit.plan import SCENARIO_175B

    entry, rec, source = figure("plan.gpus_175b_bf16")
    best = data_of(rec, "notebook 08's plans")["by_weights"]["bf16"]
    sc = SCENARIO_175B
    traffic = sc.traffic()
    context = int(traffic.quantile("prompt", 0.9) + traffic.quantile("output", 0.9))
    args = (get_config(sc.model), best["max_batch"], context, "bf16", best["kv"], get_hardware(sc.gpu).mem_capacity,
            sc.rate_req_s, traffic.mean("output"), best["tpot_ms"] / 1e3, 0.9, sc.gpus_per_node)
    layout = f"{best['replicas']} x TP{best['tp']} x PP{best['pp']}"

    def explain_gpus(pred, meas):
        end = ("They agree." if pred == meas else "The difference is in the rounding of replicas, or a TP the "
               "planner preferred for speed over the smallest that fits.")
        return (f"the planner's {layout} came from a search over layouts, batches and replicas with calibrated step "
                f"times and a queueing model of prefill; given its batch, KV format and TPOT, the count follows from "
                f"memory (which TP fits) and Little's law (how many replicas keep {sc.rate_req_s:g} req/s in "
                f"decode). {end}")

    def explain_mem(pred, meas):
        return ("the planner counts the same weights and KV, plus the norms replicated on every GPU and the "
                "embedding and LM head as two vocabulary-parallel tables (GPT-3 ties them: one here); both hold "
                "the KV of the batch at the 90th-percentile prompt plus output")
    return [Measurement(f"GPUs for GPT-3 175B at {sc.rate_req_s:g} req/s, bf16 weights (batch {best['max_batch']}, "
                        f"KV {best['kv']}, TPOT {best['tpot_ms']:.1f} ms: the planner's best plan)", args,
                        entry["value"], "GPUs", source, 0.25, explain_gpus, pick=lambda obs: obs["gpus"],
                        measured_as="the planner"),
            Measurement("memory per GPU of that plan", args, best["mem_per_gpu_gb"], "GB", source, 0.1, explain_mem,
                        pick=lambda obs: obs["mem_per_gpu"] / 1e9 if obs.get("mem_per_gpu") else obs["mem_per_gpu"],
                        measured_as="the planner")]


register(Prediction(
    "08.gpus_175b", "the 175B plan's GPU count by hand: memory per GPU, TP, replicas, against the planner",
    gpus_for_slo, _slo_cases, lambda fn, c: fn(*c), measure=_slo_measure,
    hint="KV per token 2 x layers x kv_heads x head_dim x bytes (GPT-3: 4.5 MiB in bf16); weights num_params x "
         "bytes; tp: the first power of two dividing num_heads, up to gpus_per_node, with need / tp <= headroom x "
         "gpu_bytes; "
         "replicas = ceil(rate x output_mean x tpot / batch)"))
