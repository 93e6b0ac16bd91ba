# %% [markdown]
# # 08 · Capstone: the answer to the 175B question, rebuilt from the records
#
# **The question.** A transformer of a hundred and seventy-five billion parameters is served on a GPU cluster with
# high latency and low utilisation at peak traffic. How do we diagnose it, which optimisations do we apply in which
# order (memory, computation, communication), what does each trade in accuracy, latency and memory, and how do we
# prove each one worked?
#
# Everything below is rendered from `results/summary.json`, the committed records and the planner at every run:
# this notebook measures nothing itself, and its prose holds no typed number (a test checks the markdown for
# digits). Nothing here ran a model of a hundred and seventy-five billion parameters: its numbers are arithmetic
# on its shape, or the planner's predictions; every measured number comes from a proxy (a Llama model of eight
# billion parameters on a GPU, the embedded model of eight million on the CPU) and says which, and on which machine.

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
from labkit.plan import SCENARIO_175B, load_summary, model_arithmetic, recommend, validate, weight_paths
from labkit.plan import mape as plan_mape
from labkit.plan import load_sweep
from labkit.model import get_config
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
figures = dict(load_summary())
derived = cap.derived_figures()
fresh = output_dir() / "records" / "format_gemm.json"  # measured earlier in this run (gpu profile), if at all
if PROFILE == "gpu" and not fresh.exists():  # each weight format's kernels, labkit's and the peers', by batch
    from labkit.experiments.quantization.format_gemm import measure, write_records

    write_records(measure(budget_s=150, timing_s=80))
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
spec = get_config(SCENARIO_175B.model)
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
for name, value, unit, why in cap.plan_figures(rec):  # per format: GPUs, the kernel, GPUs on labkit's kernels
    new[name] = record_figure(name, value, unit, out, machine=m, note=why)
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
for name, value, unit, why in cap.layout_figures(best, SCENARIO_175B):  # the plan in words, not its layout string
    new[name] = record_figure(name, value, unit, out, machine=m, derived=True, note=why)
for suffix, (value, unit, why) in model_arithmetic(SCENARIO_175B.model).items():  # the 175B arithmetic
    new[f"plan.gpt3_175b_{suffix}"] = record_figure(f"plan.gpt3_175b_{suffix}", value, unit, out, derived=True,
                                                    note=why)
full, qlora = figures.get("finetune.gpt3_full_ft_peak_gb"), figures.get("finetune.gpt3_qlora_peak_gb")
if full and qlora:  # notebook 07's memory model at 175B: QLoRA's peak as a share of full fine-tuning's
    new["finetune.gpt3_qlora_vs_full_frac"] = record_figure(
        "finetune.gpt3_qlora_vs_full_frac", qlora["value"] / full["value"], "fraction", out, machine=full["machine"],
        derived=True, note="finetune.gpt3_qlora_peak_gb / finetune.gpt3_full_ft_peak_gb (07's memory model)")
figures.update(new)
classes = cap.by_class(extra=new)  # each machine's figures: the summary's, this run's on top

# %% [markdown]
# ## The spoken answer (two minutes)
# In the order the question asks for: the arithmetic of the model, the diagnosis and its proof, the plan tier by
# tier, communication, the layout and why, and how each change is verified. Each measured number names the proxy
# and the machine it was measured on; the table after the answer lists them with their records.

# %%
answer, evidence = cap.answer(classes, figures)
words = cap.word_count(answer)
labelled = cap.proxy_labelled(answer, evidence)
new["capstone.answer_words"] = record_figure("capstone.answer_words", words, "words", out, bar="<= 300",
                                             derived=True, note="the two-minute answer, rendered")
new["capstone.proxy_labelled"] = record_figure("capstone.proxy_labelled", labelled, "bool", out, bar="true",
                                               derived=True, note="every tier's measured number names its proxy "
                                                                  "and machine")
figures.update(new)
assert words <= 300 and labelled, (words, labelled)
display(Markdown(answer))
display(pd.DataFrame([{"part": e["group"], "measured on": e["label"],
                       "figures": ", ".join(f"{n} ({classes[e['class']][n]['record']})" for n in e["figures"])}
                      for e in evidence]))
print(f"{words} words")

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
# ## Which kernel each quantised number comes from
# A weight format is as fast as the kernel that multiplies it. The planner takes, per format and batch, the fastest
# kernel measured on the machine (labkit's own or a peer's: notebook four's kernel comparison); the table shows, per
# format, the kernel its plan's step reads the weights with and the GPU count with labkit's own kernels only. The
# paragraph below it is rendered from the figures of one machine.

# %%
display(pd.DataFrame([{"weights": w, "GPUs": figures.get(f"plan.gpus_175b_{w}", {}).get("value"),
                       "kernel of the plan's step": figures.get(f"plan.kernel_175b_{w}", {}).get("value"),
                       "GPUs, labkit's kernels only": figures.get(f"plan.gpus_175b_{w}_labkit", {}).get("value"),
                       "fastest kernel at sixty-four rows (8B layer)": figures.get(f"quant.{w}_best_path_b64",
                                                                                   {}).get("value"),
                       "its speed-up over bf16": figures.get(f"quant.{w}_best_gemm_speedup_b64", {}).get("value"),
                       "labkit's": figures.get(f"quant.{w}_labkit_gemm_speedup_b64", {}).get("value")}
                      for w in ("bf16", "fp8", "int8", "int4")]).round(2))
display(Markdown(cap.render_paragraph(cap.KERNELS, classes, figures)[0]))

# %% [markdown]
# ## The three hints and three follow-ups

# %%
for title, text in cap.HINTS.items():
    display(Markdown(f"**{title}.** " + cap.render_paragraph(text, classes, figures)[0]))

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
    Claim("The paged cache wastes less than a contiguous one that reserves the workload's longest sequence "
          "({kvcache.paged_waste_frac:.1%} against {kvcache.contiguous_waste_frac_workload_max:.0%})",
          "kvcache.paged_waste_frac < kvcache.contiguous_waste_frac_workload_max", machine="any"),
    Claim("Decode is memory-bound and prefill compute-bound: {diagnose.decode_intensity:.1f} and "
          "{diagnose.prefill_intensity:.0f} FLOP per byte on either side of the GPU's measured ridge point of "
          "{diagnose.ridge_flop_per_byte:.0f}", "diagnose.decode_intensity < diagnose.ridge_flop_per_byte < "
          "diagnose.prefill_intensity", machine="gpu"),
    "The technique table has {capstone.technique_rows} rows; {capstone.empty_cells} of their cells have no measuring "
    "figure yet (listed above)",
    "The answer above is {capstone.answer_words} words; every tier's number names its proxy and machine: "
    "{capstone.proxy_labelled}",
    title="Checked claims",
)

# %% [markdown]
# ## Takeaways
# * Measure first: the idle share and the bandwidth fraction say which tier to start with.
# * The free wins come first (scheduling, CUDA graphs, paging): they cost no accuracy.
# * Quantisation pays only with a kernel that is fast at the batch served; the planner takes the fastest
#   measured kernel per format, so a faster kernel changes its answer, not the prose.
# * Tensor parallelism inside a node, replicas for throughput, pipeline stages only across nodes.
# * A proxy's number is evidence for a technique, not a measurement of the big model: say which proxy and which
#   machine, and let the planner carry it to the big model as a prediction, labelled as one.
