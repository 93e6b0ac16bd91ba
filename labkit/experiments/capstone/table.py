"""Notebook 08's technique table and the figures it reads.

``TECHNIQUES`` is the technique x trade-off table as data: one row per technique, each cell a list of figure
names (accuracy, latency, throughput, memory) plus when to use it and when not; a later technique adds one row.
Each latency and throughput cell names the headline figure of its technique (``labkit.headlines``: the strongest
baseline measured). ``derived_figures`` reads figures that committed GPU records hold but the summary does not (each
with its record and machine). ``fill_template`` fills a template's ``{area.figure:fmt}`` fields from the figures, so
prose carries no typed number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from labkit.data import REPO_ROOT

COLUMNS = ("accuracy", "latency", "throughput", "memory")
"""The trade-off columns of the technique table."""

TECHNIQUES = [
    dict(technique="paged KV cache", tier="memory", accuracy=["engine.greedy_matches_hf"],
         latency=["kvcache.paged_speedup_vs_workload_max", "kernels.paged_attn_bw_frac"],
         throughput=["kvcache.max_seqs_ratio_vs_workload_max"],
         memory=["kvcache.paged_waste_frac", "kvcache.contiguous_waste_frac_workload_max"],
         use="always for serving: memory is reserved per block as sequences grow",
         avoid="fixed-length offline batches, where a contiguous cache wastes nothing"),
    dict(technique="prefix caching", tier="memory", accuracy=["kvcache.prefix_outputs_identical"],
         latency=["kvcache.prefix_ttft_speedup"], throughput=["kvcache.prefix_prefill_saved_frac"],
         memory=["kvcache.prefix_saving_frac"],
         use="shared system prompts, few-shot templates, multi-turn chat",
         avoid="unique prompts: the hash table costs lookups and pins blocks for nothing"),
    dict(technique="KV cache int8 / fp8", tier="memory",
         accuracy=["kvcache.int8_ppl_delta_frac", "kvcache.fp8_ppl_delta_frac"],
         latency=["kernels.int8_kv_attn_speedup"], throughput=["plan.gpus_175b_kv_int8", "plan.gpus_175b_kv_bf16"],
         memory=["kernels.int8_kv_bytes_ratio"],
         use="long contexts and large batches, where the KV cache bounds the batch",
         avoid="short contexts where weights dominate memory; attention kernels without in-kernel dequantisation"),
    dict(technique="fused kernels (RMSNorm, SwiGLU, RoPE)", tier="computation",
         accuracy=["kernels.patched_logits_rel_err"],
         latency=["kernels.rmsnorm_speedup_vs_compile", "kernels.patched_step_speedup"],
         throughput=["kernels.rmsnorm_bw_frac", "kernels.swiglu_bw_frac"], memory=["kernels.fused_peak_memory_ratio"],
         use="memory-bound elementwise chains run eagerly: each fusion removes a read and a write",
         avoid="when a compiler (torch.compile, TensorRT) already fuses them"),
    dict(technique="flash and paged attention", tier="computation", accuracy=["kernels.flash_attn_rel_err"],
         latency=["kernels.flash_attn_vs_cudnn"], throughput=["kernels.paged_attn_bw_frac"],
         memory=["kvcache.paged_waste_frac"],
         use="prefill (flash: no score matrix in memory) and decode over a paged cache",
         avoid="when the platform's fused attention (cuDNN) is already faster at the shape"),
    dict(technique="weights int8", tier="computation", accuracy=["quant.int8_ppl_delta_frac"],
         latency=["quant.int8_decode_speedup", "quant.int8_decode_speedup_b16", "quant.int8_decode_speedup_b64",
                  "quant.int8_best_gemm_speedup_b64", "quant.int8_best_path_b64"],
         throughput=["plan.gpus_175b_int8", "plan.gpus_175b_bf16", "plan.kernel_175b_int8",
                     "plan.gpus_175b_int8_labkit"],
         memory=["quant.int8_weight_bytes_ratio"],
         use="small-batch decode (bandwidth-bound): half the bytes per step; at serving batches with the kernel "
             "measured fastest there",
         avoid="large batches on a dequantising kernel slower than bf16 GEMM"),
    dict(technique="weights int4 (GPTQ)", tier="computation", accuracy=["quant.int4_calibrated_ppl_delta_frac"],
         latency=["quant.int4_decode_speedup", "quant.int4_decode_speedup_b16", "quant.int4_decode_speedup_b64",
                  "quant.int4_best_gemm_speedup_b64", "quant.int4_best_path_b64"],
         throughput=["plan.gpus_175b_int4", "plan.gpus_175b_bf16", "plan.kernel_175b_int4",
                     "plan.gpus_175b_int4_labkit"],
         memory=["quant.int4_weight_bytes_ratio"],
         use="latency at batch one and fitting a model on fewer GPUs; serving batches need a W4A16 GEMM built for "
             "them",
         avoid="accuracy-critical tasks without an evaluation; large batches on the dequantising path"),
    dict(technique="weights FP8", tier="computation", accuracy=["quant.fp8_ppl_delta_frac"],
         latency=["quant.fp8_decode_speedup", "quant.fp8_decode_speedup_b16", "quant.fp8_decode_speedup_b64",
                  "quant.fp8_best_gemm_speedup_b64", "quant.fp8_best_path_b64"],
         throughput=["plan.gpus_175b_fp8", "plan.gpus_175b_bf16", "plan.kernel_175b_fp8", "plan.gpus_175b_fp8_labkit"],
         memory=["quant.fp8_weight_bytes_ratio"],
         use="compute-bound prefill and large batches on FP8 tensor cores, the activation quantisation fused",
         avoid="batch-one decode where activation quantisation kernels dominate the step"),
    dict(technique="continuous batching, chunked prefill", tier="scheduling", accuracy=["engine.greedy_matches_hf"],
         latency=["baseline.fifo_ttft_p99_growth"],
         throughput=["engine.continuous_vs_static_throughput", "engine.continuous_vs_fifo_throughput"],
         memory=["engine.continuous_peak_kv_used_frac"],
         use="online traffic with varied output lengths",
         avoid="one fixed-size offline batch, where static batching is as good and simpler"),
    dict(technique="CUDA graphs", tier="computation", accuracy=["engine.greedy_matches_hf"],
         latency=["diagnose.decode_bs1_idle_frac", "engine.decode_bs1_mbu"],
         throughput=["engine.offline_speedup_vs_hf", "engine.speedup_vs_hf_compiled_b64"],
         memory=["engine.cuda_graph_pool_mb", "engine.cuda_graph_pool_mb_b64"],
         use="decode steps of many short kernels (launch-bound)",
         avoid="shapes that change every step (capture per bucket), or long compute-bound kernels"),
    dict(technique="tensor parallelism", tier="communication", accuracy=["parallel.tp_logits_rel_err"],
         latency=["plan.gpt3_175b_tpot_ms"], throughput=["plan.gpt3_175b_capacity_req_s"],
         memory=["plan.gpt3_175b_mem_per_gpu_gb"],
         use="inside a node (NVLink) when one GPU cannot hold or read the weights fast enough",
         avoid="across nodes: two all-reduces per layer over InfiniBand dominate the step"),
    dict(technique="pipeline parallelism", tier="communication", accuracy=["parallel.pp_logits_rel_err"],
         latency=["parallel.pp_bubble_measured", "parallel.pp_bubble_formula"],
         throughput=["parallel.pp_microbatch_throughput_gain"], memory=["parallel.pp_max_stage_weight_frac"],
         use="across nodes, when the model or its KV cache outgrows one node",
         avoid="to cut latency: a token still passes every stage, and few micro-batches leave a bubble"),
    dict(technique="speculative decoding", tier="computation", accuracy=["spec.greedy_matches_plain"],
         latency=["spec.measured_speedup_b1", "spec.predicted_speedup"],
         throughput=["spec.stop_paying_batch", "spec.verify_cost_ratio_k4"],
         memory=["spec.draft_weight_mb"],
         use="latency-bound decode at small batch with a draft that agrees often (alpha high, draft cheap)",
         avoid="large batches, where decode is no longer bandwidth-bound and rejected guesses cost real compute"),
]


def _cell(names: list[str], figures: dict) -> tuple[str, list[dict]]:
    shown, links = [], []
    for n in names:
        e = figures.get(n)
        if e is None:
            continue
        v = e["value"]
        text = f"{v:.3g}" if isinstance(v, float) else str(v)
        shown.append(f"{n} = {text} {e.get('unit', '')}".strip())
        links.append({"figure": n, "machine": e["machine"], "record": e["record"]})
    return "; ".join(shown), links


def technique_table(figures: dict, rows: list[dict] | None = None) -> tuple[list[dict], int, list[str]]:
    """(rows of the table, number of empty cells, why each is empty). A cell is empty when none of its figures
    is in ``figures`` (including a cell that names none)."""
    out, empty, why = [], 0, []
    for r in TECHNIQUES if rows is None else rows:
        row = {"technique": r["technique"], "tier": r["tier"]}
        for c in COLUMNS:
            text, links = _cell(r[c], figures)
            row[c] = text
            row[f"{c}_records"] = sorted({f"{x['record']} ({x['machine']})" for x in links})
            if not links:
                empty += 1
                why.append(f"{r['technique']} / {c}: " + ("no figure measures it yet" if not r[c] else
                                                         f"{', '.join(r[c])} not in the summary"))
        row["use"], row["avoid"] = r["use"], r["avoid"]
        out.append(row)
    return out, empty, why


def namespace(figures: dict) -> dict:
    """``{'area': SimpleNamespace(figure=value)}`` for ``str.format_map``."""
    areas: dict[str, dict] = {}
    for name, e in figures.items():
        v = e["value"] if isinstance(e, dict) else e
        v = float(v) if isinstance(v, str) and v.lower() in ("nan", "inf") else v
        area, _, rest = name.partition(".")
        areas.setdefault(area, {})[rest] = v
    return {a: SimpleNamespace(**kv) for a, kv in areas.items()}


def fill_template(template: str, figures: dict) -> str:
    """``template`` with every ``{area.figure:fmt}`` field filled from ``figures``."""
    return template.format_map(namespace(figures))


def _read(rel: str) -> tuple[dict | None, str]:
    path = REPO_ROOT / rel
    return (json.loads(path.read_text()) if path.exists() else None), rel


def derived_figures(summary: dict | None = None) -> list[dict]:
    """Figures that committed GPU records hold but ``results/summary.json`` does not: ``{name, value, unit,
    machine, source, note}`` each, and ``derived: True`` for arithmetic rather than a measurement (recorded by
    notebook 08 with the source record's machine). A figure the summary already holds for that machine from another
    record (its own notebook measured it since) is left out."""
    from labkit.data import machine_class
    from labkit.figures import read_summary

    out = []
    k, rel = _read("results/h200/records/03_kernels.json")
    if k is not None:
        from labkit.experiments.kernels.bench import headline_figures

        dev = k["env"].get("device", "?")
        heads = headline_figures(k["data"]["rows"], "gpu")
        for name in ("kernels.rmsnorm_speedup_vs_compile", "kernels.flash_attn_vs_cudnn"):
            if heads.get(name) == heads.get(name):  # NaN where the record lacks the baseline's row
                out.append(dict(name=name, value=heads[name], unit="x", machine=dev, source=rel,
                                note="labkit.headlines: over the strongest baseline the record measured"))
        att = {r["attention"]: r for r in k["data"].get("kv_quant_attention", [])}
        bf, i8 = att.get("bf16 cache"), att.get("int8 cache, dequantised in the kernel")
        if bf and i8:
            out.append(dict(name="kernels.int8_kv_attn_speedup", value=bf["us"] / i8["us"], unit="x over bf16 KV",
                            machine=dev, source=rel, note="paged decode attention, int8 KV dequantised in the kernel"))
            out.append(dict(name="kernels.int8_kv_bytes_ratio", value=i8["cache MB read"] / bf["cache MB read"],
                            unit="ratio", machine=dev, source=rel, note="KV bytes read, int8 (with scales) / bf16",
                            derived=True))
        flash = [r["rel_err"] for r in k["data"].get("rows", []) if r["kernel"] == "flash" and r["impl"] == "triton"
                 and r.get("rel_err") is not None]
        if flash:
            out.append(dict(name="kernels.flash_attn_rel_err", value=max(flash), unit="relative", machine=dev,
                            source=rel, note="labkit flash attention vs reference, bf16, worst of the sweep"))
        if "patched_logits_rel_err" in k["data"]:
            out.append(dict(name="kernels.patched_logits_rel_err", value=k["data"]["patched_logits_rel_err"],
                            unit="relative", machine=dev, source=rel, note="model with labkit kernels vs without"))
    q, rel = _read("results/h200/records/04_quantization.json")
    if q is not None:
        dev = q["env"].get("device", "?")
        rows = {r["method"]: r for r in q["data"].get("trade_off", [])}
        if "fp8" in rows:
            out.append(dict(name="quant.fp8_decode_speedup", value=rows["fp8"]["speed-up"], unit="x over bf16",
                            machine=dev, source=rel, note="engine decode step, batch 1, torch._scaled_mm W8A8"))
        speed = [r for r in q["data"].get("speed", []) if r["method"] == "fp8"]
        if speed:
            out.append(dict(name="quant.fp8_weight_bytes_ratio", value=speed[0]["weight_bytes_ratio"], unit="ratio",
                            machine=dev, source=rel, note="FP8 weights and scales / bf16"))
            kps = speed[-1].get("breakdown", {}).get("kernels_per_step")
            if kps:
                out.append(dict(name="quant.fp8_kernels_per_step", value=kps, unit="kernels", machine=dev,
                                source=rel, note="FP8 decode step: per-token activation quantisation kernels"))
        from labkit.experiments.quantization.precision import precision_figures

        ppl = [{"dtype": r["dtype"], "ppl change": r["ppl change"]} for r in q["data"].get("dtype_perplexity", [])]
        for name, value in precision_figures(q["data"].get("overflow", []), q["data"].get("accumulation", []),
                                             ppl).items():
            unit = "cases" if name.endswith("_cases") else "terms" if name.endswith("_terms") else "relative"
            out.append(dict(name=name, value=value, unit=unit, machine=dev, source=rel,
                            derived=name in ("quant.overflow_cases", "quant.accum_terms"),
                            note="notebook 04's precision section: overflow cases, running sums, the model per dtype"))
    out += _format_gemm_figures()
    summary = read_summary() if summary is None else summary
    held = {(n, c): e.get("record", "") for n, f in summary["figures"].items() for c, e in f["machines"].items()}
    return [d for d in out if not (isinstance(d["value"], float) and math.isnan(d["value"]))
            and "08_capstone" in held.get((d["name"], machine_class(d["machine"])), "08_capstone")]


def _format_gemm_figures() -> list[dict]:
    """Notebook 04's kernel figures (``format_gemm.gemm_figures``) of each GPU's committed per-format GEMM record
    (``results/<gpu>/records/format_gemm.json``), each under the machine that measured it."""
    from labkit.experiments.quantization.format_gemm import gemm_figures

    out = []
    for path in sorted((REPO_ROOT / "results").glob("*/records/format_gemm.json")):
        rel = str(path.relative_to(REPO_ROOT))
        rec, _ = _read(rel)
        dev = rec["env"].get("device", "?") if rec else "?"
        if rec is None or dev == "cpu":
            continue
        for f in gemm_figures(rec["data"], dev):
            out.append(dict(name=f["name"], value=f["value"], unit=f["unit"], machine=dev, source=rel,
                            note=f["note"], derived=f["derived"]))
    return out


def word_count(text: str) -> int:
    return len(text.split())


def markdown_digits(source: Path | str) -> list[str]:
    """Markdown lines of a notebook source (``# %% [markdown]`` cells) holding a digit, other than its title line
    (the notebook's number): a capstone whose prose must be rendered from figures has none."""
    bad, in_md = [], False
    for line in Path(source).read_text().splitlines():
        if line.startswith("# %%"):
            in_md = "[markdown]" in line
            continue
        if in_md and line.startswith("# # "):
            continue
        if in_md and any(ch.isdigit() for ch in line):
            bad.append(line)
    return bad
