# %% [markdown]
# # 04 · Quantisation and precision: fewer bytes per weight, and what it costs
#
# **The question.** Decode of the scenario's model is memory-bound (notebook 01): each step reads every weight
# once, so its time is about *weight bytes / bandwidth*. Storing weights in 8 or 4 bits should cut that time
# and the memory the weights occupy, at some cost in accuracy. How much of each, per method? And the seed's
# third follow-up: **how does the choice of precision (FP32 vs BF16 vs INT8) affect throughput and numerical
# stability?**
#
# Methods (`labkit.quant.quantize(model, method)`, which returns the same HF model with its linear layers
# swapped, so `generate` and the static-cache decode step run unchanged):
#
# | method | weights | activations | how |
# | --- | --- | --- | --- |
# | `int8` | int8, one scale per output channel | 16/32-bit | round to nearest (RTN), absmax |
# | `int4` | int4 packed two per byte, scale + zero per 128 inputs | 16/32-bit | RTN, asymmetric |
# | `gptq` | same format as `int4` | 16/32-bit | GPTQ: rounding error spread by the inverse Hessian of real inputs (the `calib` split) |
# | `bnb-int8` | int8 per row | int8 per token, fp16 outlier features | bitsandbytes LLM.int8, threshold 6.0 |
# | `bnb-nf4` | 4-bit normal-quantile codes per 64, double-quantised absmax | 16/32-bit | bitsandbytes NF4 |
# | `fp8` | e4m3, one scale per output channel | e4m3, one scale per token | `torch._scaled_mm` on Hopper; emulated on the CPU |
# | `int4+lm_head` | `int4`, the LM head quantised too | 16/32-bit | `quantize(model, "int4", lm_head=True)` |
# | `int4+int8_head` | `int4` layers, the LM head in `int8` | 16/32-bit | `quantize(model, "int4", lm_head="int8")` |
#
# Two scales, as in every notebook: **accuracy** on the embedded trained model (float32 reference, held-out split);
# **speed and memory** on the Llama-3-8B architecture with random weights in bf16 on the H200 (`gpu` profile),
# where each decode step is one forward over a static KV cache replayed as a CUDA graph, so launch overhead does
# not hide the bytes saved.

# %% tags=["parameters"]
profile = "auto"
seed = 0

# %%
import json

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown

import labkit  # noqa: F401  (before anything imports triton)
from labkit.bench import SUMMARY_PATH, output_dir, record_figure, write_record
from labkit.claims import Claim, show
from labkit.device import native_bf16
from labkit.hardware import KNOWN, measure_copy_bandwidth
from labkit.model import PRESETS, load_model, random_model
from labkit.experiments.quantization import (accuracy_rows, breakdown_tables, bytes_per_weight, decode_weight_bytes,
                                             plot_step_breakdown, speed_rows)
from labkit.experiments.quantization import precision as P
from labkit.experiments.quantization.kernel_count import count_summary, kernel_counts, linear_ops
from labkit.figures import committed_figures
from labkit.data import REPO_ROOT
from labkit.quant import METHODS, quantize
from labkit.quant.fp8 import Fp8Linear
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
SIZES = {
    "ci": dict(seq_len=256, windows=24, calib_samples=16, calib_seq_len=256, context=32, decode_iters=2,
               error_tokens=(2, 64), matmul_size=256, sum_lengths=(256, 1024, 4096), dtype_windows=4,
               accuracy_device="cpu"),
    "cpu": dict(seq_len=256, windows=24, calib_samples=32, calib_seq_len=256, context=64, decode_iters=3,
                error_tokens=(2, 64), matmul_size=512, sum_lengths=(256, 1024, 4096, 16384),
                dtype_windows=8, accuracy_device="cpu"),
    "gpu": dict(seq_len=512, windows=None, calib_samples=64, calib_seq_len=512, context=512, decode_iters=50,
                error_tokens=(8, 512), matmul_size=8192, sum_lengths=(256, 1024, 4096, 16384),
                dtype_windows=None, accuracy_device="cuda"),
}[PROFILE]
if PROFILE == "ci":
    # seconds-long runs of tiny ops on a shared 2-core runner: thread hand-offs cost more than they save
    torch.set_num_threads(1)
if PROFILE == "cpu" and not native_bf16("cpu"):
    # without bf16 instructions torch multiplies bf16 and fp16 on the CPU through a fallback ~100x slower than fp32:
    # the precision section's bf16/fp16 model and matmuls take the ci sizes here (minutes, not an hour)
    SIZES.update(matmul_size=256, dtype_windows=4)
print(PROFILE, SIZES, f"{torch.get_num_threads()} CPU threads")

# %% [markdown]
# ## Predict: bytes per weight, and the decode time they imply
# A format's true size includes its scales: int8 with a bf16 scale per row of 4096 inputs costs 1.0005 bytes per
# weight; int4 with a bf16 scale and zero-point per group of 128 costs 0.5 + 4/128 = 0.531 (4.25 bits); NF4 with
# an 8-bit absmax per 64 and an fp32 per 256 of those, 0.516. The LM head stays in bf16 by default (it is the
# layer most sensitive to error, and the embedded model ties it to the embedding table), so for Llama-3-8B the
# step reads 6.98 B linear weights in the format plus 0.53 B LM-head weights in bf16. If every step ran at the
# same fraction of bandwidth, the speed-up would be the ratio of bytes.

# %%
figs = committed_figures() if SUMMARY_PATH.exists() else {}  # each figure's committed value, a GPU's first
if PROFILE == "gpu":
    bandwidth, bw_source = measure_copy_bandwidth(), "measured now"
elif "ceiling.copy_tb_s" in figs:
    bandwidth, bw_source = figs["ceiling.copy_tb_s"]["value"] * 1e12, f"H200, {figs['ceiling.copy_tb_s']['record']}"
else:
    bandwidth, bw_source = KNOWN["h200"].mem_bandwidth, "H200 datasheet"
spec = PRESETS["llama-3-8b"]
predict = []
for m in ["bf16", "int8", "fp8", "int4", "bnb-nf4"]:
    read = decode_weight_bytes(spec, m)
    predict.append({"method": m, "bytes/weight (linears)": bytes_per_weight(m, spec.hidden_size),
                    "weight bytes read per step (GB)": read / 1e9,
                    "bandwidth floor (ms)": read / bandwidth * 1e3,
                    "predicted speed-up": decode_weight_bytes(spec, "bf16") / read,
                    "speed-up if LM head quantised too": decode_weight_bytes(spec, "bf16") /
                    decode_weight_bytes(spec, m, lm_head=m != "bf16"),
                    "speed-up with an int8 LM head": decode_weight_bytes(spec, "bf16") /
                    decode_weight_bytes(spec, m, lm_head="int8")})
predict = pd.DataFrame(predict)
print(f"Llama-3-8B decode at batch 1, bandwidth {bandwidth / 1e12:.2f} TB/s ({bw_source})")
display(predict.round(3))

# %% [markdown]
# ## Measure accuracy: every method on the embedded model
# Perplexity on the held-out split (never seen in training or GPTQ's calibration), the output error of each
# linear layer against its float32 original on the same inputs (its own error, not the accumulated one), the
# bytes the quantised linear layers actually hold (codes, scales, zero-points, bitsandbytes states), the peak of
# tensor memory during one forward (on the CPU the torch paths materialise a float copy of each weight they
# multiply, which shows up there; fused kernels never do). The baseline row (`base`) is the float32 model.

# %%
model, tok = load_model(device=SIZES["accuracy_device"], dtype="fp32")
acc = accuracy_rows(model, tok, methods=(*METHODS, "int4+lm_head", "int4+int8_head"),
                    seq_len=SIZES["seq_len"], max_windows=SIZES["windows"], calib_samples=SIZES["calib_samples"],
                    calib_seq_len=SIZES["calib_seq_len"], error_tokens=SIZES["error_tokens"], seed=seed)
acc_table = pd.DataFrame([{k: r.get(k) for k in ("method", "ppl", "ppl_delta_frac", "layer_err_mean",
                                                 "layer_err_max", "bits_per_weight", "weight_bytes_ratio",
                                                 "forward_peak_bytes", "quantise_s", "status")}
                          for r in acc])
display(acc_table.round(4))

# %% [markdown]
# ### Check correctness: per-layer error against the workbook's tolerances
# int8 weights must stay within 2e-2 relative error per layer and 4-bit weights within 1e-1 (then perplexity
# decides). The plot shows where each method's error sits, per layer type; the line printed under it counts, per
# method, the layers above each bound.

# %%
errs = pd.DataFrame({r["method"]: r["layer_errors"] for r in acc if "layer_errors" in r})
errs.index = [n.split(".")[-1] for n in errs.index]
by_type = errs.groupby(level=0).mean()
display(by_type.round(4))
assert errs["int8"].max() < 2e-2, errs["int8"].max()
for m in ("int4", "gptq", "bnb-nf4"):
    if m in errs:
        assert errs[m].median() < 1e-1, (m, errs[m].median())
fig, ax = plt.subplots(figsize=(9, 3.5))
by_type.plot.bar(ax=ax, logy=True, rot=0)
ax.axhline(2e-2, color="gray", ls=":", lw=1)
ax.axhline(1e-1, color="gray", ls="--", lw=1)
ax.set(ylabel="relative output error (mean over layers)", title="per-layer output error by projection")
ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
plt.tight_layout()
plt.show()
print("layers above 2e-2 / 1e-1, of", len(errs), "linear layers:",
      {m: (int((errs[m] > 2e-2).sum()), int((errs[m] > 1e-1).sum())) for m in errs})

# %% [markdown]
# ### Quantised models still generate
# Greedy continuations of the same prompt: int8 should match float32 token for token on a short horizon;
# 4-bit methods drift sooner.

# %%
prompt = tok("The os module provides", return_tensors="pt").input_ids.to(model.device)
gen_rows = []
for m in ["base", "int8", "int4", "fp8"]:
    qm = model if m == "base" else quantize(model, m)
    with torch.no_grad():
        out = qm.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    gen_rows.append({"method": m, "continuation": tok.decode(out[0, prompt.shape[1]:])})
display(pd.DataFrame(gen_rows))

# %% [markdown]
# ## Measure speed and memory: Llama-3-8B shape on the GPU
# One decode forward at batch 1 with 512 cached tokens, captured once in a CUDA graph and replayed (bitsandbytes
# is timed eagerly: LLM.int8 picks outlier columns with data-dependent shapes, which a graph cannot hold; its row
# is compared with an eager bf16 step). Three passes, each method's speed-up over bf16 timed the same way:
# HF's own modules around the quantised linears; the same with labkit's Triton norms, SiLU-and-mul and attention
# patched in (notebook 03) on both sides; and labkit's serving forward on the same weights (the engine's
# `ModelRunner` of notebook 05: merged projections, paged attention, and with int8/int4 weights each layer's norms,
# adds, SwiGLU and RoPE folded into its GEMVs -- four GEMVs and attention per layer). The figures quote the engine
# pass. The A/B passes that justify each of the engine's fusions, the full table of every pass and the top kernels
# of every profiled step are in `notebooks/appendix/quantization_passes.py`.
#
# On the CPU profiles this section times the embedded model instead: there the quantised layers dequantise on
# every call (no fused kernel), so they are *slower*: the speed-up is a property of the fused GPU kernels.
# Each row carries its floor: the bytes the step must read as measured on the model (weights as held, the
# untied embedding excepted, plus the KV cache) over the measured copy bandwidth, and the fraction reached.

# %%
if PROFILE == "gpu":
    big = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=seed)
    speed = speed_rows(big, context_len=SIZES["context"], iters=SIZES["decode_iters"], bandwidth=bandwidth)
    try:
        speed += speed_rows(big, methods=("int8", "int4", "fp8"), context_len=SIZES["context"],
                            iters=SIZES["decode_iters"], patch=True, bandwidth=bandwidth, breakdown=12)
    except Exception as e:  # report, keep the unpatched rows
        print(f"patched pass failed: {type(e).__name__}: {e}")
    try:  # labkit's serving forward on the same weights (notebook 05's ModelRunner)
        speed += speed_rows(big, methods=("int8", "int4", "int4+lm_head", "int4+int8_head", "fp8"),
                            context_len=SIZES["context"],
                            iters=SIZES["decode_iters"], runner="engine", bandwidth=bandwidth, breakdown=16)
    except Exception as e:
        print(f"engine pass failed: {type(e).__name__}: {e}")
else:
    cpu_bandwidth = measure_copy_bandwidth("cpu", nbytes=64 * 2**20, iters=5)
    print(f"CPU copy bandwidth {cpu_bandwidth / 1e9:.1f} GB/s (measured now)")
    speed = speed_rows(model, methods=("int8", "int4", "fp8", "bnb-nf4"), context_len=SIZES["context"],
                       iters=SIZES["decode_iters"], bandwidth=cpu_bandwidth)
TIMING_ORDER = ("eager", "cuda_graph", "engine_eager", "engine_graph")


def pick_speed(method):
    """The timing to quote for a method: the engine's graph-replayed forward, then HF's forward replayed as a
    graph (patched over unpatched), then eager (each row's speed-up is over the bf16 step timed the same way).
    GPTQ runs int4's format and kernel."""
    key = "int4" if method == "gptq" else method
    rows = [r for r in speed if r["method"] == key and r.get("status") == "ok" and not r.get("engine_options")]
    return max(rows, key=lambda r: (TIMING_ORDER.index(r["timing"]), bool(r.get("patched")))) if rows else None


quoted = [pick_speed(m) for m in dict.fromkeys(r["method"] for r in speed)]
speed_table = pd.DataFrame([{"method": r["method"], "timed as": r["timing"] + (", patched" if r.get("patched")
                                                                               else ""),
                             "step (ms)": r["decode_ms"], "speed-up over bf16": r["speedup"],
                             "floor (ms)": r.get("floor_ms"), "fraction of floor": r.get("frac_of_floor")}
                            for r in quoted if r is not None])
display(speed_table.round(3))
# the quoted steps that were profiled: kernels per step, the device's busy time, and the timed step; the bar chart
# splits each timed step into kernel categories and the time between kernels (each bar is the step's time)
profiled = [r for r in quoted if r is not None and r.get("breakdown")]
if profiled:
    steps_profiled, _ = breakdown_tables(profiled)
    display(steps_profiled.round(3))
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(profiled) + 1.6))
    plot_step_breakdown(profiled, ax=ax)
    ax.set_title("where a batch-1 decode step's time goes (Llama-3-8B shape)")
    plt.tight_layout()
    plt.show()
if PROFILE == "gpu":
    del big
    torch.cuda.empty_cache()

# %% [markdown]
# ## Why the FP8 W8A8 step is slower than bf16
# FP8 halves the weight bytes like int8, and Hopper multiplies e4m3 at twice the bf16 rate -- yet the FP8 step is
# the slowest of the fused formats at batch 1. Two reasons, both visible in a profiler trace. **Kernels:** each
# `Fp8Linear` quantises its activations per token in eager torch before `torch._scaled_mm`, and each of those ops
# is a kernel launch that reads and writes the activations. **The GEMM:** cuBLAS's FP8 kernel is a tiled GEMM built
# for many rows; at one row it does not stream its weights at the bandwidth a GEMV does. First, the ops of one
# linear layer's forward, bf16 against FP8 (on this device: CUDA kernels on a GPU, aten operators on the CPU, each
# of which is one kernel on a GPU):

# %%
fp8_ref = torch.nn.Linear(512, 512, bias=False, device="cuda" if PROFILE == "gpu" else "cpu",
                          dtype=torch.bfloat16 if PROFILE == "gpu" else torch.float32)
ops_bf16 = linear_ops(fp8_ref)
ops_fp8 = linear_ops(Fp8Linear.from_linear(fp8_ref, backend="scaled_mm"))
print(f"bf16 linear: {len(ops_bf16)} op(s): {ops_bf16}")
print(f"FP8 linear:  {len(ops_fp8)} ops: {ops_fp8}")

# %% [markdown]
# Then the whole step, kernel by kernel: the code below profiles labkit's engine step for FP8 and for bf16
# (`kernel_counts`: every kernel by name, calls per step and per layer, device time per step). It runs under the
# `gpu` profile and records `quant.fp8_kernels_per_step`, `quant.bf16_kernels_per_step` and
# `quant.fp8_gemm_ms_over_bf16_step`; on the CPU the table comes from the committed GPU record (its top kernels).

# %%
fp8_counts, bf16_counts, fp8_source = None, None, None
if PROFILE == "gpu":
    from labkit.experiments.batching import runner_step

    big = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=seed)
    LAYERS = big.config.num_hidden_layers
    for m in ("fp8", "base"):
        qm = big if m == "base" else quantize(big, m)
        step, runner = runner_step(qm, "decode", 1, SIZES["context"])
        counts = kernel_counts(step, LAYERS)
        fp8_counts, bf16_counts = (counts, bf16_counts) if m == "fp8" else (fp8_counts, counts)
        del step, runner, qm
    del big
    torch.cuda.empty_cache()
    fp8_source = "this run (every kernel)"
else:
    e = figs.get("quant.int8_decode_speedup")  # the committed GPU record of this notebook
    gpu_rec = json.loads((REPO_ROOT / e["record"]).read_text()) if e and e["machine"] != "cpu" else None
    if gpu_rec:
        LAYERS = PRESETS["llama-3-8b"].num_layers
        eng = {r["method"]: r for r in gpu_rec["data"]["speed"] if r.get("timing") == "engine_graph"
               and not r.get("engine_options") and r.get("breakdown")}
        if "fp8" in eng and "base" in eng:
            fp8_counts = [dict(r, calls_per_layer=r["calls_per_step"] / LAYERS) for r in eng["fp8"]["breakdown"]["top"]]
            bf16_counts = [dict(r, calls_per_layer=r["calls_per_step"] / LAYERS)
                           for r in eng["base"]["breakdown"]["top"]]
            fp8_kernels = eng["fp8"]["breakdown"]["kernels_per_step"]
            bf16_kernels = eng["base"]["breakdown"]["kernels_per_step"]
            fp8_step_ms, bf16_step_ms = eng["fp8"]["decode_ms"], eng["base"]["decode_ms"]
            fp8_source = f"committed record {e['record']} ({gpu_rec['env']['device']}; its top kernels only)"
if fp8_counts is not None:
    if PROFILE == "gpu":
        fp8_kernels = count_summary(fp8_counts, LAYERS)["kernels_per_step"]
        bf16_kernels = count_summary(bf16_counts, LAYERS)["kernels_per_step"]
        fp8_step_ms, bf16_step_ms = pick_speed("fp8")["decode_ms"], pick_speed("fp8")["decode_ms"] * pick_speed(
            "fp8")["speedup"]
    fp8_table = pd.DataFrame(fp8_counts)[["kernel", "category", "calls_per_step", "calls_per_layer",
                                          "us_per_step"]]
    print(f"FP8 engine decode step, batch 1: {fp8_source}")
    display(fp8_table.head(16).round(2))
    gemm = sum(r["us_per_step"] for r in fp8_counts if r["category"] == "matmul") / 1e3
    quant_ops = sum(r["calls_per_step"] for r in fp8_counts if r["category"] != "matmul"
                    and r["category"] != "attention")
    display(Markdown(
        f"**What the trace shows** ({fp8_source}). The FP8 step launches {fp8_kernels:,.0f} kernels, "
        f"{fp8_kernels / LAYERS:.0f} per layer, against {bf16_kernels:,.0f} for the bf16 step "
        f"({bf16_kernels / LAYERS:.0f} per layer). Of the FP8 kernels listed, {quant_ops:,.0f} per step are not "
        f"GEMMs or attention, about {quant_ops / LAYERS:.0f} per layer: mostly the activation quantisation's casts, "
        f"abs, amax, divides and clamps, besides the norms, RoPE and SiLU. The GEMMs alone (the FP8 linears and the "
        f"bf16 LM head) take {gemm:.2f} ms per step, "
        f"{gemm / bf16_step_ms:.2f} of the whole bf16 step ({bf16_step_ms:.2f} ms): at one token the tiled FP8 GEMM "
        f"reads its weights more slowly than bf16's GEMV path, so even with the quantisation fused away FP8 would "
        f"not win at batch 1. The step takes {fp8_step_ms:.2f} ms, {bf16_step_ms / fp8_step_ms:.2f}x the bf16 "
        f"step's speed. FP8 W8A8 is a format for compute-bound batches (prefill, large decode batches), with the "
        f"activation quantisation fused into the previous kernel."))

# %% [markdown]
# ### The LM head: the last bf16 weights of the step
# With every other linear in int4, the LM head (128256 x 4096 for Llama-3-8B: 1.05 GB in bf16, against 3.7 GB
# for all the int4 layers) is about a fifth of what an int4 step reads. `int4+lm_head` quantises it too (the
# predicted speed-up's last column). Its cost in accuracy is the table's `int4+lm_head` row: every logit goes
# through it, so its error is not averaged away by later layers; on a model with tied embeddings (the embedded
# one) the embedding stays in full precision for the lookup and the head becomes a separate quantised copy.
# `int4+int8_head` is the middle way (llama.cpp's mixed formats keep the output weights at more bits than the
# layers for the same reason): int4 layers and an int8 head, which halves the head's bytes at int8's error. The
# headline `quant.int4_decode_speedup` stays the plain `int4` configuration (a bf16 head); these two are its
# neighbours in the trade-off.

# %% [markdown]
# ## At serving batches: labkit's kernels against the ones a practitioner would use
# Everything above is batch one, where a step reads every weight once per token and labkit's GEMVs, built around the
# bytes, win. A server decodes many sequences per step. What predicts a format's speed at more rows is two numbers:
# its **bytes per weight** (a weight read takes bytes over bandwidth, so a few rows run at the ratio of bytes: int8
# and FP8 at twice bf16's speed, int4 at the ratio of its bytes with scales) and the **tensor-core rate** its
# multiplies run at once the rows make the matmul compute-bound. A weight-only kernel (W8A16, W4A16) widens its weights to 16 bits and multiplies at
# bf16's rate, so its bound falls towards one as the batch grows; a kernel that quantises the activations too (W8A8:
# int8, FP8) multiplies on the 8-bit tensor cores at twice bf16's rate, and keeps a bound of two at every batch. The
# dashed and dotted lines of the plot are those bounds from the machine's datasheet.
#
# The measurement (`labkit.experiments.quantization.format_gemm`): one Llama-3-8B layer's four linears (fused q/k/v, o,
# fused gate/up, down) from one row to a large serving batch, every path of every format -- labkit's own, and tinygemm (gpt-fast's int4),
# `torch._int_mm`, labkit's FP8 with its activation quantisation in one Triton kernel, gemlite's W4A16 / W8A16 / W8A8,
# torchao's one-line configs and `torch.compile` of the FP8 quantisation with its GEMM -- each checked against the
# product of the weights it holds on the timed shapes, then timed in CUDA graphs over weight copies cycled past L2,
# against cuBLAS bf16 in the same run. A path that cannot be installed, built, checked or captured is a row with its
# reason. Under the `gpu` profile this runs now (a fresh `format_gemm` record of this run is reused); on the CPU the
# tables come from each GPU's committed record. The engine uses the same rows: a quantised layer takes the kernel
# that was fastest at the batch (`quantize(model, method, dispatch="measured")`, `labkit.quant.dispatch`).

# %%
from labkit.experiments.quantization import format_gemm
from labkit.data import machine_class
from labkit.hardware import KNOWN as HW

gemm_records = {}
if PROFILE == "gpu":  # the 8B and the 175B layer: notebooks 06 and 08 reuse this run's record
    gemm_records["this run"] = format_gemm.run_format_gemm(PROFILE)
else:
    for path in sorted((REPO_ROOT / "results").glob("*/records/format_gemm.json")):
        gemm_records[path.parent.parent.name] = (path.relative_to(REPO_ROOT), json.loads(path.read_text())["data"])
for where, (path, data) in gemm_records.items():
    device = data.get("device", "?")
    hw = HW.get(machine_class(device))
    print(f"{device} ({where}: {path})")
    table = pd.DataFrame(format_gemm.speedup_table(data)).set_index(["weights", "path"])
    table = table.drop(columns="library") if not table["library"].any() else table  # older records name none
    display(table.round(2))
    if hw is not None:
        bound = pd.DataFrame([{"weights": f, "multiplies": kind,
                               **{b: format_gemm.roofline_speedup(f, b, hw, kind == "W8A8") for b in (1, 16, 64, 256)}}
                              for f in ("int8", "int4", "fp8") for kind in ("weight-only", "W8A8")
                              if not (f == "int4" and kind == "W8A8")])
        print(f"the bound each path sits under ({hw.name} datasheet: bytes per weight, bf16 or 8-bit tensor cores):")
        display(bound.round(2))
    fig = format_gemm.plot_speedups(data, hw=hw, title=f"one Llama-3-8B layer's linears on {device}: speed-up over "
                                    "cuBLAS bf16 by rows (labkit's own kernel in black)")
    plt.show()
    for name, e in format_gemm.figures(data, path).items():
        print(f"  {name} = {e['value']}")
decode_runs = sorted((REPO_ROOT / "results").glob(f"*/records/{format_gemm.DECODE_RECORD}.json"))
if PROFILE == "gpu" and (output_dir() / "records" / f"{format_gemm.DECODE_RECORD}.json").exists():
    decode_runs = [output_dir() / "records" / f"{format_gemm.DECODE_RECORD}.json"]
for path in decode_runs:  # the engine's decode step per format, the kernels taken at each batch
    d = json.loads(path.read_text())
    rows = pd.DataFrame([{"weights": r["weights"], "batch": r["batch"], "step (ms)": r["replay_step_s"] * 1e3
                          if r.get("replay_step_s") else r["step_median_s"] * 1e3,
                          "kernels": ", ".join(r.get("kernels_by_layer") or {"bf16 (cuBLAS)": 0})}
                         for r in d["data"]["rows"]])
    base = rows[rows.weights == "bf16"].set_index("batch")["step (ms)"]
    rows["speed-up over bf16"] = [base[b] / t for b, t in zip(rows.batch, rows["step (ms)"])]
    print(f"engine decode steps, {d['env']['device']} ({path.name}: bench decode --formats):")
    display(rows.round(3))

# %% [markdown]
# ## Trade-off table and plot
# Accuracy from the embedded model, speed from the table above (the 8B shape on the H200 in the `gpu` profile;
# the embedded model on the CPU otherwise), memory as measured bytes of the quantised linear layers relative to
# bf16. The base is float32 (32 bits); the precision section below measures what bf16 and fp16 models do to its
# perplexity.

# %%
trade = []
for r in acc:
    if r.get("status") != "ok":
        continue
    s = pick_speed(r["method"])
    trade.append({"method": r["method"], "ppl": r["ppl"], "ppl change": r["ppl_delta_frac"],
                  "bits/weight (measured)": r["bits_per_weight"], "weight bytes vs bf16": r["weight_bytes_ratio"],
                  "decode step (ms)": s["decode_ms"] if s else None, "speed-up": s["speedup"] if s else None,
                  "timed as": (s["timing"] + (", patched" if s.get("patched") else "")) if s else None})
trade = pd.DataFrame(trade)
display(trade.round(4))

fig, ax = plt.subplots(figsize=(7, 4))
for _, row in trade.iterrows():
    bits = row["bits/weight (measured)"]
    ax.scatter(bits, row["ppl"], s=40)
    ax.annotate("fp32 (base)" if row["method"] == "base" else row["method"], (bits, row["ppl"]),
                textcoords="offset points", xytext=(5, 4), fontsize=8)
ax.set(xlabel="bits per weight held (scales included)", ylabel="held-out perplexity", xscale="log",
       title="perplexity against bytes per weight (embedded model)")
ax.set_xticks([4, 8, 16, 32], ["4", "8", "16", "32"])
ax.minorticks_off()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Precision: FP32 vs TF32 vs BF16 vs FP16 vs INT8 vs FP8
# ### Throughput of a square matmul per dtype
# The datasheet says Hopper's tensor cores run bf16/fp16 at many times fp32's rate, TF32 in between, and int8 / fp8
# at twice bf16. Measure the path you will actually call: `torch._int_mm` for int8 and `torch._scaled_mm` for
# FP8 (on the CPU, what runs runs on vector units, and a scalar reference kernel for fp8). The ratio column is
# each dtype's rate over bf16's in this run; under the `gpu` profile the int8 and FP8 ratios are recorded
# (`quant.int8_matmul_vs_bf16`, `quant.fp8_matmul_vs_bf16`). The committed GPU record's rates follow this run's.

# %%
rates = pd.DataFrame(P.dtype_matmul_rates(SIZES["matmul_size"], iters=10))
bf16_rate = rates.set_index("dtype")["tflops"].get("bf16")
rates["vs bf16"] = rates["tflops"] / bf16_rate if bf16_rate else float("nan")
display(rates.round(3))
e = figs.get("quant.int8_decode_speedup")
gpu_rates = (json.loads((REPO_ROOT / e["record"]).read_text())["data"].get("matmul_rates")
             if e and e["machine"] != "cpu" and PROFILE != "gpu" else None)
if gpu_rates:
    gpu_rates = pd.DataFrame(gpu_rates)
    gpu_rates["vs bf16"] = gpu_rates["tflops"] / gpu_rates.set_index("dtype")["tflops"]["bf16"]
    print(f"committed GPU record ({e['record']}):")
    display(gpu_rates.round(3))
ok = rates.dropna(subset=["tflops"])
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(ok["dtype"], ok["tflops"])
ax.set(ylabel="TFLOP/s (TOP/s for int8)", yscale="log",
       title=f"{SIZES['matmul_size']}^3 matmul on {'the GPU' if PROFILE == 'gpu' else 'the CPU'} (this run)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Range: where fp16 overflows and bf16 does not
# fp16 has 5 exponent bits (max 65504) and 10 mantissa bits; bf16 keeps fp32's 8 exponent bits (max 3.4e38)
# and only 7 mantissa bits. Three computations every transformer does, each in every dtype:

# %%
display(pd.DataFrame(P.dtype_limits()))
display(pd.DataFrame(P.overflow_rows()))

# %% [markdown]
# ### Accumulation: long sums in a low-precision accumulator
# Once a running sum is 2^(mantissa+1) times larger than what is added, the addition rounds away: a bf16
# accumulator stops at 256 when adding ones. `naive` keeps the running sum in the dtype; `fp32_acc` rounds the
# inputs to the dtype but accumulates in fp32, as tensor cores and every labkit kernel do.

# %%
accum = pd.DataFrame(P.accumulation_rows(SIZES["sum_lengths"]))
display(accum.pivot(index="n", columns="dtype", values=["naive_rel_error", "fp32_acc_rel_error"]))
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, grp in accum.groupby("dtype"):
    ax.plot(grp["n"], grp["naive_rel_error"], "o-", label=f"{name}, {name} accumulator")
    ax.plot(grp["n"], grp["fp32_acc_rel_error"], "x--", label=f"{name} inputs, fp32 accumulator")
ax.set(xscale="log", yscale="log", xlabel="terms summed", ylabel="mean relative error",
       title="sum of n values in [0.5, 1.5]")
ax.set_xticks(list(SIZES["sum_lengths"]), [str(n) for n in SIZES["sum_lengths"]])
ax.minorticks_off()
ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Softmax and RMSNorm in low precision
# Errors against float64 applied to the same rounded inputs. Softmax without subtracting the max overflows fp16
# once a logit exceeds ~11; a bf16 running denominator loses accuracy over long rows. RMSNorm's mean of squares
# overflows fp16 once activations reach ~256 (outlier features of large models do), collapsing the output to
# zero (error 1.0). HF's `LlamaRMSNorm` and the kernels compute both in fp32 and round the result.

# %%
display(pd.DataFrame(P.softmax_rows()).round(5))
display(pd.DataFrame(P.rmsnorm_rows()).round(5))

# %% [markdown]
# ### What each dtype does to perplexity
# The whole embedded model (weights and activations) in each dtype; HF keeps norms and softmax in fp32 inside.

# %%
dtype_ppl = P.perplexity_by_dtype(seq_len=SIZES["seq_len"], max_windows=SIZES["dtype_windows"],
                                  device=SIZES["accuracy_device"])
dtype_ppl = pd.DataFrame([{"dtype": k, "ppl": v, "ppl change": v / dtype_ppl["fp32"] - 1}
                          for k, v in dtype_ppl.items()])
display(dtype_ppl.round(5))

# %% [markdown]
# ## Record

# %%
by = {r["method"]: r for r in acc if r.get("status") == "ok"}
speed_ok = [r for r in speed if r.get("status") == "ok"]
rec = write_record("04_quantization", {
    "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in SIZES.items()},
    "accuracy_model": "embedded pydocs-llama, float32, " + SIZES["accuracy_device"],
    "speed_model": "llama-3-8b random weights, bf16, cuda" if PROFILE == "gpu" else "embedded, float32, cpu",
    "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": bw_source, "predict": predict.to_dict("records"),
    "accuracy": acc,
    "speed": speed, "trade_off": trade.to_dict("records"), "matmul_rates": rates.to_dict("records"),
    "fp8_kernel_counts": fp8_counts if PROFILE == "gpu" else None,
    "bf16_kernel_counts": bf16_counts if PROFILE == "gpu" else None,
    "overflow": P.overflow_rows(), "accumulation": accum.to_dict("records"),
    "dtype_perplexity": dtype_ppl.to_dict("records"),
})
windows = "all" if SIZES["windows"] is None else SIZES["windows"]
note = f"embedded model, held-out split ({windows} windows of {SIZES['seq_len']}), float32 baseline"
record_figure("quant.int8_ppl_delta_frac", by["int8"]["ppl_delta_frac"], "fraction", rec, bar="<= 0.005",
              note=note)
record_figure("quant.int4_rtn_ppl_delta_frac", by["int4"]["ppl_delta_frac"], "fraction", rec, bar="<= 0.05",
              note=note + ", group 128")
record_figure("quant.int4_calibrated_ppl_delta_frac", by["gptq"]["ppl_delta_frac"], "fraction", rec,
              bar=f"< int4 RTN ({by['int4']['ppl_delta_frac']:.4f})",
              note=note + f", GPTQ on {SIZES['calib_samples']} x {SIZES['calib_seq_len']} calib tokens")
if "bnb-nf4" in by:
    record_figure("quant.nf4_ppl_delta_frac", by["bnb-nf4"]["ppl_delta_frac"], "fraction", rec, bar="<= 0.05",
                  note=note + ", double quantisation")
record_figure("quant.fp8_ppl_delta_frac", by["fp8"]["ppl_delta_frac"], "fraction", rec, note=note)
if "int4+lm_head" in by:
    record_figure("quant.int4_lm_head_ppl_delta_frac", by["int4+lm_head"]["ppl_delta_frac"], "fraction", rec,
                  note=note + ", group 128, LM head in int4 too")
if "int4+int8_head" in by:
    record_figure("quant.int4_int8_head_ppl_delta_frac", by["int4+int8_head"]["ppl_delta_frac"], "fraction", rec,
                  note=note + ", group 128, LM head in int8")
if PROFILE == "gpu":
    wb = {r["method"]: r for r in speed_ok}
    wb_note = "llama-3-8b linear layers, bf16 scales, measured bytes held over the same weights in bf16"
    record_figure("quant.int8_weight_bytes_ratio", wb["int8"]["weight_bytes_ratio"], "ratio", rec, bar="<= 0.52",
                  note=wb_note)
    record_figure("quant.int4_weight_bytes_ratio", wb["int4"]["weight_bytes_ratio"], "ratio", rec, bar="<= 0.30",
                  note=wb_note)
    for m, bar in (("int8", ">= 1.6"), ("int4", ">= 2.2"), ("int4+lm_head", None), ("int4+int8_head", None)):
        s = pick_speed(m)
        if s is None and bar is None:  # a figure without a bar may be missing; a barred one may not
            print(f"{m}: no timed row")
            continue
        how = {"engine_graph": "CUDA-graph replay of labkit's engine forward (ModelRunner, preallocated paged "
                               "cache, merged projections)",
               "cuda_graph": "CUDA-graph replay of HF's static-cache forward" + (
                   ", Triton norms/SiLU/attention on both sides" if s.get("patched") else "")}.get(s["timing"],
                                                                                                  s["timing"])
        name = m.replace("+", "_")
        record_figure(f"quant.{name}_decode_speedup", s["speedup"], "x over bf16", rec, bar=bar,
                      note=f"llama-3-8b, batch 1, context {SIZES['context']}, {how}; bf16 step "
                      f"{s['decode_ms'] * s['speedup']:.2f} ms, {m} {s['decode_ms']:.2f} ms")
        hf = [r for r in speed_ok if r["method"] == m and r["timing"] == "cuda_graph" and r.get("patched")]
        if hf and s is not hf[0]:
            record_figure(f"quant.{name}_decode_speedup_hf", hf[0]["speedup"], "x over bf16", rec,
                          note=f"llama-3-8b, batch 1, context {SIZES['context']}, CUDA-graph replay of HF's "
                          f"static-cache forward with labkit's Triton norms/SiLU/attention on both sides")
    fp8 = pick_speed("fp8")
    if fp8 is not None:
        record_figure("quant.fp8_decode_speedup", fp8["speedup"], "x over bf16", rec,
                      note=f"llama-3-8b, batch 1, context {SIZES['context']}, FP8 W8A8 (Fp8Linear: per-token "
                      f"activation scales in eager torch, torch._scaled_mm), {fp8['timing']}")
    if fp8_counts is not None:
        trace_note = "llama-3-8b engine decode step, batch 1, every kernel of a profiler trace (kernel_counts)"
        record_figure("quant.fp8_kernels_per_step", fp8_kernels, "kernels", rec, note=trace_note)
        record_figure("quant.bf16_kernels_per_step", bf16_kernels, "kernels", rec, note=trace_note)
        record_figure("quant.fp8_gemm_ms_over_bf16_step", gemm / bf16_step_ms, "fraction", rec,
                      note=trace_note + ": the FP8 GEMMs' device time over the whole bf16 step's time")
    mm_rates = rates.set_index("dtype")["vs bf16"]
    for d in ("int8", "fp8"):
        if mm_rates.get(d) == mm_rates.get(d):
            record_figure(f"quant.{d}_matmul_vs_bf16", mm_rates[d], "x bf16 rate", rec,
                          note=f"{SIZES['matmul_size']}^3 matmul, "
                          f"{'torch._int_mm' if d == 'int8' else 'torch._scaled_mm'} against bf16 in the same run")
else:
    wb_note = "embedded model linear layers, float32 scales, measured bytes held over the same weights in bf16"
    record_figure("quant.int8_weight_bytes_ratio", by["int8"]["weight_bytes_ratio"], "ratio", rec, bar="<= 0.52",
                  note=wb_note)
    record_figure("quant.int4_weight_bytes_ratio", by["int4"]["weight_bytes_ratio"], "ratio", rec, bar="<= 0.30",
                  note=wb_note)
SETTINGS = ("quant.overflow_cases", "quant.accum_terms")  # how many cases and terms were tried: configuration
for name, value in P.precision_figures(P.overflow_rows(), accum.to_dict("records"),
                                      dtype_ppl.to_dict("records")).items():  # follow-up three's numerics
    unit = "cases" if name.endswith("_cases") else "terms" if name.endswith("_terms") else "relative"
    record_figure(name, value, unit, rec, derived=name in SETTINGS,
                  note="the precision section of this notebook: overflow cases, running sums, the model per dtype")
print(f"record: {rec}")

# %% [markdown]
# ## Takeaways
# Each sentence is rendered from the figures of this run and of each GPU in `results/summary.json`, and checked on
# each (`python -m labkit claims`): accuracy on the embedded model, speed and bytes on the Llama-3-8B shape, each
# speed-up over the bf16 step timed the same way (labkit's engine, CUDA-graph replays, batch 1, context 512).

# %%
show(
    Claim("int8 weight-only moves held-out perplexity by {quant.int8_ppl_delta_frac:.3%}: below the 0.5% bar.",
          "quant.int8_ppl_delta_frac < 0.005", machine="gpu"),
    Claim("FP8 on weights and activations moves it by {quant.fp8_ppl_delta_frac:.2%}: more than weight-only int8 "
          "({quant.int8_ppl_delta_frac:.3%}), still under 0.5%.",
          "quant.int8_ppl_delta_frac < quant.fp8_ppl_delta_frac < 0.005", machine="gpu"),
    Claim("4-bit costs more than int8: plain round-to-nearest int4 {quant.int4_rtn_ppl_delta_frac:.1%}, GPTQ with the "
          "same bits and kernel {quant.int4_calibrated_ppl_delta_frac:.1%}, both under 5%: calibration lowers the "
          "error at the same bytes.", "quant.int8_ppl_delta_frac < quant.int4_calibrated_ppl_delta_frac < "
          "quant.int4_rtn_ppl_delta_frac < 0.05", machine="gpu"),
    Claim("bitsandbytes NF4, with no calibration, lands at {quant.nf4_ppl_delta_frac:.2%}: below round-to-nearest "
          "int4's {quant.int4_rtn_ppl_delta_frac:.2%} and {quant.nf4_ppl_delta_frac:if < "
          "quant.int4_calibrated_ppl_delta_frac then below else level with or above} GPTQ's "
          "{quant.int4_calibrated_ppl_delta_frac:.2%} on this model: a grid placed where normal weights fall recovers "
          "most of what calibration does.",
          "quant.nf4_ppl_delta_frac < quant.int4_rtn_ppl_delta_frac", machine="gpu"),
    Claim("Quantising the LM head to int4 as well raises int4's change to {quant.int4_lm_head_ppl_delta_frac:.1%}, "
          "over 1.5x the {quant.int4_int8_head_ppl_delta_frac:.1%} of an int8 head.",
          "quant.int4_lm_head_ppl_delta_frac > 1.5 * quant.int4_int8_head_ppl_delta_frac", machine="gpu"),
    Claim("Measured with scales: int8 holds {quant.int8_weight_bytes_ratio:.3f} and int4 "
          "{quant.int4_weight_bytes_ratio:.3f} of the bf16 weight bytes of Llama-3-8B's linears (bars: 0.52 and 0.30).",
          "quant.int8_weight_bytes_ratio <= 0.52 and quant.int4_weight_bytes_ratio <= 0.3", machine="gpu"),
    Claim("At batch 1 the int8 decode step runs {quant.int8_decode_speedup:.2f}x and the int4 step "
          "{quant.int4_decode_speedup:.2f}x the bf16 step (labkit's engine).",
          "quant.int4_decode_speedup > quant.int8_decode_speedup > 1", machine="gpu"),
    Claim("Neither step reaches its bytes ratio: int8 runs {quant.int8_decode_speedup:.2f}x where its linears hold "
          "{quant.int8_weight_bytes_ratio:.3f} of the bytes, int4 {quant.int4_decode_speedup:.2f}x where they hold "
          "{quant.int4_weight_bytes_ratio:.3f}.",
          "quant.int8_decode_speedup < 1 / quant.int8_weight_bytes_ratio and "
          "quant.int4_decode_speedup < 1 / quant.int4_weight_bytes_ratio", machine="gpu"),
    Claim("Through HF's forward (labkit's norms and attention patched in on both sides) the same weights give "
          "{quant.int8_decode_speedup_hf:.2f}x for int8 and {quant.int4_decode_speedup_hf:.2f}x for int4: less than "
          "in the engine's step built around the fused GEMVs.",
          "quant.int8_decode_speedup_hf < quant.int8_decode_speedup and "
          "quant.int4_decode_speedup_hf < quant.int4_decode_speedup", machine="gpu"),
    Claim("The LM head is the last bf16 weight of an int4 step: an int8 head lifts the step to "
          "{quant.int4_int8_head_decode_speedup:.2f}x and an int4 head to {quant.int4_lm_head_decode_speedup:.2f}x.",
          "quant.int4_decode_speedup < quant.int4_int8_head_decode_speedup < quant.int4_lm_head_decode_speedup",
          machine="gpu"),
    Claim("labkit's own kernels win at one row and lose at 256: int8 runs {quant.int8_labkit_gemm_speedup_b1:.2f}x "
          "then {quant.int8_labkit_gemm_speedup_b256:.2f}x bf16's linears, int4 {quant.int4_labkit_gemm_speedup_b1:.2f}x "
          "then {quant.int4_labkit_gemm_speedup_b256:.2f}x: bytes decide a few rows, the tensor cores many.",
          "quant.int8_labkit_gemm_speedup_b1 > 1 > quant.int8_labkit_gemm_speedup_b256 and "
          "quant.int4_labkit_gemm_speedup_b1 > 1 > quant.int4_labkit_gemm_speedup_b256", machine="gpu"),
    Claim("At sixty-four rows the fastest int4 path measured ({quant.int4_best_path_b64}) runs "
          "{quant.int4_best_gemm_speedup_b64:.2f}x bf16 under a bound of {quant.int4_roofline_speedup_b64:.1f}x "
          "({quant.int4_best_gemm_speedup_b64:if >= 1 then ahead of else behind} bf16; labkit's int4 "
          "{quant.int4_labkit_gemm_speedup_b64:.2f}x), and the fastest FP8 path ({quant.fp8_best_path_b64}) "
          "{quant.fp8_best_gemm_speedup_b64:.2f}x under {quant.fp8_roofline_speedup_b64:.1f}x "
          "({quant.fp8_best_gemm_speedup_b64:if >= 1.3 then past else short of} the 1.3x bar).",
          "quant.int4_best_gemm_speedup_b64 < quant.int4_roofline_speedup_b64 and "
          "quant.fp8_best_gemm_speedup_b64 < quant.fp8_roofline_speedup_b64", machine="gpu"),
    Claim("Through the engine, each layer on the kernel measured fastest at its batch, int4 decodes "
          "{quant.int4_decode_speedup_b16:.2f}x bf16's step at batch sixteen ({quant.int4_decode_speedup_b16:if >= 2 "
          "then meeting else short of} the 2x bar) and FP8 {quant.fp8_decode_speedup_b64:.2f}x at sixty-four "
          "({quant.fp8_decode_speedup_b64:if >= 1.2 then meeting else short of} 1.2x): each under the ratio of the "
          "bytes its step reads ({quant.int4_decode_floor_ratio_b16:.2f}x and {quant.fp8_decode_floor_ratio_b64:.2f}x).",
          "quant.int4_decode_speedup_b16 < quant.int4_decode_floor_ratio_b16 and "
          "quant.fp8_decode_speedup_b64 < quant.fp8_decode_floor_ratio_b64", machine="gpu"),
    Claim("int4's speed-up is not free: at {quant.int4_decode_speedup:.2f}x it costs "
          "{quant.int4_rtn_ppl_delta_frac:.1%} perplexity, over ten times the {quant.int8_ppl_delta_frac:.3%} that "
          "int8's {quant.int8_decode_speedup:.2f}x costs.",
          "quant.int4_rtn_ppl_delta_frac > 10 * quant.int8_ppl_delta_frac", machine="gpu"),
)

# %% [markdown]
# * **Bytes are the lever for decode, the kernel decides whether they pay.** Without fused kernels (the torch
#   path, bitsandbytes) the quantised layers are slower than bf16; with them, the step moves towards its bytes.
# * **FP8 W8A8 at batch 1 is a lesson in kernels per step**: the section above counts them from a trace. Use it
#   where the GEMMs are compute-bound (prefill, large batches), with the activation quantisation fused.
# * **Precision for compute:** bf16 has fp32's range (no overflow in norms, softmax, long dot products); fp16's
#   extra mantissa bits do not pay for its 65504 ceiling without loss scaling. Accumulate in fp32 and keep
#   softmax/RMSNorm statistics in fp32, whatever the storage dtype. INT8 and FP8 *compute* help only through a
#   kernel that reaches their rate: the matmul table shows what `torch._int_mm` and `torch._scaled_mm` reach here.
# * **When to choose which:** serving at small batch: int4 weights (GPTQ/AWQ) with fused kernels, or int8 when
#   accuracy must not move; fine-tuning: bf16 weights with fp32 master copies and accumulation (NF4 base weights
#   for QLoRA); fp32 only as the reference.
