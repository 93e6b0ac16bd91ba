# %% [markdown]
# # 03 · Faster transformer layers: fused Triton kernels against the hardware limit
#
# **The question.** The scenario's second area is computation: *how do we make the transformer layers
# themselves faster?* Hint 1 separates memory-bound operations (norms, activations, KV-cache reads, decode
# GEMVs) from compute-bound ones (prefill matmuls and attention). For a memory-bound operator the answer is
# arithmetic: its time cannot drop below *bytes moved / bandwidth*, so a kernel is finished when it reaches that
# floor, and the only way past it is to move fewer bytes (fusion, smaller formats).
#
# **How this notebook answers it.** (1) Predict each operator's bound from its FLOPs and bytes. (2) Read one
# kernel line by line -- the fused residual add + RMSNorm that runs twice in every Llama layer -- and measure it
# against the copy bandwidth. (3) Measure every labkit kernel against the baseline a user would pick (torch eager,
# `torch.compile`, SDPA's cuDNN and flash backends, cuBLAS, bitsandbytes) with a correctness gate, then patch the
# kernels into the embedded model and check its greedy output token for token. (4) A trade-off table and the
# takeaways, each number checked against `results/summary.json`.
#
# Profiles: `ci`/`cpu` run every kernel through Triton's CPU interpreter (their timings measure Python, not the
# kernels: they prove the paths run and are correct); `gpu` runs the sizes below in bf16. Register allocation,
# programmatic dependent launch, split-K and the GEMV studies are in `notebooks/appendix/kernel_lore.md`.

# %% tags=["parameters"]
profile = "auto"
seed = 0
use_compile = True

# %%
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)

import inspect
import json

import matplotlib.pyplot as plt
import pandas as pd
import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET on a CPU-only host before triton is imported)
from labkit.bench import record_figure, write_record
from labkit.claims import Claim, show
from labkit.evaluate import relative_error
from labkit.experiments.kernels import bench as kb
from labkit.experiments.kernels.study import (FP8_ATTN_FIGURE, FUSION_BYTES, INT8_ATTN_FIGURE, INT8_ATTN_SHAPE,
                                             KV_ROUNDING_BOUND, decode_step_figures, decode_steps,
                                             fp8_attention_speedup, int8_attention_speedup, kv_quant_attention,
                                             kv_quant_attention_sweep, matmul_rates, norm_sweep, operator_costs,
                                             plot_bandwidth, plot_kv_quant_sweep)
from labkit.experiments.quantization.metrics import peak_allocated
from labkit.figures import committed_figures
from labkit.hardware import measure_ceilings
from labkit.kernels.patch import patch_model, patch_summary, unpatch
from labkit.kernels.rms_norm import _rms_norm_kernel, rms_norm_ref
from labkit.data import REPO_ROOT
from labkit.model import human_bytes, load_model, random_model

torch.manual_seed(seed)
DEVICE = torch.device("cuda" if PROFILE == "gpu" else "cpu")
DTYPE = torch.bfloat16 if PROFILE == "gpu" else torch.float16  # bf16 tl.dot is wrong under the interpreter
SIZES = {
    "ci": dict(iters=2, norm_rows=[7, 37], norm_hidden=256, decode_batches=[2], decode_context=16,
               kv=dict(seqs=2, heads=4, kv_heads=2, head_dim=64, context=100), matmul_n=128, new_tokens=4,
               kv_sweep=dict(contexts=(16, 32, 64), seqs=1, heads=2, kv_heads=1, head_dim=16, iters=1)),
    "cpu": dict(iters=2, norm_rows=[16, 64, 256], norm_hidden=1024, decode_batches=[1], decode_context=64,
                kv=dict(seqs=2, heads=4, kv_heads=2, head_dim=64, context=128), matmul_n=512, new_tokens=8,
                kv_sweep=dict(contexts=(32, 64, 128, 256), seqs=2, heads=4, kv_heads=2, head_dim=64, iters=2)),
    "gpu": dict(iters=20, norm_rows=[1, 16, 64, 256, 1024, 4096, 16384], norm_hidden=4096, decode_batches=[1, 32],
                decode_context=4096, kv=INT8_ATTN_SHAPE, matmul_n=8192, new_tokens=32,
                kv_sweep=dict(contexts=(1024, 2048, 4096, 8192, 16384, 32768), seqs=16, heads=32, kv_heads=8,
                              head_dim=128, iters=20)),
}[PROFILE]
# each kernel at its headline size; the interpreter times Python whatever the size, so the CPU takes the smallest
SIZE_KEY = "gpu" if PROFILE == "gpu" else "ci"
SWEEP = {k: v[:1] for k, v in kb.SIZES[SIZE_KEY].items()}
print(PROFILE, DEVICE, DTYPE, SIZES)
pd.set_option("display.width", 160)
summary = committed_figures()  # each figure's committed value, a GPU's first


def gpu_record(figure):
    """The committed GPU record that holds ``figure`` (what the H200 measured), or None."""
    e = summary.get(figure)
    return json.loads((REPO_ROOT / e["record"]).read_text()) if e and e["machine"] != "cpu" else None

# %% [markdown]
# ## Predict: which operators are memory-bound
# An operator is memory-bound when its FLOPs per byte fall below the *ridge point*: the measured matmul rate over
# the measured copy bandwidth. Its time is then bytes / bandwidth. The table takes one Llama-3-8B layer at
# serving sizes (16k tokens for the elementwise operators, 4 x 4096 prefill tokens for attention, 32 sequences of
# 4096 cached tokens for decode attention) and the ceilings measured on this device now.

# %%
ceilings = measure_ceilings(DEVICE)
bw, peak = ceilings["copy_bytes_per_s"], ceilings["matmul_flops"]
print(f"{ceilings['device']}: copy {bw / 1e12:.3f} TB/s, {ceilings['matmul_dtype']} matmul {peak / 1e12:.1f} "
      f"TFLOP/s, ridge {ceilings['ridge_flop_per_byte']:.0f} FLOP/byte (measured now)")
costs = pd.DataFrame(operator_costs("llama-3-8b", bandwidth=bw, peak_flops=peak))
display(costs.round(2))

# %% [markdown]
# **What fusion can save.** Eager torch runs an elementwise operator as several kernels, each reading and writing
# the whole tensor. HF's RMSNorm in bf16 with float32 statistics (cast, square, mean, scale, cast back, weight)
# moves 36 bytes per element; one fused kernel reads the input once and writes the output once (4 bytes). With the
# residual add in front: 42 bytes eager, 8 fused. For a memory-bound operator the predicted speed-up is the
# ratio of bytes (counted pass by pass in `labkit.experiments.kernels.study.FUSION_BYTES`):

# %%
fusion = pd.DataFrame([{"operator": k, "eager bytes/elem": v["eager"], "fused bytes/elem": v["fused"],
                        "eager kernels": v["eager_passes"], "predicted speed-up": v["eager"] / v["fused"]}
                       for k, v in FUSION_BYTES.items()])
display(fusion)

# %% [markdown]
# ## One kernel, line by line: the fused residual add + RMSNorm
# Every Llama layer computes `h = x + attn_out; y = rms_norm(h) * w` twice. Eager torch launches seven kernels for
# it; `labkit.kernels.rms_norm` does it in one. Here is the whole kernel (the launcher around it picks `BLOCK`, the
# row length rounded up to a power of two, and `ROWS`, rows per program):

# %%
print(inspect.getsource(_rms_norm_kernel.fn))

# %% [markdown]
# Read it as a program that runs once per `ROWS` rows, all programs at once (Triton's model: a *program* is a
# block of threads, and every `tl` value is a tile that the compiler spreads over those threads):
#
# 1. `rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)` -- which rows this program owns. The launch grid is
#    `cdiv(n_rows, ROWS)` programs, so every row belongs to exactly one program and no two programs communicate.
# 2. `r64 = rows.to(tl.int64)[:, None]` -- row offsets in 64 bits: 16384 rows x 8192 columns is past 2^31
#    elements, and a 32-bit offset would silently wrap. `[:, None]` makes it a column, to broadcast against `cols`.
# 3. `cols = tl.arange(0, BLOCK)` and `col_ok`, `mask` -- the whole row is one tile (`BLOCK` >= hidden), so the
#    mean of squares needs no second pass over memory; the mask covers the padding and the last program's rows.
# 4. `w = tl.load(w_ptr + cols, ...)` -- the weight is loaded *first*, once per program, so its load is in flight
#    while `x` arrives; it is small and shared by every program, so it stays in L2.
# 5. `x = tl.load(..., eviction_policy="evict_first")` -- `x` is read exactly once: tell the cache not to keep it,
#    so that the weight and the outputs keep L2.
# 6. `if HAS_RESIDUAL:` (a `constexpr`, so the plain kernel compiles without this branch) -- load the residual,
#    add in float32, **round the sum to the input dtype** (the model rounds `x + residual` to bf16 before the
#    norm: the kernel must too, to match it bit for bit), and store it: the next layer's residual. This store and
#    the residual load are the only extra bytes of the fusion.
# 7. `rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)` -- the reduction across the row happens in
#    registers (and shared memory between warps): no intermediate tensor ever reaches HBM. Statistics in float32.
# 8. `y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]` -- normalise, round to the input dtype,
#    then multiply by the weight: HF's `LlamaRMSNorm` order, so outputs agree with the model's own to the bit.
# 9. `tl.store(out_ptr + ..., cache_modifier=STORE_CACHE)` -- one write of the output. The autotuner may pick
#    streaming stores (`.cs`): the kernel never reads `out` back.
#
# **Bytes.** Fused: read `x` and `residual`, write `out` and the new residual: 4 x rows x hidden x 2 bytes (bf16)
# plus the weight. That is the floor the plot below draws; eager torch moves over five times as much.
#
# **Prediction.** At 16384 x 4096 in bf16 the fused kernel moves 537 MB; at the copy bandwidth printed above that
# is the floor. Small row counts (decode batches) cannot reach it: a few programs cannot keep enough loads in
# flight to fill HBM, and a launch costs microseconds whatever its size.
#
# ### Measure it: GB/s against the copy bandwidth, with a correctness gate

# %%
norm = norm_sweep(SIZES["norm_rows"], SIZES["norm_hidden"], DTYPE, DEVICE, iters=SIZES["iters"],
                  compile_=use_compile and PROFILE == "gpu")
x = torch.randn(SIZES["norm_rows"][-1], SIZES["norm_hidden"], dtype=DTYPE, device=DEVICE)
res, w = torch.randn_like(x), torch.randn(SIZES["norm_hidden"], dtype=DTYPE, device=DEVICE)
from labkit.kernels.rms_norm import rms_norm

out, res_out = rms_norm(x, w, 1e-5, residual=res)
ref_out, ref_res = rms_norm_ref(x.double(), w.double(), 1e-5, residual=res.double())
norm_err = max(relative_error(out, ref_out), relative_error(res_out, ref_res))
assert norm_err < 1e-2, norm_err  # the workbook's bound: 1e-2 in bf16/fp16 against a float64 reference
print(f"fused add+RMSNorm against float64: relative error {norm_err:.1e} (bound 1e-2)")
norm_table = pd.DataFrame(norm)[["rows", "impl", "median_us", "gb_s"]]
norm_table["frac of copy bw"] = norm_table["gb_s"] * 1e9 / bw
display(norm_table.pivot(index="rows", columns="impl", values="frac of copy bw").round(3))

h200 = gpu_record("kernels.rmsnorm_bw_frac")
panels = 2 if h200 else 1
fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.8), squeeze=False)
plot_bandwidth(norm, bw / 1e9, axes[0][0], datasheet_gb_s=(ceilings.get("datasheet_bytes_per_s") or 0) / 1e9,
               title=f"this run: {ceilings['device']}, hidden {SIZES['norm_hidden']}, {str(DTYPE)[6:]}")
if h200:  # what the committed GPU run measured at its sizes (the headline rows of its sweep)
    rec = h200["data"]
    rows_h = [{**r, "rows": int(r["shape"].split("x")[0])} for r in rec["rows"]
              if r["kernel"] == "rmsnorm" and r["shape"].endswith("x4096")]
    plot_bandwidth(sorted(rows_h, key=lambda r: r["rows"]), rec["ceilings"]["copy_bytes_per_s"] / 1e9,
                   axes[0][1], title=f"committed GPU record: {h200['env']['device']}, hidden 4096, bf16")
fig.tight_layout()
plt.show()

# %% [markdown]
# On the CPU the interpreter runs each program in Python, so the left panel shows the paths run, not speed. On a
# GPU the fused kernel's line climbs to the copy bandwidth as rows grow and eager torch stays far below it.
#
# ## Every kernel against its baseline, with a correctness gate
# Memory-bound kernels report GB/s and the fraction of the measured copy bandwidth; prefill attention reports
# TFLOP/s and the fraction of the measured bf16 matmul rate. Launches of tens of microseconds are timed as CUDA-graph
# replays, every implementation alike (the device's time, without Python's launch cost); prefill attention is timed
# with CUDA events, L2 flushed. The baselines: **`torch.compile`** of HF's expressions for the elementwise kernels
# (the headline: what a user who wants fused kernels gets for free; HF's eager expressions are a footnote);
# **SDPA's cuDNN backend** (its default on Hopper; the flash backend is a footnote) for prefill attention; SDPA over
# a contiguous cache for paged decode attention; cuBLAS bf16 and bitsandbytes for the GEMVs. `labkit.headlines`
# lists every headline ratio with its baseline and footnotes.

# %%
from tqdm.auto import tqdm

rows = []
jobs = [(k, shape) for k, shapes in SWEEP.items() for shape in shapes]
for kname, shape in tqdm(jobs, desc="kernels", unit="case"):
    rows += kb.BENCHES[kname](shape, DTYPE, DEVICE, iters=SIZES["iters"],
                              compile_=use_compile and PROFILE == "gpu" and kname in ("rmsnorm", "swiglu", "rope"))
rows = kb.add_fractions(rows, ceilings)
table = pd.DataFrame(rows)
display(table[["kernel", "impl", "shape", "median_us", "gb_s", "tflop_s", "frac_of_ceiling", "rel_err"]].round(4))
for r in rows:  # the gate: every Triton row within the workbook's tolerance for its dtype
    if r["rel_err"] is not None:
        assert r["rel_err"] < 1e-2, (r["kernel"], r["shape"], r["rel_err"])
print("every kernel within 1e-2 of its reference; largest:",
      max((r["rel_err"], r["kernel"]) for r in rows if r["rel_err"] is not None))

# %% [markdown]
# ### The patched model, token for token
# `patch_model` swaps the embedded model's RMSNorms, MLP activations and attention for the kernels. In float32 its
# greedy output must equal the original's token for token.

# %%
tiny, tok = load_model(device=DEVICE)
ids = tok('def read_file(path):\n    """Return', return_tensors="pt").input_ids.to(DEVICE)
with torch.no_grad():
    ref_tokens = tiny.generate(ids, max_new_tokens=SIZES["new_tokens"], do_sample=False)
    ref_logits = tiny(ids).logits
    patch_model(tiny)
    print(patch_summary(tiny))
    got_tokens = tiny.generate(ids, max_new_tokens=SIZES["new_tokens"], do_sample=False)
    logits_err = relative_error(tiny(ids).logits, ref_logits)
    patched_peak = peak_allocated(lambda: tiny(ids), DEVICE)["peak_bytes"]
    unpatch(tiny)
    plain_peak = peak_allocated(lambda: tiny(ids), DEVICE)["peak_bytes"]
assert torch.equal(got_tokens, ref_tokens)
print(f"patched greedy output identical ({SIZES['new_tokens']} tokens); logits rel. error {logits_err:.1e}")
fused_peak_ratio = patched_peak / plain_peak
print(f"peak tensor memory of one forward: {human_bytes(plain_peak)} plain, {human_bytes(patched_peak)} patched "
      f"({fused_peak_ratio:.2f}x): fusion saves traffic, not capacity")

# %% [markdown]
# ## Fusion: predicted against measured

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
# ## Attention: ours against SDPA's two backends
# Prefill attention is compute-bound: FlashAttention keeps the S x S scores on chip and runs at Tensor-Core rate.
# Each ratio below names its baseline. SDPA's **cuDNN** backend is what a user gets by default on Hopper; the
# flash backend is the open FlashAttention-2 kernel. Decode attention is a gather over the block table, so it is
# measured in bandwidth. The table is what the committed GPU record holds (the current run's rows are above).

# %%
h200_att = gpu_record("kernels.flash_attn_vs_sdpa")
if h200_att:
    att = pd.DataFrame([r for r in h200_att["data"]["rows"] if r["kernel"] in ("flash", "paged")])
    att = att[["kernel", "impl", "shape", "median_us", "tflop_s", "gb_s", "frac_of_ceiling"]]
    print(f"committed record: {h200_att['env']['device']}, {summary['kernels.flash_attn_vs_sdpa']['record']}")
    display(att.round(3))
    flash_head = att[att["kernel"] == "flash"]["shape"].iloc[0]
    heads = att[(att["kernel"] == "flash") & (att["shape"] == flash_head)].set_index("impl")["median_us"]
    for base in ("sdpa_cudnn", "sdpa_flash"):
        if base in heads:
            print(f"labkit flash attention over {base}: {heads[base] / heads['triton']:.2f}x "
                  f"(> 1: ours faster)")

# %% [markdown]
# ### What holds our prefill kernel back: the changes tried, measured
# `research/flash_prefill_study.py` timed, in one GPU run at this shape, SDPA's backends, our kernel, a ladder of
# changes to a copy of it (one change a rung: the softmax scale folded into one FMA, K loaded as rows, TMA
# descriptors, a wider tile search, a longest-first grid, Triton's warp specialisation) and two probes that drop
# part of the softmax (wrong values: timing only). The probes bracket the answer: if the MMAs alone beat cuDNN,
# the loop's tensor-core work is not what is missing. The table is the committed H100 record's
# (`results/h100/records/flash_prefill_study.json`); the sentence under it is rendered from that record.

# %%
from labkit.experiments.kernels.prefill_account import account_reading, account_rows, load_account

prefill_account = load_account("h100")
if prefill_account:
    display(pd.DataFrame(account_rows(prefill_account)).round(3))
    print(account_reading(prefill_account))

# %% [markdown]
# ### int8 KV cache: does reading half the bytes make attention faster?
# One layer's paged decode attention at one shape -- batch 16, context 4096, 32 query / 8 KV heads, head dim 128
# on the GPU -- with the cache in bf16, in int8 read and dequantised *inside* the kernel, in int8 dequantised to
# bf16 first (the algorithmic change without a kernel for it), and in fp8 (e4m3) read and dequantised inside the
# kernel. int8 and fp8 store the same bytes (one byte an element and one float32 scale per token and KV head), so
# the two in-kernel rows have one floor; they differ in how the kernel turns a byte into a number (an integer
# convert against an fp8 convert) and in accuracy (fp8 keeps three mantissa bits). Under the `gpu` profile the
# ratios are recorded as `kvcache.int8_attn_speedup_ctx4k_b16` and `kvcache.fp8_attn_speedup_ctx4k_b16` (bf16 time
# over the in-kernel time, each recorded with its bar); notebook 02 refers to them. Each error is against the
# bf16 cache's output: the rounding of the 8-bit cache, gated by `KV_ROUNDING_BOUND`.

# %%
kvq = pd.DataFrame(kv_quant_attention(**SIZES["kv"], dtype=DTYPE, device=DEVICE, iters=SIZES["iters"]))
display(kvq.round(4))
err_bound = kvq["attention"].str.split().str[0].map(KV_ROUNDING_BOUND).fillna(0.0)  # bf16: its own output
assert (kvq["rel_err vs bf16"] <= err_bound).all(), kvq[["attention", "rel_err vs bf16"]]
int8_attn = int8_attention_speedup(kvq.to_dict("records"))
fp8_attn = fp8_attention_speedup(kvq.to_dict("records"))
where = f"this run, {PROFILE}" + ("" if PROFILE == "gpu" else "; the CPU interpreter times Python, not the kernel")


def than_bf16(ratio):
    """The words for a speed ratio over bf16, chosen by the measurement."""
    return "faster than" if ratio > 1 else "slower than" if ratio < 1 else "as fast as"


for fmt, ratio in (("int8", int8_attn), ("fp8", fp8_attn)):
    print(f"{fmt} KV read in the kernel: {ratio:.3f}x the bf16 cache's speed, {than_bf16(ratio)} bf16 "
          f"({'meets' if ratio >= 1.7 else 'misses'} the 1.7x bar) at {SIZES['kv']} ({where})")

# %% [markdown]
# #### Over context: each format against its bytes floor
# The same layer from 1k to 32k tokens of context at batch 16 (32 query / 8 KV heads, head dim 128) under the `gpu`
# profile; tiny shapes under `ci` and `cpu`. Each format's floor is the bytes one call must move -- K and V, their
# scales, q, the output and the block tables -- over the copy bandwidth measured at the top of this notebook: a
# kernel that reads its cache at the bytes' rate sits on its floor, and the 8-bit floors lie below bf16's by the
# ratio of their bytes. The dashed int8 and fp8 floors coincide (same bytes), so their dashes interleave. Decode
# attention is a small share of one step at short context and most of it at long context, where the floor matters.

# %%
kv_sweep = kv_quant_attention_sweep(**SIZES["kv_sweep"], dtype=DTYPE, device=DEVICE, copy_bandwidth=bw)
sweep_df = pd.DataFrame(kv_sweep)
for fmt in ("int8", "fp8"):
    assert (sweep_df[f"{fmt} rel_err"] <= KV_ROUNDING_BOUND[fmt]).all(), sweep_df[f"{fmt} rel_err"]
    sweep_df[f"{fmt} time / floor"] = sweep_df[f"{fmt} us"] / sweep_df[f"{fmt} floor us (measured copy bw)"]
sweep_df["bf16 time / floor"] = sweep_df["bf16 us"] / sweep_df["bf16 floor us (measured copy bw)"]
display(sweep_df[["context"] + [f"{f} {c}" for c in ("us", "floor us (measured copy bw)", "GB/s", "time / floor")
                                for f in ("bf16", "int8", "fp8")] + ["int8 speed-up", "fp8 speed-up"]].round(3))
for fmt in ("int8", "fp8"):
    ups = sweep_df[f"{fmt} speed-up"]
    ahead = int((ups > 1).sum())
    verdict = ("faster than bf16 at every context" if ahead == len(ups) else "slower than bf16 at every context"
               if ahead == 0 else f"faster than bf16 at {ahead} of {len(ups)} contexts")
    print(f"{fmt} in the kernel: {ups.min():.2f}x to {ups.max():.2f}x bf16's speed over contexts "
          f"{sweep_df.context.min()}-{sweep_df.context.max()}, {verdict}; {sweep_df[f'{fmt} time / floor'].min():.2f}x "
          f"to {sweep_df[f'{fmt} time / floor'].max():.2f}x its bytes floor ({where})")
fig, ax = plt.subplots(figsize=(7, 4.2))
plot_kv_quant_sweep(kv_sweep, ax)
fig.tight_layout()
plt.show()
gpu_sweep = gpu_record(FP8_ATTN_FIGURE)
if PROFILE != "gpu" and gpu_sweep and gpu_sweep["data"].get("kv_quant_sweep"):  # what a GPU measured
    fig, ax = plt.subplots(figsize=(7, 4.2))
    plot_kv_quant_sweep(gpu_sweep["data"]["kv_quant_sweep"], ax)
    ax.set_title(f"committed GPU record ({gpu_sweep['env']['device']}): " + ax.get_title(), fontsize=9)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Weight-only GEMV at batch 1: bytes are the time
# At batch 1 a linear reads every weight once for 2 FLOPs each. int8 halves the bytes and int4 quarters them --
# if the dequantisation happens in registers. Dequantising to a bf16 copy first (the torch path) and bitsandbytes
# (built for memory savings, not decode speed) show the other outcome. Each implementation cycles through several
# copies of its weights, as a decode step reads each layer once (otherwise the 50 MB L2 of an H100 or H200 would hold
# them).

# %%
gemv = table[table.kernel == "gemv"][["impl", "shape", "median_us", "gb_s", "frac_of_ceiling", "rel_err"]]
display(gemv.round(3))

# %% [markdown]
# ## Tensor Cores against CUDA cores
# Compute-bound work (prefill, training) is where Tensor Cores matter: the same product in float32 on CUDA cores,
# in TF32 and in bfloat16.

# %%
mm = pd.DataFrame(matmul_rates(SIZES["matmul_n"], DEVICE))
display(mm.round(3))

# %% [markdown]
# ## A decode step, plain and patched
# One decode step of a Hugging Face Llama with a static KV cache, patched with the kernels, against the same step
# with attention through SDPA called with `enable_gqa` (each KV head read once: the baseline a user would pick)
# and, as a footnote, against HF's own SDPA path (which can copy K/V once per query group over a static cache):
# Llama-3-8B's architecture in bf16 (random weights: speed does not depend on their values), captured once and
# timed as CUDA-graph replays. GPU only: through the CPU's interpreter the patched step is slower by
# construction, and the correctness of the patched model is checked above.

# %%
if PROFILE == "gpu":
    big = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=seed)
    steps = pd.DataFrame(decode_steps(big, SIZES["decode_batches"], SIZES["decode_context"], iters=SIZES["iters"]))
    del big
    torch.cuda.empty_cache()
    display(steps.round(3))
else:
    steps = pd.DataFrame()
    gpu_steps = gpu_record("kernels.rmsnorm_bw_frac")
    if gpu_steps:
        print(f"timed under the gpu profile only; the committed GPU record ({gpu_steps['env']['device']}):")
        display(pd.DataFrame(gpu_steps["data"]["decode_steps"]).round(3))

# %% [markdown]
# ## The kernels against the hardware limit, and the trade-offs
# One panel: each kernel at its headline size, labkit's beside its fastest baseline, as a fraction of the limit measured
# on this device (1.0 = copy bandwidth; for flash attention, the bf16 matmul rate).

# %%
fig, ax = plt.subplots(figsize=(8, 4.2))
kb.plot_fractions(rows, SIZE_KEY, ax=ax, title=f"this run ({ceilings['device']}, {str(DTYPE)[6:]})")
fig.tight_layout()
plt.show()

# %% [markdown]
# | technique | accuracy | latency | memory |
# | --- | --- | --- | --- |
# | fused elementwise kernels (RMSNorm + residual, SwiGLU, RoPE) | exact in fp32 (greedy tokens identical); bf16 rounding as HF's | the operator's time falls towards its bytes over bandwidth; a small share of a decode step | none |
# | FlashAttention | same math, another summation order (within 1e-2 in bf16) | prefill attention at Tensor-Core rate; compare with SDPA's cuDNN backend, not only its flash one | O(S) activations instead of O(S^2) |
# | paged decode attention | exact (fp32 accumulation) | a gather over the block table: bandwidth-bound | enables paging (no fragmentation) |
# | int8 / int4 weights (dequantised in registers) | weights rounded (perplexity: notebook 04) | GEMV time by bytes, when the kernel keeps up | 2x / 4x smaller weights |
# | int8 / fp8 KV (dequantised in the kernel) | per-token-head rounding (~1e-2 relative) for int8, more for fp8 (three mantissa bits) | the figures `kvcache.int8_attn_speedup_ctx4k_b16` and `kvcache.fp8_attn_speedup_ctx4k_b16` (GPU run) and the context sweep above | KV cache halved: more sequences per GPU |

# %%
figures = kb.headline_figures(rows, SIZE_KEY)
rec = write_record("03_kernels", {"profile": PROFILE, "dtype": str(DTYPE), "ceilings": ceilings,
                                  "sweep_sizes": SWEEP, "rows": rows, "norm_sweep": norm, "fusion": fusion_rows,
                                  "matmul_rates": mm.to_dict("records"), "decode_steps": steps.to_dict("records"),
                                  "kv_quant_attention": kvq.to_dict("records"), "kv_shape": SIZES["kv"],
                                  "kv_quant_sweep": kv_sweep, "kv_sweep_sizes": SIZES["kv_sweep"],
                                  "figures": figures, "patched_logits_rel_err": logits_err})
note = f"{PROFILE} profile, {DTYPE}, sizes {dict((k, v[0]) for k, v in SWEEP.items())}"
if PROFILE != "gpu":
    note += "; CPU interpreter: times Python, not the kernels"
for name, value in figures.items():
    unit = "fraction" if name.endswith("_frac") else "x"
    if value == value:  # NaN where a baseline is absent (bitsandbytes, cuDNN on the CPU)
        record_figure(name, value, unit, rec, bar=kb.BARS[name], note=note)
    print(f"{name:40s} {value:8.3f}   bar {kb.BARS[name] or '-'}")
record_figure("kernels.fused_peak_memory_ratio", fused_peak_ratio, "x (patched / plain peak tensor memory)", rec,
              note=f"one forward of the embedded model over {ids.shape[1]} tokens, {DEVICE}, labkit kernels patched "
                   "in against HF's modules")
if PROFILE == "gpu":  # the decode step at its largest batch: over SDPA with enable_gqa (headline), over HF's SDPA
    step_unit = f"x (batch {steps.batch.max()}, context {SIZES['decode_context']}, CUDA-graph replays)"
    for name, value in decode_step_figures(steps.to_dict("records")).items():
        record_figure(name, value, step_unit, rec, note="Llama-3-8B shape, bf16, random weights: "
                      + ("SDPA with enable_gqa time / patched time" if name.endswith("speedup")
                         else "HF's SDPA path time / patched time (footnote)"))
if PROFILE == "gpu":  # one shape, a figure per format (notebook 02 refers to them); the CPU's interpreter misleads
    for name, fmt, value in ((INT8_ATTN_FIGURE, "int8", int8_attn), (FP8_ATTN_FIGURE, "fp8", fp8_attn)):
        record_figure(name, value, f"x (bf16 KV time / {fmt} KV time)", rec, bar=">= 1.7",
                      note=f"paged decode attention, one layer, {SIZES['kv']}, block 16, {fmt} K/V with a scale per "
                      "token and head dequantised in the kernel, against the bf16 cache; CUDA-graph replays")

# %% [markdown]
# ## Takeaways
# Each sentence is rendered from the figures of this run and of each machine in `results/summary.json`, and checked
# on each (`python -m labkit claims`); the marks say where it holds and which record it comes from. Where a GEMV falls
# short of its bytes ratio, dequantising costs instructions and latency that bytes alone do not predict.

# %%
show(
    "The GPU measured {ceiling.bf16_mm_tflop_s:.0f} TFLOP/s of bf16 matmul and {ceiling.copy_tb_s:.2f} TB/s of copy "
    "bandwidth: an operator below their ratio in FLOPs per byte is bound by memory (the first table of this notebook "
    "puts each operator on one side)",
    Claim("The one-pass RMSNorm reaches {kernels.rmsnorm_bw_frac:.0%} of the copy bandwidth at 16384 x 4096 (at least "
          "90%). Against torch.compile of HF's RMSNorm, the baseline a user would pick, it runs at "
          "{kernels.rmsnorm_speedup_vs_compile:.2f}x ({kernels.rmsnorm_speedup_vs_compile:if >= 1 then ahead else "
          "behind}): a compiler fuses the chain too. HF's eager expression, a footnote, takes "
          "{kernels.rmsnorm_speedup_vs_eager:.1f}x the kernel's time, more than the 9x its bytes predict.",
          "kernels.rmsnorm_bw_frac >= 0.9 and kernels.rmsnorm_speedup_vs_eager > 9 and "
          "kernels.rmsnorm_speedup_vs_compile < kernels.rmsnorm_speedup_vs_eager", machine="gpu"),
    Claim("SwiGLU's silu-and-mul and RoPE reach {kernels.swiglu_bw_frac:.0%} and {kernels.rope_bw_frac:.0%} of the "
          "copy bandwidth, at least 90% each: near the floor their bytes set.",
          "kernels.swiglu_bw_frac >= 0.9 and kernels.rope_bw_frac >= 0.9", machine="gpu"),
    Claim("Paged decode attention (32 sequences of 4096 tokens) reads its cache at {kernels.paged_attn_bw_frac:.0%} "
          "of the copy bandwidth, at least 75%.", "kernels.paged_attn_bw_frac >= 0.75", machine="gpu"),
    Claim("labkit's FlashAttention runs at {kernels.flash_attn_vs_cudnn:.2f}x the speed of SDPA's default on Hopper, "
          "its cuDNN backend (batch 4, 4096 tokens, causal): {kernels.flash_attn_vs_cudnn:if >= 1 then ahead of it "
          "else behind it, so serve prefill with SDPA}. Over SDPA's flash backend, a footnote baseline, the ratio is "
          "{kernels.flash_attn_vs_sdpa:.2f}x: the weaker baseline flatters the kernel.",
          "kernels.flash_attn_vs_cudnn < kernels.flash_attn_vs_sdpa", machine="gpu"),
    Claim("A Llama-3-8B-shaped decode step at batch 32, context 4096, with labkit's kernels patched in runs "
          "{kernels.patched_step_speedup:.2f}x the same step with SDPA reading each KV head once (enable_gqa), the "
          "stronger baseline (within 2%): against HF's own SDPA path, a footnote, the ratio is "
          "{kernels.patched_step_speedup_vs_hf_sdpa:.1f}x ({kernels.patched_step_speedup_vs_hf_sdpa:if > "
          "kernels.patched_step_speedup then its K/V copies per query group cost time else no copy shows here}).",
          "kernels.patched_step_speedup <= 1.02 * kernels.patched_step_speedup_vs_hf_sdpa", machine="gpu"),
    Claim("At batch 1 the int8 GEMV runs {kernels.w8_gemv_speedup_vs_bf16:.2f}x and the int4 GEMV "
          "{kernels.w4_gemv_speedup_vs_bf16:.2f}x cuBLAS bf16 (4096 -> 14336): fewer bytes, faster. Against the ratio "
          "of their bytes, the int8 GEMV {kernels.w8_gemv_speedup_vs_bf16:if >= 2 then reaches its 2x else falls short "
          "of its 2x} and the int4 GEMV {kernels.w4_gemv_speedup_vs_bf16:if >= 4 then reaches its 4x else falls short "
          "of its 4x}.", "kernels.w4_gemv_speedup_vs_bf16 > kernels.w8_gemv_speedup_vs_bf16 > 1", machine="gpu"),
    Claim("Against bitsandbytes on the same weights, labkit's int4 GEMV runs {kernels.w4_vs_bnb_nf4:.1f}x NF4's speed "
          "and its int8 GEMV {kernels.w8_vs_bnb_int8:.1f}x LLM.int8's, over 1.5x each: the same bytes, read by a "
          "kernel built for batch-1 decode.", "kernels.w4_vs_bnb_nf4 > 1.5 and kernels.w8_vs_bnb_int8 > 1.5",
          machine="gpu"),
    Claim("A 3x bar over LLM.int8 is out of any kernel's reach: reading its int8 weights at the copy bandwidth, "
          "labkit's GEMV would be {kernels.w8_vs_bnb_int8_at_copy_bw:.2f}x bitsandbytes, under 3x.",
          "kernels.w8_vs_bnb_int8_at_copy_bw < 3", machine="gpu"),
    Claim("The stationary int8 GEMV the engine fuses its layers around ({kernels.w8_stationary_gemv_speedup_vs_bf16:.2f}x "
          "bf16) is still faster than bf16 on its own.", "kernels.w8_stationary_gemv_speedup_vs_bf16 > 1",
          machine="gpu"),
)

# %% [markdown]
# * Measure the bound first, then write the kernel: for a memory-bound operator the target is bytes over
#   bandwidth, and fusion pays by the bytes it removes.
# * Compute-bound attention is a different contest: name the baseline. SDPA picks cuDNN on Hopper; a ratio over its
#   flash backend alone flatters a custom kernel.
# * Quantised KV pays only when a kernel reads the compact format directly; dequantising to bf16 first moves more
#   bytes than the bf16 cache (the int8 table above). Whether reading half the bytes is also faster is the GPU
#   figures `kvcache.int8_attn_speedup_ctx4k_b16` and `kvcache.fp8_attn_speedup_ctx4k_b16`, and over context the
#   sweep's plot: each format's time against its bytes floor.
