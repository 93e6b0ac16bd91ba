"""The capstone's spoken answer to the 175B question and its hints and follow-ups, rendered from figures.

The answer, in this order: the 175B arithmetic (weights per format, the multi-head KV cache per token and per
sequence, the narrowest TP group on an H100 and an H200), the diagnosis and what proves it, the tiered plan with one
measured number per tier, the communication tier and its mitigations, the planner's layout and why, and how each
change is verified in production. The tiers' numbers are measured on proxies, never on a 175B model: each group of
figures below (``GROUPS``) is read from one machine class, and a template names it with ``{label.group}``, rendered
as the proxy's size and machine ("8B proxy, H200"). ``proxy_labelled`` checks that every tier's number carries its
label. The 175B numbers are arithmetic or the planner's predictions (``plan.*`` figures: ``labkit.plan``).
"""

from __future__ import annotations

import re

from labkit.conditions import render
from labkit.data import machine_class
from labkit.figures import class_order, machine_figures, read_summary, summary_classes
from labkit.model import PRESETS, TINY

__all__ = ["ANSWER", "EMBEDDED_ONLY", "GROUPS", "HINTS", "TIERS", "answer", "by_class", "layout_figures", "proxy_label",
           "proxy_labelled", "render_paragraph", "templates"]

GROUPS = {
    "diagnosis": ("diagnose.decode_bs1_idle_frac", "baseline.hf_decode_bs1_mbu", "diagnose.decode_intensity",
                  "diagnose.ridge_flop_per_byte"),
    "scheduling": ("engine.speedup_vs_hf_compiled_b64",),
    "memory": ("kvcache.contiguous_waste_frac_workload_max", "kvcache.paged_waste_frac"),
    "compute": ("quant.int8_decode_speedup", "quant.int8_ppl_delta_frac"),
    "communication": ("parallel.pp_bubble_measured", "parallel.pp_bubble_formula"),
    "kernels": ("kernels.rmsnorm_speedup_vs_compile", "kernels.rmsnorm_bw_frac", "kernels.flash_attn_vs_cudnn",
                "kernels.paged_attn_bw_frac"),
    "kv_quant": ("kernels.int8_kv_bytes_ratio", "kvcache.int8_ppl_delta_frac", "kernels.int8_kv_attn_speedup"),
    "batching": ("baseline.fifo_ttft_p99_growth", "engine.continuous_vs_fifo_throughput",
                 "engine.continuous_vs_static_throughput"),
    "memory_model": ("finetune.memory_model_rel_err",),
    "pipeline": ("parallel.tp_logits_rel_err", "parallel.pp_logits_rel_err"),
    "kernels_q": ("quant.int4_labkit_gemm_speedup_b1", "quant.int4_labkit_gemm_speedup_b64",
                  "quant.int4_best_gemm_speedup_b64", "quant.int4_best_path_b64", "quant.fp8_best_gemm_speedup_b64",
                  "quant.fp8_best_path_b64", "quant.fp8_roofline_speedup_b64"),
    "precision": ("quant.fp16_overflow_cases", "quant.bf16_overflow_cases", "quant.overflow_cases",
                  "quant.bf16_accum_rel_err", "quant.bf16_fp32_accum_rel_err", "quant.accum_terms",
                  "quant.bf16_model_ppl_delta_frac", "quant.int8_ppl_delta_frac", "quant.fp8_ppl_delta_frac"),
}
"""Figures that make one measured number and must come from one machine class, by group."""

ANSWER = [
    ("arithmetic",
     "GPT-3 175B: {plan.gpt3_175b_weights_gb_bf16:.0f} GB of bf16 weights, "
     "{plan.gpt3_175b_weights_gb_int8:.0f} GB in fp8/int8, {plan.gpt3_175b_weights_gb_int4:.0f} GB in int4. Its "
     "multi-head attention ({plan.gpt3_175b_layers} layers, {plan.gpt3_175b_kv_heads} KV heads, d_model "
     "{plan.gpt3_175b_d_model}) costs 2·{plan.gpt3_175b_layers}·{plan.gpt3_175b_d_model}·2 B = "
     "{plan.gpt3_175b_kv_mib_per_token:.1f} MiB of KV per token, {plan.gpt3_175b_kv_gib_per_seq:.0f} GiB per "
     "{plan.gpt3_175b_seq_len}-token sequence. So bf16 needs TP{plan.gpt3_175b_min_tp_h100} on 80 GB H100s and "
     "TP{plan.gpt3_175b_min_tp_h200} on 141 GB H200s, leaving KV room for {plan.gpt3_175b_kv_seqs_h100} and "
     "{plan.gpt3_175b_kv_seqs_h200} such sequences."),
    ("diagnosis",
     "Diagnosis: small-batch decode reads every weight per token, {diagnose.decode_intensity:.1f} FLOP per byte "
     "against a ridge of {diagnose.ridge_flop_per_byte:.0f}. A profiler trace of one step proves it: the GPU idles "
     "{diagnose.decode_bs1_idle_frac:.0%} of the step at {baseline.hf_decode_bs1_mbu:.0%} of the bandwidth floor "
     "({label.diagnosis})."),
    ("plan",
     "Plan, cheapest first. Scheduling: continuous batching and CUDA graphs decode "
     "{engine.speedup_vs_hf_compiled_b64:.1f}x HF generate (static cache, torch.compile; {label.scheduling}), "
     "accuracy untouched. Memory: paged KV wastes {kvcache.paged_waste_frac:.1%} of its slots, workload-sized slabs "
     "{kvcache.contiguous_waste_frac_workload_max:.0%} ({label.memory}); int8 KV halves the rest. Compute: int8 "
     "weights decode at {quant.int8_decode_speedup:.2f}x bf16's speed for {quant.int8_ppl_delta_frac:.2%} perplexity "
     "({label.compute})."),
    ("communication",
     "Communication: TP only inside a node over NVLink, never across the network; PP across nodes with m ≥ 4p "
     "micro-batches (bubble {parallel.pp_bubble_measured:.2f}, formula {parallel.pp_bubble_formula:.2f}; "
     "{label.communication}); overlap all-reduces with compute; replicas instead of deeper TP; int8 transfers shrink "
     "only the bandwidth term."),
    ("layout",
     "Layout: {plan.gpt3_175b_replicas} replicas of TP{plan.gpt3_175b_tp}, {plan.gpt3_175b_weights} weights, "
     "{plan.gpt3_175b_kv} KV, at most {plan.gpt3_175b_max_batch} sequences each: {plan.gpt3_175b_gpus} H200s at a "
     "predicted {plan.gpt3_175b_tpot_ms:.0f} ms per token ({plan.gpt3_175b_caveat}), the fewest GPUs meeting p99 "
     "TTFT ≤ {plan.scenario_ttft_s:g} s and TPOT ≤ {plan.scenario_tpot_ms:.0f} ms. {plan.gpt3_175b_pp:if == 1 then "
     "A replica fits one node, so no PP else Its stages cross nodes}."),
    ("verification",
     "Verify each change under replayed peak traffic: busy fraction and tokens/s per GPU (scheduling), running "
     "batch and p99 TTFT (paging), p99 TPOT and MBU (kernels, quantisation), measured against predicted step time "
     "(layout; planner error {plan.step_time_mape:.0%} on single-GPU steps)."),
]
"""The two-minute answer: (part, template), in the order the question asks for."""

HINTS = {
    "Hint one: memory-bound against compute-bound": (
        "A decode step does {diagnose.decode_intensity:.1f} FLOP per byte it reads, far below the GPU's ridge of "
        "{diagnose.ridge_flop_per_byte:.0f} ({label.diagnosis}), so it runs at the speed of memory: the fused RMSNorm "
        "reaches {kernels.rmsnorm_bw_frac:.0%} of copy bandwidth and paged attention {kernels.paged_attn_bw_frac:.0%} "
        "({label.kernels}). Prefill does {diagnose.prefill_intensity:.0f} FLOP per byte and is bound by the tensor "
        "cores: there the platform's attention wins, labkit's flash attention running at "
        "{kernels.flash_attn_vs_cudnn:.2f}x the speed of SDPA's default cuDNN backend."),
    "Hint two: hardware-level kernels against KV quantisation": (
        "Custom kernels cut time without touching accuracy, but against the baseline a user would pick the margin is "
        "small: the fused RMSNorm runs {kernels.rmsnorm_speedup_vs_compile:.2f}x torch.compile's ({label.kernels}). "
        "KV quantisation is an algorithmic change: int8 KV holds {kernels.int8_kv_bytes_ratio:.2f} of the bytes for "
        "{kvcache.int8_ppl_delta_frac:.4%} perplexity, and its attention runs at {kernels.int8_kv_attn_speedup:.2f}x "
        "bf16's ({label.kv_quant}): its win is capacity, a larger batch, not a faster kernel."),
    "Hint three: continuous batching against FIFO": (
        "Under load FIFO's p99 time to first token grew {baseline.fifo_ttft_p99_growth:.1f}x from the lowest to the "
        "highest rate; continuous batching gave {engine.continuous_vs_fifo_throughput:.1f}x FIFO's throughput and "
        "{engine.continuous_vs_static_throughput:.1f}x static batching's ({label.batching}), because finished "
        "sequences leave and new ones join at every step."),
    "Follow-up one: fine-tuning instead of inference": (
        "Memory binds before bandwidth: full fine-tuning keeps weights, gradients and two Adam moments, "
        "{finetune.full_ft_state_bytes_per_param:.0f} bytes per parameter. Notebook 07's memory model at 175B puts "
        "full fine-tuning at {finetune.gpt3_full_ft_peak_gb:,.0f} GB on one device and QLoRA (NF4 base, rank-8 "
        "adapters) at {finetune.gpt3_qlora_peak_gb:.0f} GB, {finetune.gpt3_qlora_vs_full_frac:.1%} of it: one H200 "
        "holds it, where full fine-tuning needs ZeRO-3 over a cluster. The model predicts measured peaks within "
        "{finetune.memory_model_rel_err:.1%} ({label.memory_model}). Pipeline schedules (1F1B) matter more, CUDA "
        "graphs and KV paging less."),
    "Follow-up two: pipeline or tensor parallelism": (
        "Tensor parallelism splits every weight read, so it cuts the time per token, at two all-reduces per layer: "
        "inside a node only. Pipeline parallelism sends little but idles, a bubble of (p-1)/(m+p-1): it adds memory "
        "across nodes, not speed. Both reproduce the single-process logits (TP {parallel.tp_logits_rel_err:.0e}, PP "
        "{parallel.pp_logits_rel_err:.0e}; {label.pipeline}). For the 175B the planner picks "
        "{plan.gpt3_175b_replicas} replicas of TP{plan.gpt3_175b_tp} x PP{plan.gpt3_175b_pp}: "
        "{plan.gpt3_175b_pp:if == 1 then a replica fits one node, so no stage crosses the network else its stages "
        "cross nodes, where only activations travel}."),
    "Follow-up three: FP32, BF16, INT8": (
        "Throughput: fewer bytes per weight make bandwidth-bound decode faster and need fewer GPUs. Stability: bf16 "
        "keeps fp32's exponent, so of notebook 04's {quant.overflow_cases} transformer computations fp16 overflows "
        "in {quant.fp16_overflow_cases} and bf16 in {quant.bf16_overflow_cases}; its 7-bit mantissa loses long sums "
        "instead: a bf16 running sum of {quant.accum_terms} terms is off by {quant.bf16_accum_rel_err:.0%}, by "
        "{quant.bf16_fp32_accum_rel_err:.0e} when accumulated in fp32, as tensor cores and every kernel do. The model "
        "in bf16 moves perplexity {quant.bf16_model_ppl_delta_frac:.3%}. INT8 weights with per-channel scales move "
        "it {quant.int8_ppl_delta_frac:.3%}; quantising activations too (FP8 W8A8) {quant.fp8_ppl_delta_frac:.2%}, "
        "since activations carry the outliers LLM.int8 keeps in fp16 ({label.precision}). FP32 stays the "
        "reference. The throughput of a format is its kernel's: at sixty-four rows the fastest FP8 kernel measured "
        "({quant.fp8_best_path_b64}) runs {quant.fp8_best_gemm_speedup_b64:.2f}x bf16's linears ({label.kernels_q}), "
        "so the planner's FP8 plan needs {plan.gpus_175b_fp8:if <= plan.gpus_175b_bf16 then no more else more} GPUs "
        "than bf16 ({plan.gpus_175b_fp8} against {plan.gpus_175b_bf16}); a faster kernel would change that count, "
        "not the perplexity."),
}
"""The scenario's three hints and three follow-ups, answered from the figures."""


def templates() -> dict[str, str]:
    """Every template of the answer, hints, follow-ups and the kernels paragraph, by name (for checks over the
    prose)."""
    from labkit.experiments.capstone.kernels import KERNELS

    return {**{f"answer/{part}": text for part, text in ANSWER}, **HINTS, "kernels": KERNELS}


EMBEDDED_ONLY = ("communication", "pipeline", "memory_model")
"""Groups measured on the embedded model whatever the machine (gloo ranks; notebook 07's training steps)."""


def proxy_label(cls: str, group: str | None = None) -> str:
    """How a number of ``group`` measured on machine class ``cls`` is labelled: the proxy model's size (the
    Llama-3-8B shape on a GPU, the embedded model on the CPU and for ``EMBEDDED_ONLY`` groups) and the machine."""
    small = cls == "cpu" or group in EMBEDDED_ONLY
    size = f"{TINY.num_params / 1e6:.0f}M" if small else f"{PRESETS['llama-3-8b'].num_params / 1e9:.0f}B"
    machine = "CPU" if cls == "cpu" else "+".join(p.upper() for p in cls.split("+"))
    return f"{size} proxy, {machine}"


def by_class(summary: dict | None = None, extra: dict | None = None) -> dict[str, dict]:
    """The figures of each machine class: the committed summary's, with ``extra`` (this run's entries, as
    ``record_figure`` returns them) on top under their own machine's class."""
    summary = read_summary() if summary is None else summary
    out = {c: machine_figures(summary, c) for c in summary_classes(summary)}
    for name, e in (extra or {}).items():
        out.setdefault(machine_class(e["machine"]), {})[name] = e
    return out


def _pick(names: tuple[str, ...], classes: dict[str, dict]) -> str | None:
    order = [c for c in ("h200", "h100") if c in classes] + [c for c in class_order(classes) if c not in
                                                            ("h200", "h100")]
    return next((c for c in order if all(n in classes[c] for n in names)), None)


def _value(e):
    v = e["value"] if isinstance(e, dict) else e
    return float(v) if isinstance(v, str) and v.lower() in ("nan", "inf") else v


def render_paragraph(template: str, classes: dict[str, dict], flat: dict) -> tuple[str, list[dict]]:
    """``template`` rendered (``labkit.conditions.render``: formats, and words picked from the data): each
    ``{label.group}`` names the machine class that holds all of the group's figures (a GPU first), whose values the
    group's fields then take; every other field takes ``flat``'s value. Returns the text and one evidence row per
    group (group, class, label, figures)."""
    values = {n: _value(e) for n, e in flat.items()}
    labels, evidence = {}, []
    for g in dict.fromkeys(re.findall(r"\{label\.(\w+)\}", template)):
        if g not in GROUPS:
            raise KeyError(f"label.{g}: no such group; known: {sorted(GROUPS)}")
        cls = _pick(GROUPS[g], classes)
        if cls is None:
            raise KeyError(f"no machine holds all of group {g!r}: {', '.join(GROUPS[g])}")
        values.update({n: _value(classes[cls][n]) for n in GROUPS[g]})
        labels[g] = proxy_label(cls, g)
        evidence.append({"group": g, "class": cls, "label": labels[g], "figures": list(GROUPS[g])})
    values.update({f"label.{g}": v for g, v in labels.items()})
    return render(template, values), evidence


def answer(classes: dict[str, dict], flat: dict) -> tuple[str, list[dict]]:
    """The answer (``ANSWER``'s paragraphs, rendered) and its evidence rows."""
    parts, evidence = [], []
    for _, template in ANSWER:
        text, ev = render_paragraph(template, classes, flat)
        parts.append(text)
        evidence += ev
    return "\n\n".join(parts), evidence


TIERS = ("scheduling", "memory", "compute", "communication")
"""The plan's tiers: each gives one measured number, which must carry its proxy label."""
_LABEL = re.compile(r"\d+[MB] proxy, [A-Z0-9+]+")


def proxy_labelled(text: str, evidence: list[dict]) -> bool:
    """Whether every tier of the plan (``TIERS``) and the diagnosis quote a measured number with its label, and
    every label names a proxy's size and a machine, in ``text``."""
    groups = {e["group"]: e for e in evidence}
    needed = ("diagnosis", *TIERS)
    return all(g in groups and groups[g]["label"] in text and _LABEL.fullmatch(groups[g]["label"]) for g in needed)


def layout_figures(plan, scenario) -> list[tuple]:
    """``(name, value, unit, note)`` of the planner's best plan read in words, not as its layout string: replicas,
    TP, PP, formats, batch, GPUs, whether a multi-GPU record validates it; and the objective it meets."""
    if plan is None:
        raise ValueError("no plan meets the scenario's objective: there is no layout to describe")
    caveat = "validated on multi-GPU" if plan.validated else "; ".join(plan.notes)
    return [("plan.gpt3_175b_replicas", plan.replicas, "replicas", "the planner's best plan"),
            ("plan.gpt3_175b_tp", plan.tp, "GPUs", "tensor-parallel degree of a replica"),
            ("plan.gpt3_175b_pp", plan.pp, "stages", "pipeline stages of a replica"),
            ("plan.gpt3_175b_weights", plan.weights, "format", "weight format"),
            ("plan.gpt3_175b_kv", plan.kv, "format", "KV-cache format"),
            ("plan.gpt3_175b_max_batch", plan.max_batch, "sequences", "largest batch per replica"),
            ("plan.gpt3_175b_gpus", plan.gpus, "GPUs", "replicas x TP x PP"),
            ("plan.gpt3_175b_caveat", caveat, "", "whether a multi-GPU record checks the prediction"),
            ("plan.scenario_ttft_s", scenario.ttft_s, "s", "the objective: p99 time to first token"),
            ("plan.scenario_tpot_ms", scenario.tpot_s * 1e3, "ms", "the objective: time per output token")]
