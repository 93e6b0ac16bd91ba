# %% [markdown]
# # 03 · Faster transformer layers: fused Triton kernels against the hardware limit
#
# **The question.** The scenario's second area is computation: *how do we make the transformer layers
# themselves faster?* Hint 1 separates memory-bound operations (KV-cache reads, norms, activations, decode
# GEMVs) from compute-bound ones (prefill matmuls and attention); hint 2 asks how hardware-level work
# (Tensor Cores, custom kernels) compares with algorithmic changes (KV-cache quantisation).
#
# This notebook answers with `labkit.kernels`: RMSNorm (+ the residual add), SwiGLU's `silu_and_mul`, RoPE,
# softmax, FlashAttention, paged decode attention (with a split-context path and int8 KV), and weight-only
# int8/int4 matmuls -- each checked against a torch reference, timed against torch eager, `torch.compile`,
# SDPA and bitsandbytes, and reported as a fraction of the ceilings measured on the same device.
#
# Profiles: `ci`/`cpu` run every kernel through Triton's CPU interpreter (the timings measure Python, not the
# kernels; they show the paths run and are correct), `gpu` runs the sizes in bf16 on the H200.

# %% tags=["parameters"]
profile = "auto"
seed = 0
use_compile = True

# %%
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)

import matplotlib.pyplot as plt
import pandas as pd
import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET on a CPU-only host before triton is imported)
from labkit.bench import record_figure, write_record
from labkit.evaluate import relative_error
from labkit.experiments.kernels import bench as kb
from labkit.experiments.kernels.study import (FUSION_BYTES, decode_steps, kv_quant_attention, matmul_rates,
                                             operator_costs)
from labkit.hardware import measure_ceilings
from labkit.kernels.patch import patch_model, patch_summary, unpatch
from labkit.models import load_model, random_model

torch.manual_seed(seed)
DEVICE = torch.device("cuda" if PROFILE == "gpu" else "cpu")
DTYPE = torch.bfloat16 if PROFILE == "gpu" else torch.float16  # bf16 tl.dot is wrong under the interpreter
SIZES = {
    "ci": dict(per_kernel=1, iters=2, decode_batches=[2], decode_context=16, kv=(2, 4, 2, 64, 100),
               matmul_n=128, new_tokens=4),
    "cpu": dict(per_kernel=2, iters=3, decode_batches=[1, 4], decode_context=64, kv=(4, 8, 2, 64, 512),
                matmul_n=512, new_tokens=16),
    "gpu": dict(per_kernel=3, iters=20, decode_batches=[1, 32], decode_context=4096, kv=(32, 32, 8, 128, 4096),
                matmul_n=8192, new_tokens=32),
}[PROFILE]
SWEEP = {k: v[: SIZES["per_kernel"]] for k, v in kb.SIZES[PROFILE].items()}
print(PROFILE, DEVICE, DTYPE, SIZES)
pd.set_option("display.width", 160)

# %% [markdown]
# ## Predict: which operators are memory-bound, and what fusion can save
# An operator is memory-bound when its FLOPs per byte moved fall below the ridge point (measured matmul rate
# over measured copy bandwidth, about 190 FLOP/byte on the H200). Then its time is bytes / bandwidth, and the
# only ways to speed it up are to move fewer bytes (fusion, quantisation) or to move them closer to the
# bandwidth limit. The table uses one Llama-3-8B layer: 16k tokens for the elementwise operators, 4 x 4096
# prefill tokens for attention, 32 sequences of 4096 cached tokens for decode attention.

# %%
ceilings = measure_ceilings(DEVICE)
bw, peak = ceilings["copy_bytes_per_s"], ceilings["matmul_flops"]
print(f"{ceilings['device']}: copy {bw / 1e12:.3f} TB/s, {ceilings['matmul_dtype']} matmul {peak / 1e12:.1f} "
      f"TFLOP/s, ridge {ceilings['ridge_flop_per_byte']:.0f} FLOP/byte (measured now)")
costs = pd.DataFrame(operator_costs("llama-3-8b", bandwidth=bw, peak_flops=peak))
display(costs.round(2))

# %% [markdown]
# **Why fusion wins.** Eager torch runs each elementwise operator as several kernels, each reading and writing
# the whole tensor (RMSNorm in bf16 with float32 statistics: cast, square, mean, scale, cast back, weight --
# 36 bytes per element). One fused kernel reads the input once and writes the output once (4 bytes). For a
# memory-bound operator the predicted speed-up is the ratio of bytes.

# %%
fusion = pd.DataFrame([{"operator": k, "eager bytes/elem": v["eager"], "fused bytes/elem": v["fused"],
                        "eager kernels": v["eager_passes"], "predicted speed-up": v["eager"] / v["fused"]}
                       for k, v in FUSION_BYTES.items()])
display(fusion)

# %% [markdown]
# ## Baseline and technique: every kernel against torch on the same inputs
# Memory-bound rows report GB/s and the fraction of measured copy bandwidth; attention reports TFLOP/s and
# the fraction of the measured bf16 matmul rate. The memory-bound kernels, paged attention and the GEMVs are
# timed as CUDA-graph replays, every implementation alike: that is the device's time for the kernel, without the
# host's cost of launching it from Python (an autotuned Triton kernel's dispatch alone takes tens of microseconds
# on the host, and a single launch timed with CUDA events counts it whenever the GPU has nothing queued). Prefill
# attention, long enough for that not to matter, is timed as CUDA-event medians with L2 flushed.

# %%
from tqdm.auto import tqdm

rows = []
jobs = [(k, shape, i) for k, shapes in SWEEP.items() for i, shape in enumerate(shapes)]
for kname, shape, i in tqdm(jobs, desc="kernels", unit="case"):
    compile_ = use_compile and PROFILE == "gpu" and i == 0 and kname == "rmsnorm"  # compile is slow to build
    rows += kb.BENCHES[kname](shape, DTYPE, DEVICE, iters=SIZES["iters"], compile_=compile_)
rows = kb.add_fractions(rows, ceilings)
table = pd.DataFrame(rows)
show_cols = ["kernel", "impl", "shape", "median_us", "gb_s", "tflop_s", "frac_of_ceiling", "rel_err", "method"]
display(table[show_cols].round(4))

# %% [markdown]
# ## Correctness: each kernel against its reference, and the patched model token for token
# Relative errors (`||out - ref|| / ||ref||`) of the Triton rows above are bounded by DESIGN.md's tolerances
# for the dtype (1e-2 in bf16/fp16; int4/int8 rows against the same quantised weights dequantised). Then
# `patch_model` swaps the embedded model's RMSNorms, MLP activations and attention for the kernels, and its
# greedy output in float32 must equal the original's token for token.

# %%
for r in rows:
    if r["rel_err"] is not None:
        assert r["rel_err"] < 1e-2, (r["kernel"], r["shape"], r["rel_err"])
print("all kernel errors within tolerance; largest:",
      max((r["rel_err"], r["kernel"]) for r in rows if r["rel_err"] is not None))

tiny, tok = load_model(device=DEVICE)
ids = tok('def read_file(path):\n    """Return', return_tensors="pt").input_ids.to(DEVICE)
with torch.no_grad():
    ref_tokens = tiny.generate(ids, max_new_tokens=SIZES["new_tokens"], do_sample=False)
    ref_logits = tiny(ids).logits
    patch_model(tiny)
    print(patch_summary(tiny))
    got_tokens = tiny.generate(ids, max_new_tokens=SIZES["new_tokens"], do_sample=False)
    logits_err = relative_error(tiny(ids).logits, ref_logits)
    unpatch(tiny)
assert torch.equal(got_tokens, ref_tokens)
print(f"patched greedy output identical ({SIZES['new_tokens']} tokens); logits rel. error {logits_err:.1e}")
print(repr(tok.decode(got_tokens[0])))

# %% [markdown]
# ## Measure again: fusion's predicted speed-up against the measured one

# %%
pairs = {"rmsnorm": ("eager", "triton"), "add_rmsnorm": ("eager_add_then_norm", "triton_fused_residual"),
         "swiglu": ("eager", "triton"), "rope": ("eager", "triton"), "softmax": ("eager", "triton")}
fusion_rows = []
for op, (slow, fast) in pairs.items():
    kname = "rmsnorm" if op == "add_rmsnorm" else op
    head = "x".join(map(str, SWEEP[kname][0]))
    a, b = kb.pick_row(rows, kname, slow, head), kb.pick_row(rows, kname, fast, head)
    fusion_rows.append({"operator": op, "shape": head, "eager us": a["median_us"], "triton us": b["median_us"],
                        "measured speed-up": a["median_us"] / b["median_us"],
                        "predicted speed-up": FUSION_BYTES[op]["eager"] / FUSION_BYTES[op]["fused"],
                        "triton frac of bandwidth": b["frac_of_ceiling"]})
fusion_measured = pd.DataFrame(fusion_rows)
display(fusion_measured.round(3))

# %% [markdown]
# ## Tensor Cores against CUDA cores: the same matmul in float32 and bfloat16
# Compute-bound work (prefill, training) is where the Tensor Cores matter: the same product in float32 on CUDA
# cores, in TF32, and in bfloat16.

# %%
mm = pd.DataFrame(matmul_rates(SIZES["matmul_n"], DEVICE))
display(mm.round(3))

# %% [markdown]
# ## The attention kernels
# FlashAttention keeps the score matrix on chip (compute-bound, so TFLOP/s against SDPA's flash backend);
# paged decode attention is a gather over the block table (memory-bound, so bandwidth), with the split-context
# path for few sequences of long context.

# %%
att = table[table.kernel.isin(["flash", "paged"])][["kernel", "impl", "shape", "median_us", "tflop_s", "gb_s",
                                                   "frac_of_ceiling"]]
display(att.round(3))

# %% [markdown]
# ## Weight-only quantised GEMV: bytes are the time
# At batch 1 a linear layer reads every weight once for 2 FLOPs each. int8 halves the bytes and int4 quarters
# them -- if the dequantisation happens in registers. Dequantising to a bf16 copy first (the torch path) and
# bitsandbytes (LLM.int8 and NF4 kernels built for memory savings) show the other outcome. Every implementation
# cycles through several copies of its weights (`weight_sets`), as a decode step reads each layer's weights
# once: 31 MB of int4 would otherwise stay in the H200's 50 MB L2 between replays and time the cache, not HBM.
#
# Bytes are only the floor. The GEMVs hit two other limits on the way (`research/gemv_study.py` and ncu, in
# `results/h200/NOTES.md`): instruction issue -- each weight must become a float, be multiplied and be added,
# so int8 decodes bytes in place with one logic op and int4 turns nibble pairs into float16 pairs and
# multiplies them two at a time -- and latency, where too few warps fit on an SM to keep enough loads in flight.
# Which one binds is an experiment, not a guess: keeping two words' products in the same float16 lanes before
# converting to float32 (word pairs, on by default) cut the int4 loop's instructions by 11% and the GEMV's time
# at 4096 -> 14336 by 1% (records/gemv_study_pairs_f65fe09.json): at that size latency binds, not issue.
# The int4 GEMV keeps its activations *stationary*: each program prepares one slice of 512 activations once and
# walks down its rows with the next block's weights already in flight, instead of preparing the activations again
# for every block of rows (records/gemv_study_xs_2748180.json: 10-20% faster at four of the five 8B shapes).
# Registers decide how many warps an SM can hold, and they depend on the compiler, not only on the code: with the
# weights loaded as a 3-D `[rows, groups, words]` tile, the H200 image's Triton 3.6 put threads across rows, so
# each thread held the activations of every group -- 128 registers, 16 warps per SM at most (ncu: "Block Limit
# Registers 8", results/h200/logs/2026-12-04c_call2_ncu.log) -- where Triton 3.9 compiled the same source to 72.
# Loading the weights as 2-D rows and viewing them as 3-D only for the math gives 68-96 under both
# (results/cpu/records/sass_xs.json, `research/sass_report.py`). Check register counts with the compiler the GPU runs.
#
# The int8 GEMV has a stationary version too (`w8_triton_stationary`, figure
# `kernels.w8_stationary_gemv_speedup_vs_bf16`): what the engine's fused int8 layers run, since it takes in a
# layer's norms and adds as the int4 one does. It multiplies in packed float16 as well: a byte permute lays two
# int8 weights under a float16 exponent (1152 + q), one subtract makes them exact, and each instruction then
# multiplies two weights. The row beside the split-K `w8_triton` says whether the bare int8 product should switch.
#
# What is left between the int4 GEMV and its bytes (results/h200/NOTES.md, third session of 2026-12-04): across
# the 8B shapes its time is about 4 us fixed plus the bytes at ~3.2 TB/s. Half of the fixed part is the end of
# split-K -- a fence, an atomic counter and the last program's loads, one memory round trip after another
# (without them, wrong sums, timing only: 13.6 -> 12.1 us at 4096 -> 14336). Where N is small, programs that own
# the whole of K avoid it (k/v 6.2 -> 5.6 us). Programmatic dependent launch, which lets a kernel start its
# weight loads while the kernel ahead is still finishing, took 0.4-0.8 us off a GEMV that follows another GEMV --
# and *added* 0.3-0.8 us after any other kernel (an RMSNorm, SwiGLU). Once a layer's norms, adds and SwiGLU run
# inside its int4 GEMVs (notebook 04), a decode step is GEMV after GEMV, with attention releasing the next launch
# as it starts: there the engine launches them this way by default, and notebook 04 measures what it buys
# (`quant.int4_gemv_pdl_speedup`). This benchmark times plain launches.
#
# How far can a ratio over bitsandbytes go? No GEMV beats the time its weights take to read. The figures
# `kernels.w8_vs_bnb_int8_at_copy_bw` and `kernels.w4_vs_bnb_nf4_at_copy_bw` divide bitsandbytes' time by that
# floor (labkit's bytes over the copy bandwidth measured above): the ratio labkit's GEMV would reach if it read
# its weights at the copy rate. Where that is below a bar, the bar cannot be met by a faster kernel, only by a
# slower baseline. The copy rate is a measurement, and a read-only stream can beat it a little; the vendor's
# peak cannot be beaten (4.8 TB/s on the H200's datasheet), so `kernels.w8_vs_bnb_int8_at_datasheet_bw` and
# `kernels.w4_vs_bnb_nf4_at_datasheet_bw`, the same ratios at that peak, are hard ceilings: a bar above one is
# out of reach of any kernel on this part (empty where `labkit.hardware` has no datasheet row for the device).
#
# The copy rate is measured on a large buffer, and a kernel of a few tens of megabytes pays more than its bytes:
# the launch, the first loads' latency before the stream fills, the tail where the last programs run alone. The
# rows `w4_bytes_read` and `w8_bytes_read` time a kernel that only reads as many bytes as each format's weights
# (`labkit.experiments.kernels.stream_read`, the fastest of three shapes, cycling through weight sets like the
# GEMVs): the floor for any kernel of that size on this machine. `kernels.w4_gemv_frac_of_read_floor` is how close
# the int4 GEMV comes to it, and the `*_at_read_floor` figures are the bitsandbytes ratios a GEMV that fast would
# reach.

# %%
gemv = table[table.kernel == "gemv"][["impl", "shape", "median_us", "gb_s", "frac_of_ceiling", "rel_err",
                                      "method"]]
display(gemv.round(3))
head = "x".join(map(str, SWEEP["gemv"][0]))
sub = gemv[gemv["shape"] == head]
fig, ax = plt.subplots(figsize=(7, 3))
ax.barh(sub["impl"], sub["median_us"])
ax.set(xlabel="microseconds (lower is better)", title=f"linear {head} (rows x in x out), {DTYPE}")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## What patching does to a decode step, end to end
# One decode step of a Hugging Face Llama with a static KV cache, plain and patched with the kernels. On the
# GPU it is Llama-3-8B's architecture in bf16 (random weights: speed does not depend on their values), captured
# once and timed as CUDA-graph replays, so launch overhead does not hide the kernels. On the CPU it is the
# embedded model, and the patched step runs through the interpreter (slower by construction).

# %%
if PROFILE == "gpu":
    big = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=seed)
else:
    big = tiny
steps = pd.DataFrame(decode_steps(big, SIZES["decode_batches"], SIZES["decode_context"], iters=SIZES["iters"]))
display(steps.round(3))

# %% [markdown]
# ## Custom kernels against an algorithmic change: int8 KV on the same step
# KV-cache quantisation halves the bytes decode attention reads. Whether that helps depends on a kernel that
# reads the int8 cache directly: dequantising to bf16 first reads int8, writes bf16 and reads it again.
# Measured for one layer's attention at the largest decode batch, then carried over to the step: the
# estimated step replaces each layer's bf16 attention time by the int8 kernel's (an estimate from measured
# parts, labelled as such).

# %%
seqs, heads, kv_heads, head_dim, context = SIZES["kv"]
kvq = pd.DataFrame(kv_quant_attention(seqs, heads, kv_heads, head_dim, context, dtype=DTYPE, device=DEVICE,
                                      iters=SIZES["iters"]))
display(kvq.round(4))
layers = big.config.num_hidden_layers
big_step = steps.iloc[-1]
saved_ms = layers * (kvq["us"][0] - kvq["us"][1]) / 1e3
tradeoff = pd.DataFrame([
    {"step": "plain HF (SDPA, eager norms)", "ms": big_step["plain ms"], "source": "measured"},
    {"step": "patched (Triton norms, SwiGLU, attention)", "ms": big_step["patched ms"], "source": "measured"},
    {"step": "patched + int8 KV read in the kernel", "ms": big_step["patched ms"] - saved_ms,
     "source": f"estimate: patched - {layers} x attention saving"},
])
tradeoff["batch"], tradeoff["context"] = big_step["batch"], big_step["context"]
display(tradeoff.round(3))

# %% [markdown]
# ## Trade-offs
# | technique | accuracy | latency | memory |
# | --- | --- | --- | --- |
# | fused elementwise kernels (RMSNorm+residual, SwiGLU, RoPE) | exact in fp32 (greedy tokens identical); bf16 rounding as eager | the operator's time drops by the bytes ratio; a small share of a decode step | none |
# | FlashAttention | same math, different summation order (1e-2 bf16 bound) | prefill attention at Tensor-Core rate; no S x S matrix | O(S) instead of O(S^2) activations |
# | paged decode attention (+ split context) | exact (fp32 accumulation) | near bandwidth for long contexts | enables paging (no fragmentation) |
# | int8 / int4 weights (fused dequant) | weights rounded (perplexity: notebook on quantisation) | GEMV time by bytes: up to 2x / 4x | 2x / 4x smaller weights |
# | int8 KV (dequant in kernel) | per-token-head rounding (~1e-2 relative) | attention bytes halved | KV cache halved: more sequences per GPU |

# %%
figures = kb.headline_figures(rows, PROFILE)
rec = write_record("03_kernels", {"profile": PROFILE, "dtype": str(DTYPE), "ceilings": ceilings,
                                  "sweep_sizes": SWEEP, "rows": rows, "fusion": fusion_rows,
                                  "matmul_rates": mm.to_dict("records"), "decode_steps": steps.to_dict("records"),
                                  "kv_quant_attention": kvq.to_dict("records"),
                                  "tradeoff": tradeoff.to_dict("records"), "figures": figures,
                                  "patched_logits_rel_err": logits_err})
for name, value in figures.items():
    unit = "fraction" if name.endswith("_frac") else "x"
    note = f"{PROFILE} profile, {DTYPE}, sizes {dict((k, v[0]) for k, v in SWEEP.items())}"
    if PROFILE != "gpu":
        note += "; CPU interpreter: times Python, not the kernels"
    if value == value:  # NaN where a baseline is absent (bitsandbytes on the CPU)
        record_figure(name, value, unit, rec, bar=kb.BARS[name], note=note)
    print(f"{name:36s} {value:8.3f}   bar {kb.BARS[name] or '-'}")
kb.plot_rows(rows, show=True)

# %% [markdown]
# ## Takeaways
# * Measure the bound first. Norms, activations, RoPE, decode attention and batch-1 linears are memory-bound:
#   their time is bytes over bandwidth, and a kernel is done when it reaches most of the measured copy rate.
# * Fusion pays by the bytes it removes: RMSNorm moves 9x fewer bytes fused than eager, SwiGLU 1.7x, and
#   torch's softmax is already one kernel (no gain to be had).
# * Compute-bound work belongs on Tensor Cores: bf16 matmul runs an order of magnitude above float32 on CUDA
#   cores, and FlashAttention keeps attention there without the S x S matrix.
# * At decode the weights and the KV cache dominate the bytes: fused elementwise kernels barely move a decode
#   step, fewer bytes do -- int4/int8 weights read by a fused GEMV, and int8 KV read by the attention kernel.
#   An algorithmic change (quantised KV) only pays when a kernel reads the compact format directly.
