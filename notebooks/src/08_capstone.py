# %% [markdown]
# # 08 · Capstone: the answer to the 175B question, rebuilt from the records
#
# **The question.** A transformer of a hundred and seventy-five billion parameters is served on a GPU cluster with
# high latency and low utilisation at peak traffic. How do we diagnose it, which optimisations do we apply in which
# order (memory, computation, communication), what does each trade in accuracy, latency and memory, and how do we
# prove each one worked?
#
# Everything below is rendered from `results/summary.json` and the committed records at every run: this notebook
# measures nothing itself, and its prose holds no typed number (a test checks the markdown for digits).

# %% tags=["parameters"]
profile = "auto"

# %%
import json

import pandas as pd
from IPython.display import Markdown, display

import labkit  # noqa: F401
from labkit.bench import output_dir, record_figure, write_record
from labkit.claims import Claim, show
from labkit.experiments import capstone as cap
from labkit.plan import SCENARIO_175B, load_summary, recommend, validate, weight_paths
from labkit.plan import mape as plan_mape
from labkit.plan import load_sweep
from labkit.models import get_spec
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
figures = dict(load_summary())
derived = cap.derived_figures()
fresh = output_dir() / "records" / "format_gemm.json"  # measured by notebook 06 in this run (gpu profile)
if PROFILE == "gpu" and not fresh.exists():  # each weight format's matmul paths, ours and cuBLAS, by batch
    from labkit.experiments.parallelism import formats

    write_record("format_gemm", formats.measure())
format_gemm = json.loads(fresh.read_text())["data"] if fresh.exists() else None
rec = recommend(SCENARIO_175B, format_gemm=format_gemm)
sweep = load_sweep()
print(f"{len(figures)} committed figures, {len(derived)} derived from GPU records; profile {PROFILE}; "
      f"calibrated on {rec.cal.machine}")

# %% [markdown]
# ## The planner's recommendation and what calibrates it
# The planner (`labkit.plan`) is fitted to the engine's measured steps and, per weight and KV format, takes the
# fastest kernel path measured for that format at the batch it plans for. Notebook six quotes the same
# `recommend` on the same scenario.

# %%
spec = get_spec(SCENARIO_175B.model)
best = rec.best
mb = best.max_batch if best else max(SCENARIO_175B.batches)
ctx = int(rec.scenario.traffic().mean("prompt") + rec.scenario.traffic().mean("output") / 2)
paths = []
for w in ("bf16", "fp8", "int8", "int4"):
    p = rec.by_weights.get(w)
    b = p.max_batch if p else mb
    for name, s in weight_paths(spec, rec.scenario.cluster(rec.gpu), rec.cal, p.tp if p else 8, 1, b, ctx, w).items():
        paths.append({"weights": w, "planned batch": b, "path": name, "weight read per step (ms)": s * 1e3})
paths = pd.DataFrame(paths)
paths["chosen"] = paths.groupby("weights")["weight read per step (ms)"].transform("min") == \
    paths["weight read per step (ms)"]
display(paths.round(3))
display(pd.DataFrame([k.__dict__ for k in (*rec.cal.kernels, *rec.cal.kv_paths)]).round(3))
fmt = pd.DataFrame([{"weights": w, "GPUs": p.gpus, "layout": p.layout, "TPOT (ms)": p.tpot_ms,
                     "p99 TTFT (ms)": p.ttft_p99_ms} for w, p in rec.by_weights.items()])
display(fmt.round(1))
steps = [r for r in sweep["data"]["rows"] if r["phase"] == "decode" and r["context"] == 512] if sweep else []
display(pd.DataFrame([{"weights": r["weights"], "batch": r["batch"], "engine step (ms)": r["median_s"] * 1e3}
                      for r in steps]).pivot(index="batch", columns="weights").round(2) if steps else "no sweep")

# %%
out = write_record("08_capstone", {"derived": derived, "plans": [p.to_dict() for p in rec.plans[:50]],
                                   "by_weights": {w: p.to_dict() for w, p in rec.by_weights.items()},
                                   "by_kv": {k: p.to_dict() for k, p in rec.by_kv.items()},
                                   "kernel_paths": paths.to_dict("records"), "calibration": rec.cal.source})
new = {}
for d in derived:
    new[d["name"]] = record_figure(d["name"], d["value"], d["unit"], out, machine=d["machine"],
                                   note=f"{d['note']}; from {d['source']}", derived=d.get("derived", False))
m = rec.cal.machine
note = f"{SCENARIO_175B.rate_req_s} req/s, p99 TTFT <= {SCENARIO_175B.ttft_s} s, TPOT <= {SCENARIO_175B.tpot_s} s"
new["plan.gpt3_175b_layout"] = record_figure("plan.gpt3_175b_layout", rec.layout, "layout", out, machine=m, note=note)
new["plan.gpt3_175b_plan"] = record_figure("plan.gpt3_175b_plan", rec.layout, "layout", out, machine=m, note=note)
for w in ("bf16", "fp8", "int8", "int4"):
    new[f"plan.gpus_175b_{w}"] = record_figure(f"plan.gpus_175b_{w}", rec.gpus(w), "GPUs", out, machine=m,
                                               note=f"fewest GPUs meeting the SLO with {w} weights; {note}")
for k in ("bf16", "int8"):
    p = rec.by_kv.get(k)
    new[f"plan.gpus_175b_kv_{k}"] = record_figure(f"plan.gpus_175b_kv_{k}", p.gpus if p else None, "GPUs", out,
                                                  machine=m, note=f"fewest GPUs meeting the SLO with {k} KV")
if best:
    for name, v, unit in (("tpot_ms", best.tpot_ms, "ms"), ("capacity_req_s", best.capacity_req_s, "req/s"),
                          ("mem_per_gpu_gb", best.mem_per_gpu_gb, "GB")):
        new[f"plan.gpt3_175b_{name}"] = record_figure(f"plan.gpt3_175b_{name}", v, unit, out, machine=m, note=note)
if sweep is not None:
    held = validate(sweep, rec.cal, rec.gpu, held_out=True)
    new["plan.step_time_mape"] = record_figure("plan.step_time_mape", plan_mape(held), "fraction", out, machine=m,
                                               bar="<= 0.15 (goal 0.08)",
                                               note=f"leave-one-out over {len(held)} steps of {rec.cal.source}")
figures.update(new)

# %% [markdown]
# ## The spoken answer (two minutes)

# %%
ANSWER = (
    "First I would measure, not guess. A profile of one decode step showed the GPU idle for "
    "{diagnose.decode_bs1_idle_frac:.0%} of the time and plain Hugging Face decoding at {baseline.hf_decode_bs1_mbu:.0%} "
    "of the bandwidth floor: decode reads every weight per token ({diagnose.decode_intensity:.0f} FLOP per byte), "
    "so it is memory-bound, while prefill ({diagnose.prefill_intensity:.0f} FLOP per byte) is compute-bound. "
    "Second, scheduling and launch overhead, free of accuracy cost: continuous batching with chunked prefill gave "
    "{engine.continuous_vs_static_throughput:.1f}x the throughput of static batching, and CUDA graphs with fused "
    "kernels took batch-one decode to {engine.decode_bs1_mbu:.0%} of the bandwidth floor. "
    "Third, memory: a paged KV cache wastes {kvcache.paged_waste_frac:.1%} of its slots, against "
    "{kvcache.contiguous_waste_frac:.0%} for a cache reserved at the maximum length, and int8 KV costs "
    "{kvcache.int8_ppl_delta_frac:.3%} perplexity; the batch is what turns bandwidth into throughput. "
    "Fourth, weights: int8 costs {quant.int8_ppl_delta_frac:.2%} perplexity and decodes {quant.int8_decode_speedup:.2f}x "
    "faster at batch one, calibrated int4 {quant.int4_calibrated_ppl_delta_frac:.1%} and {quant.int4_decode_speedup:.2f}x; "
    "{weights_clause} "
    "Fifth, layout: for the hundred-and-seventy-five-billion model it recommends {plan.gpt3_175b_layout}, tensor "
    "parallel inside a node where NVLink is fast, replicas for throughput, pipeline stages only if it must span nodes: "
    "{plan.gpus_175b_bf16} GPUs at a predicted {plan.gpt3_175b_tpot_ms:.0f} ms per token. "
    "To verify each step in production I track p99 time to first token, time per output token, tokens per second and "
    "GPU busy time against offered load, and the planner's predicted step time against the measured one; "
    "its leave-one-out error is {plan.step_time_mape:.1%}."
)
g = {w: figures[f"plan.gpus_175b_{w}"]["value"] for w in ("bf16", "int8", "int4")}
slower = [w for w in ("int8", "int4") if g[w] is None or (g["bf16"] is not None and g[w] > g["bf16"])]
weights_clause = (f"but at the planned batch the measured {' and '.join(slower)} kernels are slower than bf16 GEMM, "
                  f"so those formats need more GPUs than bf16." if slower else
                  "and at the planned batch they also need no more GPUs than bf16.")
answer = cap.render(ANSWER.replace("{weights_clause}", weights_clause), figures)
assert cap.word_count(answer) <= 300, cap.word_count(answer)
display(Markdown(answer))
print(f"{cap.word_count(answer)} words")

# %% [markdown]
# ## The tiered plan: memory, computation, communication, and the table of techniques
# Each row is a technique; each cell lists the figures that measure it, with their record and machine. A cell with
# no figure is counted as empty and the reason is printed.

# %%
table, empty, why = cap.technique_table(figures)
tdf = pd.DataFrame(table)
for tier in ("memory", "scheduling", "computation", "communication"):
    display(Markdown(f"**{tier}**"))
    display(tdf[tdf.tier == tier][["technique", *cap.COLUMNS, "use", "avoid"]])
print(f"{len(table)} techniques, {empty} empty cells:")
for w in why:
    print(" ", w)
new["capstone.technique_rows"] = record_figure("capstone.technique_rows", len(table), "rows", out, derived=True)
new["capstone.empty_cells"] = record_figure("capstone.empty_cells", empty, "cells", out, bar="== 0",
                                            note="; ".join(why))
figures.update(new)

# %% [markdown]
# ## The three hints and three follow-ups

# %%
HINTS = {
    "Hint one: memory-bound against compute-bound": (
        "A decode step does {diagnose.decode_intensity:.1f} FLOP per byte it reads, far below the ridge of the "
        "GPU, so it runs at the speed of memory: the fused elementwise kernels reach {kernels.rmsnorm_bw_frac:.0%} "
        "of copy bandwidth and paged attention {kernels.paged_attn_bw_frac:.0%}. Prefill does "
        "{diagnose.prefill_intensity:.0f} FLOP per byte and is bound by the tensor cores: there flash attention "
        "is what counts ({kernels.flash_attn_vs_sdpa:.2f}x SDPA's flash backend)."),
    "Hint two: hardware-level kernels against KV quantisation": (
        "Custom kernels cut time without touching accuracy: RMSNorm fused runs {kernels.rmsnorm_speedup_vs_eager:.1f}x "
        "eager. KV quantisation is an algorithmic change: int8 KV halves the cache "
        "({kernels.int8_kv_bytes_ratio:.2f} of the bytes) for {kvcache.int8_ppl_delta_frac:.4%} perplexity, but its "
        "attention runs at {kernels.int8_kv_attn_speedup:.2f}x bf16's, so its win is capacity (a larger batch), "
        "not a faster kernel."),
    "Hint three: continuous batching against FIFO": (
        "Under load FIFO's p99 time to first token grew {baseline.fifo_ttft_p99_growth:.1f}x from the lowest to the "
        "highest rate; continuous batching gave {engine.continuous_vs_fifo_throughput:.1f}x FIFO's throughput "
        "and {engine.continuous_vs_static_throughput:.1f}x static batching's, because finished sequences leave "
        "and new ones join at every step."),
    "Follow-up one: fine-tuning instead of inference": (
        "Training holds gradients and optimizer state, so memory, not bandwidth, is the first limit: LoRA trains "
        "{finetune.lora_trainable_frac:.1%} of the parameters, and QLoRA's peak memory is "
        "{finetune.qlora_peak_mem_ratio_vs_full:.0%} of full fine-tuning's; the memory model predicts the peak "
        "within {finetune.memory_model_rel_err:.1%}. Pipeline schedules matter more (one-forward-one-backward), "
        "CUDA graphs and KV paging less."),
    "Follow-up two: pipeline or tensor parallelism": (
        "Tensor parallelism splits every weight read, so it cuts the time per token, at two all-reduces per layer: "
        "inside a node only. Pipeline parallelism sends little but idles: the measured bubble "
        "{parallel.pp_bubble_measured:.2f} against the formula's {parallel.pp_bubble_formula:.2f}. Both reproduce "
        "the single-process logits (TP {parallel.tp_logits_rel_err:.0e}). The planner picks "
        "{plan.gpt3_175b_layout}."),
    "Follow-up three: FP32, BF16, INT8": (
        "Fewer bytes per weight means faster bandwidth-bound decode and fewer GPUs for the weights: int8 weights "
        "are {quant.int8_weight_bytes_ratio:.2f} of bf16's bytes for {quant.int8_ppl_delta_frac:.3%} perplexity, "
        "FP8 {quant.fp8_weight_bytes_ratio:.2f} for {quant.fp8_ppl_delta_frac:.2%}. Speed depends on the kernel at "
        "the batch: FP8 through torch._scaled_mm decodes at {quant.fp8_decode_speedup:.2f}x bf16 at batch one "
        "({quant.fp8_kernels_per_step:.0f} kernels a step, most of them quantising activations), and the planner "
        "needs {plan.gpus_175b_int8} GPUs with int8 weights against {plan.gpus_175b_bf16} with bf16."),
}
for title, text in HINTS.items():
    display(Markdown(f"**{title}.** " + cap.render(text, figures)))

# %% [markdown]
# ## The plan for the hundred-and-seventy-five-billion model, and how it moves
# The assumptions: the scenario below, the calibration of the step model (fitted efficiencies and the kernel
# paths above), links at their datasheet rates. Then the same plan with a slower interconnect and with a tighter
# and a looser objective.

# %%
display(pd.DataFrame([SCENARIO_175B.__dict__]).T.rename(columns={0: "assumption"}))
display(pd.DataFrame([{"weights": w, "weight-read efficiency": rec.cal.bw(w), "batched dequant (s per weight)":
                       rec.cal.dequant(w)} for w in rec.cal.bandwidth_eff]).round(4))
variants = {"as planned": rec}
if PROFILE != "ci":
    variants["PCIe instead of NVLink"] = recommend(SCENARIO_175B, intra="pcie5")
    variants["TPOT objective halved"] = recommend(SCENARIO_175B, tpot_s=SCENARIO_175B.tpot_s / 2)
    variants["TPOT objective doubled"] = recommend(SCENARIO_175B, tpot_s=SCENARIO_175B.tpot_s * 2)
display(pd.DataFrame([{"variant": k, "layout": v.layout, "GPUs": v.best.gpus if v.best else None,
                       "TPOT (ms)": v.best.tpot_ms if v.best else None} for k, v in variants.items()]).round(1))

# %%
claims = show(
    Claim("In one run on one machine, notebooks 06 and 08 get the same layout from the planner: "
          "{plan.gpt3_175b_layout}", "parallel.recommended_175b_layout == plan.gpt3_175b_layout", machine="gpu"),
    Claim("The planner finds a plan for every weight format. At the planned batch, int8 weights need "
          "{plan.gpus_175b_int8:if > plan.gpus_175b_bf16 then more else no more} GPUs than bf16 "
          "({plan.gpus_175b_int8} against {plan.gpus_175b_bf16}), int4 "
          "{plan.gpus_175b_int4:if > plan.gpus_175b_bf16 then more else no more} ({plan.gpus_175b_int4}) and FP8 "
          "{plan.gpus_175b_fp8:if > plan.gpus_175b_bf16 then more else no more} ({plan.gpus_175b_fp8}); the planner "
          "takes each format's fastest kernel measured at that batch",
          "plan.gpus_175b_bf16 > 0 and plan.gpus_175b_int8 > 0 and plan.gpus_175b_int4 > 0 and "
          "plan.gpus_175b_fp8 > 0", machine="gpu"),
    Claim("int8 KV serves the scenario on no more GPUs than bf16 KV ({plan.gpus_175b_kv_int8} against "
          "{plan.gpus_175b_kv_bf16})", "plan.gpus_175b_kv_int8 <= plan.gpus_175b_kv_bf16", machine="gpu"),
    Claim("int8 KV attention runs within 10% of bf16's speed ({kernels.int8_kv_attn_speedup:.2f}x): its gain is "
          "capacity (half the bytes per token), not speed", "0.9 < kernels.int8_kv_attn_speedup < 1.1",
          machine="gpu"),
    Claim("int8 weights cost under half a percent of perplexity ({quant.int8_ppl_delta_frac:.3%})",
          "quant.int8_ppl_delta_frac < 0.005", machine="gpu"),
    Claim("The planner predicts measured steps within {plan.step_time_mape:.1%} (leave-one-out; the bar: 15%)",
          "plan.step_time_mape <= 0.15", machine="gpu"),
    Claim("The paged cache wastes less than a contiguous one that reserves the model's whole context "
          "({kvcache.paged_waste_frac:.1%} against {kvcache.contiguous_waste_frac:.0%})",
          "kvcache.paged_waste_frac < kvcache.contiguous_waste_frac", machine="gpu"),
    Claim("Decode is memory-bound and prefill compute-bound: {diagnose.decode_intensity:.1f} and "
          "{diagnose.prefill_intensity:.0f} FLOP per byte on either side of the GPU's measured ridge point of "
          "{diagnose.ridge_flop_per_byte:.0f}", "diagnose.decode_intensity < diagnose.ridge_flop_per_byte < "
          "diagnose.prefill_intensity", machine="gpu"),
    "The technique table has {capstone.technique_rows} rows; {capstone.empty_cells} of their cells have no measuring "
    "figure yet (listed above)",
    title="Checked claims",
)

# %% [markdown]
# ## Takeaways
# * Measure first: the idle share and the bandwidth fraction say which tier to start with.
# * The free wins come first (scheduling, CUDA graphs, paging): they cost no accuracy.
# * Quantisation pays only with a kernel that is fast at the batch served; the planner takes the fastest
#   measured kernel per format, so a faster kernel changes its answer, not the prose.
# * Tensor parallelism inside a node, replicas for throughput, pipeline stages only across nodes.
