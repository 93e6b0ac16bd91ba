"""Notebook 04 (quantisation): choose an int4 group size against error and bytes, and predict the decode speed-up of
int8 and int4 weights from bytes (then set it against the measured engine steps).

The format is labkit's (``labkit.quant.weight_only.quantize_int4``, ``labkit.kernels.quantized_matmul.packing.
dequantize_int4``): per group of ``group_size`` inputs of a row, ``w = (q - zero) * scale``, codes in [0, 15], a
scale and a zero-point per group; the learner may use those two functions (the decision is the exercise, not the
format).
"""

from __future__ import annotations

import math

import torch

from labkit.exercises.core import Case, Decision, Measurement, Prediction, diff, register
from labkit.exercises.measured import data_of, figure
from labkit.kernels.quantized_matmul.packing import dequantize_int4
from labkit.model import ModelConfig, get_config
from labkit.quant.weight_only import quantize_int4


def choose_group_size(weight: torch.Tensor, group_sizes: list[int], max_rel_err: float,
                      scale_bytes: int = 2) -> dict:
    """Solution: for each group size, the relative error ``||W - dequant(quant(W))|| / ||W||`` (Frobenius) of int4
    round-to-nearest and the bytes per weight (half a byte of code, plus a scale and a zero-point of
    ``scale_bytes`` each per group); the choice is the group size with the fewest bytes per weight whose error is
    at most ``max_rel_err`` (``None`` when none is)."""
    w = weight.float()
    table = {}
    for g in group_sizes:
        packed, scales, zeros = quantize_int4(w, g)
        err = float((dequantize_int4(packed, scales, zeros, g) - w).norm() / w.norm())
        table[g] = {"rel_err": err, "bytes_per_weight": 0.5 + 2 * scale_bytes / g}
    ok = [g for g in group_sizes if table[g]["rel_err"] <= max_rel_err]
    choice = min(ok, key=lambda g: table[g]["bytes_per_weight"]) if ok else None
    return {"table": table, "choice": choice}


def _weight(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if kind == "outlier columns":  # a few input features 30x larger, as LLM activations' outlier channels make
        cols = torch.randperm(k, generator=g)[: max(1, k // 64)]
        w[:, cols] *= 30
    elif kind == "heavy-tailed":  # most weights small, a few up to 5x: the group's range is set by the few
        w = w * (1 + 4 * torch.rand(n, k, generator=g) ** 8)
    elif kind == "row scales":  # rows of very different magnitude (per-channel scales differ by 100x)
        w = w * torch.logspace(-1, 1, n)[:, None]
    return w


def _group_cases() -> list[Case]:
    rows = [("gaussian", 48, 256, (16, 32, 64, 128, 256), (64, 128), 0),
            ("outlier columns", 33, 512, (32, 64, 128, 256, 512), (32, 64), 1),
            ("heavy-tailed", 17, 384, (32, 64, 128), (64, 128), 2),
            ("row scales", 20, 256, (8, 16, 32, 64, 128, 256), (128, 256), 3),
            ("outlier columns", 8, 1024, (64, 128, 256, 512, 1024), None, 4),
            ("gaussian", 5, 96, (32, 96), (32, 96), 5)]
    cases = []
    for kind, n, k, gs, between, seed in rows:
        w = _weight(kind, n, k, seed)
        errs = choose_group_size(w, list(gs), 1.0)["table"]
        if between is None:  # a bar no group size meets: the answer is None
            bar = 0.5 * min(e["rel_err"] for e in errs.values())
        else:  # halfway (geometrically) between two group sizes' errors: never on a boundary
            bar = math.sqrt(errs[between[0]]["rel_err"] * errs[between[1]]["rel_err"])
        cases.append(Case(f"{kind} weight [{n}, {k}], group sizes {list(gs)}, error bar {bar:.4f}", (kind, n, k, gs,
                                                                                                      seed, bar)))
    return cases


def _run_group(fn, data):
    kind, n, k, gs, seed, bar = data
    out = fn(_weight(kind, n, k, seed), list(gs), bar)
    if isinstance(out, dict) and isinstance(out.get("table"), dict):  # keys may come back as other int types
        out = {**out, "table": {int(g): v for g, v in out["table"].items()}}
    return out


register(Decision(
    "04.group_size", "choose the int4 group size: error against bytes per weight", choose_group_size,
    _group_cases, _run_group, lambda e, a: diff(e, a, rtol=1e-3),
    hint="error: Frobenius norm of (dequantised - original) over that of the original, per group size; bytes per "
         "weight 0.5 + 2 x scale_bytes / group; choose the fewest bytes among those under the bar, or None"))


def decode_step_bytes(spec: ModelConfig, method: str, context: int, group_size: int = 128,
                      scale_bytes: int = 2) -> float:
    """Bytes one batch-1 decode step reads: the decoder's linear layers in ``method`` (bf16, int8 per output channel,
    int4 per group), the LM head and the norms in bf16, the embedding not at all (one row), and the bf16 KV cache
    of ``context`` tokens."""
    bpw = {"bf16": 2.0, "int8": 1.0 + scale_bytes / spec.hidden_size, "int4": 0.5 + 2 * scale_bytes / group_size}
    if method not in bpw:
        raise ValueError(f"method={method!r} is unknown; allowed: {sorted(bpw)}")
    linear = spec.num_layers * (spec.attn_params_per_layer + spec.mlp_params_per_layer)
    bf16_rest = spec.vocab_size * spec.hidden_size + spec.num_layers * spec.norm_params_per_layer + spec.hidden_size
    return linear * bpw[method] + bf16_rest * 2 + spec.kv_bytes(context, "bf16")


def predict_decode_speedup(spec: ModelConfig, method: str, context: int, group_size: int = 128,
                           scale_bytes: int = 2) -> dict:
    """Solution: ``{"bf16_bytes", "bytes", "speedup"}`` of one batch-1 decode step with the linear layers in
    ``method``, if both steps ran at the same fraction of the memory bandwidth (``decode_step_bytes``)."""
    bf16 = decode_step_bytes(spec, "bf16", context, group_size, scale_bytes)
    mine = decode_step_bytes(spec, method, context, group_size, scale_bytes)
    return {"bf16_bytes": bf16, "bytes": mine, "speedup": bf16 / mine}


def _speedup_cases() -> list[Case]:
    odd = ModelConfig(name="odd (GQA 6:1, 13 layers, head_dim 96)", vocab_size=32003, hidden_size=1152, num_layers=13,
                      num_heads=12, num_kv_heads=2, head_dim=96, intermediate_size=3000)
    rows = [("llama-3-8b", "int8", 512, 128, 2), ("llama-3-8b", "int4", 512, 128, 2),
            ("llama-3-8b", "int4", 8192, 32, 2), (odd, "int8", 100, 128, 4), (odd, "int4", 3000, 64, 4),
            ("gpt3-175b", "int4", 2048, 128, 2), ("llama-2-7b", "bf16", 1, 128, 2)]
    return [Case(f"{get_config(s).name}: {m}, context {c}, group {g}, {b}-byte scales", (get_config(s), m, c, g, b))
            for s, m, c, g, b in rows]


def _speedup_measure() -> list[Measurement]:
    out = []
    for method in ("int8", "int4"):
        entry, rec, source = figure(f"quant.{method}_decode_speedup")
        data = data_of(rec, "notebook 04's decode timings")
        context = data["sizes"]["context"]
        steps = {("bf16" if r["method"] == "base" else r["method"]): r["decode step (ms)"] / 1e3
                 for r in data.get("trade_off", [])}
        spec = get_config("llama-3-8b")

        def explain(pred, meas, method=method, spec=spec, context=context, steps=steps):
            rates = ", ".join(f"{m} {decode_step_bytes(spec, m, context) / steps[m] / 1e12:.2f} TB/s"
                              for m in ("bf16", method) if steps.get(m))
            return (f"the prediction assumes both steps move their bytes equally fast; over the predicted bytes the "
                    f"measured steps reached {rates or 'rates not in this record'}: the {method} GEMV kernels "
                    f"dequantise in registers (instructions bf16 does not spend), and the step's fixed parts "
                    f"(attention, norms, the bf16 LM head, the graph's launches) do not shrink with the weights")
        out.append(Measurement(f"{method} decode speed-up over bf16 (llama-3-8b shape, batch 1, context {context})",
                               (spec, method, context, 128, 2), entry["value"], "x", source, 0.25, explain,
                               pick=lambda obs: obs["speedup"]))
    return out


register(Prediction(
    "04.decode_speedup", "predict int8 and int4 weights' batch-1 decode speed-up from the bytes a step reads",
    predict_decode_speedup, _speedup_cases, lambda fn, c: fn(*c), measure=_speedup_measure,
    hint="bytes per weight: bf16 2, int8 1 + scale/hidden, int4 0.5 + 2 x scale/group; only the decoder's "
         "linears change format; add the bf16 LM head (vocab x hidden), the norms and the bf16 KV cache of the "
         "context (spec.kv_bytes); the embedding is not read"))
