# %% [markdown]
# # 01 · Diagnose before optimising: roofline, profiler, attribution
#
# **The question.** The scenario's service has high latency and a mostly idle GPU. *Which* resource binds, in
# which phase, and what will prove that a change worked? This notebook answers with two instruments used by every
# later notebook:
#
# * `labkit.roofline.roofline`: FLOPs and bytes of each layer type, hence arithmetic intensity, the binding
#   ceiling and the time it implies (a prediction);
# * `labkit.profiling.profile_run`: `torch.profiler` device time by category, idle time between kernels, kernels
#   per decode step, and the Chrome/Perfetto trace (a measurement).
#
# `ci`/`cpu` profiles run the embedded model on the CPU (where aten operators stand in for kernels); the `gpu`
# profile runs the Llama-3-8B architecture in bf16 with random weights.

# %% tags=["parameters"]
profile = "auto"
seed = 0

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

import labkit  # noqa: F401
from labkit.bench import SUMMARY_PATH, output_dir, record_figure, write_record
from labkit.claims import Claim, show
from labkit.experiments.diagnose import profile_decode, regimes
from labkit.figures import machine_figures, read_summary
from labkit.hardware import KNOWN, detect, measure_ceilings, measured_hardware
from labkit.model import PRESETS, get_config, load_model, random_model
from labkit.profiling import plot_timeline, profile_run
from labkit.roofline import mbu, mfu, plot_roofline, roofline
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
SIZES = {  # regime: the (batch, context) the regimes test doubles
    "ci": dict(context=128, new_tokens=8, big_batch=16, prefill_contexts=[64, 256, 1024], regime=(2, 64),
               regime_steps=4),
    "cpu": dict(context=512, new_tokens=16, big_batch=32, prefill_contexts=[128, 512, 2000], regime=(4, 512),
                regime_steps=8),
    "gpu": dict(context=512, new_tokens=32, big_batch=64, prefill_contexts=[512, 2048, 8192], regime=(16, 1024),
                regime_steps=16),
}[PROFILE]
if PROFILE != "gpu":
    torch.set_num_threads(1)  # the embedded model's matmuls are too small to gain from threads on a shared CPU
print(PROFILE, SIZES)

# %% [markdown]
# ## Predict: arithmetic intensity against the ridge point
# A kernel is memory-bound when its FLOPs per byte moved fall below the device's ridge point (peak FLOP/s over
# bandwidth). Decode at batch *B* reads every weight once for *B* tokens, so its intensity is about *B* FLOP per
# byte in bf16 (2 FLOPs per weight, 2 bytes per weight); prefill of *n* tokens does *n* times the work per weight
# read.

# %%
ceilings = measure_ceilings()
here = measured_hardware(ceilings, detect())
h200_sheet = KNOWN["h200"]
h200_measured = None
if SUMMARY_PATH.exists():  # the committed H200 record, quoted with its source
    figs = machine_figures(read_summary(), "h200")
    if "ceiling.copy_tb_s" in figs and "ceiling.bf16_mm_tflop_s" in figs:
        h200_measured = (figs["ceiling.bf16_mm_tflop_s"]["value"] * 1e12 / (figs["ceiling.copy_tb_s"]["value"] * 1e12),
                         figs["ceiling.copy_tb_s"]["record"])
print(f"this device ({ceilings['device']}): ridge point {here.ridge_point:.0f} FLOP/byte (measured now)")
print(f"H200 datasheet ridge: {h200_sheet.ridge_point:.0f} FLOP/byte")
if h200_measured:
    print(f"H200 measured ridge: {h200_measured[0]:.0f} FLOP/byte (from {h200_measured[1]})")
rows = []
for name in ("llama-3-8b", "gpt3-175b"):
    for phase, batch, ctx in (("decode", 1, 2048), ("decode", 64, 2048), ("prefill", 1, 2048)):
        r = roofline(PRESETS[name], h200_sheet, batch=batch, context=ctx, phase=phase)
        rows.append({"model": name, "phase": phase, "batch": batch, "context": ctx, "FLOP/byte": r.intensity,
                     "bound on H200": r.bound, "predicted step (ms)": r.time_s * 1e3})
intensity = pd.DataFrame(rows)
display(intensity.round(2))

# %%
r8 = roofline("llama-3-8b", h200_sheet, batch=1, context=2048, phase="decode")
display(pd.DataFrame(r8.table()).round(3))

# %% [markdown]
# ## Measure: decode steps on this machine, prefill excluded
# Each batch of random prompts is prefilled on a fresh cache *outside* the profiled region; the profile holds
# `new_tokens` decode steps only (HF eager: one forward per step, the argmax fed back). A profile of `generate`
# would include the prefill, which at batch 64 and context 512 is 32,768 tokens of work and swamps the steps.

# %%
if PROFILE == "gpu":
    model = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=seed)
    dtype = "bf16"
else:
    model, _ = load_model(device="cpu", dtype="fp32")
    dtype = "fp32"
spec = get_config(model)
vocab = spec.vocab_size
gen = torch.Generator().manual_seed(seed)


def prompts(batch, length):
    return [tuple(torch.randint(3, vocab, (length,), generator=gen).tolist()) for _ in range(batch)]


trace_dir = output_dir() / "traces"
trace_dir.mkdir(exist_ok=True)
ctx, n_new = SIZES["context"], SIZES["new_tokens"]
results = {}
for batch in (1, SIZES["big_batch"]):
    res = profile_decode(model, batch, ctx, n_new, seed=seed, trace_path=str(trace_dir / f"decode_bs{batch}.json"))
    pred = roofline(spec, here, batch=batch, context=ctx + n_new // 2, phase="decode", dtype=dtype)
    step_s = res.wall_s / n_new
    results[f"decode batch {batch}"] = dict(res=res, pred=pred, step_s=step_s)
    print(f"decode batch {batch}: {step_s * 1e3:.2f} ms/step measured vs {pred.time_s * 1e3:.3f} ms predicted; "
          f"idle {res.idle_frac:.1%}; {res.kernels_per_step:.0f} kernels/step; named categories cover "
          f"{res.covered_frac:.1%} of device time")

# %% [markdown]
# ### Device time by category, and the idle gaps

# %%
cat_table = pd.DataFrame({k: {row["category"]: row["time (ms)"] for row in v["res"].table()}
                          for k, v in results.items()})
display(cat_table.round(2))
fig, axes = plt.subplots(2, 1, figsize=(11, 5.5))
for ax, (k, v) in zip(axes, results.items()):
    plot_timeline(v["res"], ax=ax, max_ms=3 * v["step_s"] * 1e3)
    ax.set_title(f"{k}: three decode steps")
plt.tight_layout()
plt.show()
display(pd.DataFrame(results["decode batch 1"]["res"].top_kernels(10)))

# %% [markdown]
# ## Prefill is compute-bound, and attention's share grows with context

# %%
prefill_rows = []
for n in SIZES["prefill_contexts"]:
    ids = torch.tensor(prompts(1, n), device=next(model.parameters()).device)
    with torch.no_grad():
        res = profile_run(lambda ids=ids: model(input_ids=ids, logits_to_keep=1), steps=1, warmup=1)
    pred = roofline(spec, here, batch=1, context=n, phase="prefill", dtype=dtype)
    cats = res.by_category()
    prefill_rows.append({"context": n, "measured (ms)": res.wall_s * 1e3, "predicted (ms)": pred.time_s * 1e3,
                         "intensity (FLOP/B)": pred.intensity, "bound": pred.bound,
                         "MFU": mfu(pred.flops, res.wall_s, here.bf16_flops),
                         "attention share": cats["attention"] / res.device_s,
                         "matmul share": cats["matmul"] / res.device_s, "idle frac": res.idle_frac})
prefill = pd.DataFrame(prefill_rows)
display(prefill.round(3))
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(prefill.context, prefill["attention share"], "o-", label="attention")
ax.plot(prefill.context, prefill["matmul share"], "s-", label="matmul (projections, MLP, LM head)")
ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="share of device time", ylim=(0, 1),
       title="prefill: attention's share grows with context")
ax.legend()
plt.show()

# %% [markdown]
# ## The regimes test: double the batch, double the context, see which time moves
# A decode step at a base (batch, context), at twice the batch and at twice the context, each profiled (decode
# only). For each category of operation: a time that does not move and sits far above its byte floor is paid per
# call (**overhead-bound**); a time that follows the bytes (weights: flat in batch; KV: doubling with batch and
# context) with intensity under the ridge point is **bandwidth-bound**; one that follows the FLOPs above the ridge
# is **compute-bound**. The idle device (host time between kernels) is overhead by definition.

# %%
B0, C0 = SIZES["regime"]
regime_rows, regime_prof = regimes(model, spec, here, B0, C0, SIZES["regime_steps"], dtype=dtype, seed=seed)
regime_df = pd.DataFrame(regime_rows)
display(regime_df.round(3))
fig, ax = plt.subplots(figsize=(9, 3.6))
x = range(len(regime_df))
for i, (col, label) in enumerate((("base ms/step", f"batch {B0}, context {C0}"),
                                  ("2x batch ms/step", f"batch {2 * B0}"), ("2x context ms/step", f"context {2 * C0}"))):
    ax.bar([j + (i - 1) * 0.27 for j in x], regime_df[col], width=0.27, label=label)
ax.set_xticks(list(x), [f"{c}\n{r}" for c, r in zip(regime_df.category, regime_df.regime)], fontsize=9)
ax.set(ylabel="ms per decode step", title="which time moves when the work doubles (decode only)")
ax.legend(fontsize=9)
plt.tight_layout()
plt.show()
regime_of = dict(zip(regime_df.category, regime_df.regime))

# %% [markdown]
# ## Prediction against measurement: the gap, explained

# %%
points, gap_rows = [], []
for k, v in results.items():
    pred, res, step_s = v["pred"], v["res"], v["step_s"]
    points.append((k, pred.intensity, pred.flops / step_s))
    gap_rows.append({"step": k, "predicted (ms)": pred.time_s * 1e3, "measured (ms)": step_s * 1e3,
                     "measured / predicted": step_s / pred.time_s, "MBU": mbu(pred.bytes, step_s, here.mem_bandwidth),
                     "MFU": mfu(pred.flops, step_s, here.bf16_flops), "idle frac": res.idle_frac,
                     "kernel time / predicted": res.busy_s / n_new / pred.time_s})
last = prefill_rows[-1]
points.append((f"prefill {last['context']}", last["intensity (FLOP/B)"],
               roofline(spec, here, 1, last["context"], "prefill", dtype).flops / (last["measured (ms)"] / 1e3)))
display(pd.DataFrame(gap_rows).round(3))
plot_roofline(here, points)
plt.title(f"roofline of {here.name} (measured ceilings) with measured steps")
plt.show()

# %% [markdown]
# Reading the table: *measured / predicted* is how far the step is from its floor. *Idle frac* is the part of
# that gap where the device did nothing (Python, `generate`'s bookkeeping, kernel launches): CUDA graphs and a
# leaner engine remove it. *Kernel time / predicted* is the part left inside kernels: unfused elementwise
# kernels re-reading activations, attention reading a padded cache, matmul kernels that do not reach the
# bandwidth at small batch; fused kernels and paging address it.

# %% [markdown]
# ## Findings and the tiered strategy
# Each finding names the technique that addresses it, the notebook that applies it, and the measurement that
# will prove the change worked.

# %%
bs1 = results["decode batch 1"]
findings = pd.DataFrame([
    {"finding": f"decode at batch 1 is memory-bound (intensity {bs1['pred'].intensity:.1f} FLOP/B << ridge)",
     "technique": "batching (continuous), weight quantisation", "notebook": "05, 04",
     "verify by": "MBU of the decode step rises toward 1; tokens/s per GB of weights read rises"},
    {"finding": f"HF eager decode leaves the device idle {bs1['res'].idle_frac:.0%} of the time, "
                f"{bs1['res'].kernels_per_step:.0f} kernels per step",
     "technique": "CUDA graphs, a lean engine loop", "notebook": "05",
     "verify by": "idle frac of the decode step below 10%; step time toward the bandwidth floor"},
    {"finding": "KV cache reserved per request limits the batch", "technique": "paged KV cache, KV quantisation",
     "notebook": "02", "verify by": "admitted sequences at a fixed memory budget (>= 2.5x); waste <= 4%"},
    {"finding": "norms/elementwise/attention kernels move more bytes than needed",
     "technique": "fused Triton kernels", "notebook": "03",
     "verify by": "norm/elementwise category time drops; kernel GB/s >= 0.9 of copy bandwidth"},
    {"finding": "prefill is compute-bound and attention grows with context",
     "technique": "FlashAttention, chunked prefill", "notebook": "03, 05",
     "verify by": "attention TFLOP/s vs SDPA; p99 inter-token latency under mixed load"},
    {"finding": "a 175B model does not fit one GPU", "technique": "tensor parallel in a node, pipeline across",
     "notebook": "06", "verify by": "communication share of step time; bubble fraction vs (p-1)/(m+p-1)"},
])
display(findings)

# %% [markdown]
# ## The same diagnosis with NVIDIA's tools
# Users with Nsight installed can take the timeline and per-kernel counters directly (text only; not run here):
#
# ```
# nsys profile -t cuda,nvtx,osrt --cuda-graph-trace=node -o decode_bs1 python -m labkit run --only 01 --profile gpu
# nsys stats --report cuda_gpu_kern_sum decode_bs1.nsys-rep
# ncu --clock-control none --set full -k regex:"gemv|gemm|flash|rms" -c 50 -o decode_kernels \
#     python -m labkit run --only 01 --profile gpu
# ncu --import decode_kernels.ncu-rep --page details --print-summary per-kernel
# ```
# The Chrome/Perfetto traces this notebook wrote (open them in https://ui.perfetto.dev):

# %%
for k in results:
    print(results[k]["res"].trace_path)

# %%
rec = write_record("01_diagnose", {
    "ceilings": ceilings, "sizes": SIZES, "intensity_table": intensity.to_dict("records"),
    "decode": {k: {"step_s": v["step_s"], "wall_s": v["res"].wall_s, "busy_s": v["res"].busy_s,
                   "idle_frac": v["res"].idle_frac, "kernels_per_step": v["res"].kernels_per_step,
                   "by_category_s": v["res"].by_category(), "covered_frac": v["res"].covered_frac,
                   "predicted_s": v["pred"].time_s, "predicted_bytes": v["pred"].bytes,
                   "predicted_flops": v["pred"].flops, "top_kernels": v["res"].top_kernels(20)}
               for k, v in results.items()},
    "prefill": prefill_rows, "gap": gap_rows, "regimes": {"batch": B0, "context": C0, "rows": regime_rows},
})
record_figure("diagnose.decode_bs1_idle_frac", bs1["res"].idle_frac, "fraction of wall time", rec)
record_figure("diagnose.decode_bs1_kernels_per_step", bs1["res"].kernels_per_step, "kernels", rec)
record_figure("diagnose.decode_intensity", bs1["pred"].intensity, "FLOP/byte", rec, derived=True,
              note=f"decode batch 1, context {ctx}, {dtype}: roofline arithmetic")
record_figure("diagnose.prefill_intensity", prefill_rows[-1]["intensity (FLOP/B)"], "FLOP/byte", rec, derived=True,
              note=f"prefill of {prefill_rows[-1]['context']} tokens, {dtype}: roofline arithmetic")
record_figure("diagnose.ridge_flop_per_byte", ceilings["ridge_flop_per_byte"], "FLOP/byte", rec,
              note=f"measured {ceilings['matmul_dtype']} matmul rate over measured copy bandwidth, this run")
big = results[f"decode batch {SIZES['big_batch']}"]
record_figure("diagnose.decode_big_batch_idle_frac", big["res"].idle_frac, "fraction of wall time", rec,
              note=f"decode only (prefill excluded), batch {SIZES['big_batch']}, context {ctx}")
record_figure("diagnose.decode_big_batch_step_ms", big["step_s"] * 1e3, "ms", rec,
              note=f"decode only, batch {SIZES['big_batch']}, context {ctx}")
record_figure("diagnose.decode_bs1_step_ms", bs1["step_s"] * 1e3, "ms", rec, note=f"decode only, context {ctx}")
for row in regime_rows:
    key = {"norm/elementwise": "norm", "memory copy": "copy", "idle (host)": "idle"}.get(row["category"],
                                                                                        row["category"])
    record_figure(f"diagnose.regime_{key}", row["regime"], "regime", rec,
                  note=f"decode, batch {B0} context {C0}: x{row['ratio 2x batch']:.2f} at 2x batch, "
                       f"x{row['ratio 2x context']:.2f} at 2x context; floor {row['floor ms/step']:.3f} ms")
    record_figure(f"diagnose.{key}_ratio_2x_batch", row["ratio 2x batch"], "x", rec)
    record_figure(f"diagnose.{key}_ratio_2x_context", row["ratio 2x context"], "x", rec)
print(f"record: {rec}")

# %% [markdown]
# ## Takeaways

# %%
show(
    Claim("Decode at batch 1 does {diagnose.decode_intensity:.1f} FLOP per byte moved, under this machine's "
          "measured ridge point of {diagnose.ridge_flop_per_byte:.0f} FLOP/byte: memory-bound",
          "diagnose.decode_intensity < diagnose.ridge_flop_per_byte", machine="any"),
    Claim("Prefill of a long prompt does {diagnose.prefill_intensity:.0f} FLOP per byte, above the GPU's measured "
          "ridge point of {diagnose.ridge_flop_per_byte:.0f}: compute-bound",
          "diagnose.prefill_intensity > diagnose.ridge_flop_per_byte", machine="gpu"),
    Claim("In HF eager decode at batch 1 on the GPU the device is idle {diagnose.decode_bs1_idle_frac:.0%} of the "
          "time: more of each step waits on the host than runs kernels", "diagnose.decode_bs1_idle_frac > 0.5",
          machine="gpu"),
    Claim("HF eager decode launches {diagnose.decode_bs1_kernels_per_step:.0f} kernels per step on the GPU, over 500",
          "diagnose.decode_bs1_kernels_per_step > 500", machine="gpu"),
    Claim("The host time between kernels does not follow the work: x{diagnose.idle_ratio_2x_batch:.2f} when the "
          "batch doubles, under x1.6 (overhead-bound)", "diagnose.idle_ratio_2x_batch < 1.6 and "
          "diagnose.regime_idle == 'overhead-bound'", machine="any"),
    Claim("With HF's dynamic cache, memory-copy time grows x{diagnose.copy_ratio_2x_context:.2f} when the context "
          "doubles, over x1.15: it grows with the cache ({diagnose.regime_copy})",
          "diagnose.copy_ratio_2x_context > 1.15", machine="any"),
)

# %% [markdown]
# * Every later notebook re-measures one row of the findings table with these same two instruments, and the
#   regimes test says which lever applies to which category: fewer launches for overhead, fewer bytes for
#   bandwidth, faster math only where the time follows the FLOPs.
