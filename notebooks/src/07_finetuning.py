# %% [markdown]
# # 07 · Fine-tuning instead of inference: where the memory goes, and LoRA / QLoRA
#
# **The question.** The seed's first follow-up: *how would your optimisation strategy change if you were
# performing fine-tuning instead of inference?* Serving and training run the same layers, but the bottlenecks
# move:
#
# | | inference (notebooks 00-06) | fine-tuning |
# | --- | --- | --- |
# | compute | decode is memory-bound: one token per sequence per step reads every weight | every token of every sequence at once, forward + backward (~3x the forward's FLOPs): compute-bound, tensor-core utilisation is the metric |
# | memory that grows | the KV cache, with every generated token | nothing grows during a step, but each step holds gradients, optimizer state (Adam: 2 moments) and every activation backward needs |
# | memory that dominates | weights + KV cache | optimizer state and gradients (full fine-tuning: 16 bytes per parameter before activations), then activations |
# | scheduling | continuous batching of requests with different lengths | fixed-shape batches; the choice is the micro-batch size and gradient accumulation |
# | multi-GPU | TP for latency, PP for capacity; communication on every token | data parallelism is natural (one all-reduce of gradients per step), ZeRO / FSDP shard the per-parameter state over it; PP adds bubbles that only many micro-batches hide; TP for layers that do not fit |
#
# This notebook measures the memory side on the embedded model and applies the same arithmetic to the 175B:
# a **memory model** of a training step (`labkit.finetune.memory_model`) is checked against the measured peak,
# then full fine-tuning, **LoRA** and **QLoRA** are run on the C-API pages of the Python docs (`task_train`, pages
# the embedded model never saw in pre-training) and compared on trainable parameters, peak memory, step time and
# held-out loss (`task_heldout`; the general `heldout` split shows what the model forgets).
#
# **LoRA** (Hu et al. 2021) freezes the pretrained weight `W` and learns a low-rank update `(alpha/r) B A` beside
# it, so gradients and optimizer state exist only for `r (in + out)` numbers per layer. **QLoRA** (Dettmers et al.
# 2023) also stores the frozen `W` in 4-bit NormalFloat (bitsandbytes NF4 with double-quantised scales). The LoRA
# layer is written out in `labkit/finetune/lora.py` instead of importing `peft`: the technique is two matmuls and
# an addition, which is the lesson, and one fewer library keeps the CPU and GPU images (transformers 5.24 and
# 5.17) on the same code. bitsandbytes, the ecosystem's standard, provides NF4 and 8-bit AdamW.

# %% tags=["parameters"]
profile = "auto"
seed = 0
lora_rank = 8

# %%
import copy

import matplotlib.pyplot as plt
import pandas as pd
import torch

import labkit  # noqa: F401  (before anything imports triton)
from labkit.bench import record_figure, write_record
from labkit.claims import Claim, show
from labkit.data import split_tokens
from labkit.device import native_bf16
from labkit.evaluate import relative_error
from labkit.experiments import finetuning as C
from labkit.finetune import (LoRALinear, TrainSetup, apply_lora, heldout_loss, inference_memory, merge_lora,
                             trainable_parameters, training_memory)
from labkit.hardware import get_hardware, measure_matmul_flops
from labkit.model import PRESETS, get_config, human_bytes, load_model, random_model
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
SIZES = {
    "ci": dict(batch=4, seq=64, steps=12, eval_seq=128, eval_windows=8, check_batch=2, check_seq=64,
               scale_layers=None),
    # cpu: about a minute on an idle 2-core machine (the whole workbook's cpu run must fit 15 minutes)
    "cpu": dict(batch=4, seq=128, steps=40, eval_seq=128, eval_windows=16, check_batch=2, check_seq=96,
                scale_layers=None),
    # gpu: 40 steps of 16 x 512 tokens are two passes over task_train's 161k tokens. Train longer and the held-out
    # loss turns back up: on an H100, LoRA at its learning rate lowered it by 0.32 nats at 2.5 passes and raised it
    # by 0.11 at 20 (research/records/h100/gpu_failures_probe.json): over-fitting, not a CUDA bug
    "gpu": dict(batch=16, seq=512, steps=40, eval_seq=512, eval_windows=None, check_batch=8, check_seq=512,
                scale_layers=4),
}[PROFILE]
DEVICE = "cuda" if PROFILE == "gpu" else "cpu"
# bf16 recipes on the GPU; the CPU profiles compute them in fp32 (in one cpu-profile run on a CPU with bf16
# instructions, the bf16 recipes' fine-tuning cell took ten minutes on a busy 2-core machine)
BF16 = PROFILE == "gpu" and native_bf16(DEVICE)
if PROFILE != "gpu":
    # small steps on a 2-core machine: threads handing work to each other cost more than they save
    torch.set_num_threads(1)
print(PROFILE, DEVICE, SIZES, f"{torch.get_num_threads()} CPU threads", "recipes in bf16" if BF16 else
      "recipes compute in fp32")

# %% [markdown]
# ## Predict: the memory of one training step, against serving
# `training_memory(spec, setup)` counts, for Hugging Face's Llama as it runs here: the weights (fp32 masters, a
# bf16 frozen base, or NF4), one gradient per trainable weight, the optimizer state (AdamW: two fp32 moments;
# 8-bit AdamW: two bytes and a scale per 256), and the activations autograd saves, op by op (which tensors an op
# keeps depends on which of its inputs need a gradient, so LoRA keeps fewer than full fine-tuning). The peak is the
# largest of a few moments: the start of backward (every activation plus the logits' gradients), the end of
# backward (every gradient), and with checkpointing the recomputation of one layer.
#
# Recipes (`compare.recipe`): **full** = fp32 master weights, bf16 autocast, AdamW; **LoRA** = bf16 frozen base,
# fp32 adapters on all seven linears of every layer (rank 8), AdamW; **QLoRA** = NF4 base (bf16 embeddings and
# norms), the same adapters, 8-bit AdamW. The GPU runs them as written; the CPU profiles compute them in fp32
# (fp32 base, no autocast: bf16 on a CPU is slow, and without bf16 instructions torch falls back to a much slower
# path), and the memory checks below keep two bf16 variants so the model is checked on both.

# %%
base_model, tok = load_model(device=DEVICE, dtype="fp32")
spec = get_config(base_model)
B, S = SIZES["batch"], SIZES["seq"]
setups = {m: C.recipe(m, B, S, device=DEVICE, lora_rank=lora_rank, bf16=BF16) for m in C.METHOD_NAMES}
predict = []
for m, st in setups.items():
    mm = training_memory(spec, st)
    predict.append({"method": m, "weights": mm.weights, "grads": mm.grads, "optimizer": mm.optimizer_states,
                    "saved activations": mm.activations, "peak": mm.peak, "peak moment": mm.peak_phase,
                    "bytes/param (weights+grads+optim)": (mm.weights + mm.grads + mm.optimizer_states)
                    / spec.num_params, **{f"at peak: {k}": v for k, v in mm.at_peak.items()}})
serve = inference_memory(spec, batch_size=B, context_len=S, weight_dtype="bf16")
predict.append({"method": "serve (bf16, same batch)", "weights": serve.weights, "grads": 0.0, "optimizer": 0.0,
                "saved activations": serve.kv_cache, "peak": serve.peak, "peak moment": "KV cache",
                "bytes/param (weights+grads+optim)": serve.weights / spec.num_params})
predict = pd.DataFrame(predict)
print(f"embedded model: {spec.num_params / 1e6:.2f} M parameters, batch {B} x {S} tokens")
shown = ["method", "weights", "grads", "optimizer", "saved activations", "peak", "peak moment",
         "bytes/param (weights+grads+optim)"]
display(predict[shown].assign(**{c: predict[c].map(human_bytes) for c in
                                 ["weights", "grads", "optimizer", "saved activations", "peak"]}).round(2))
flops = {m: C.step_flops_per_token(spec, st) / spec.matmul_params for m, st in setups.items()}
print("matmul FLOPs per trained token, in units of N (weights in matmuls): "
      + ", ".join(f"{m} {v:.2f} N" for m, v in flops.items()) + " (serving: 2 N per token)")

# %% [markdown]
# For a model this small the vocabulary dominates: the logits and their gradients (`tokens x 8192` in fp32, three
# of them alive at the start of backward) outweigh the eight layers' activations, so LoRA and QLoRA save the
# gradient and optimizer bytes but not the activations. At the 175B scale (below) the proportions flip.
#
# ## Baseline: the pretrained model on the task
# Loss in nats per token (perplexity = e^loss) on windows spread over each split, in fp32.

# %%
train_ids = split_tokens("task_train", tok)
eval_sets = {"task_heldout": split_tokens("task_heldout", tok), "heldout": split_tokens("heldout", tok)}
print({k: len(v) for k, v in {"task_train": train_ids, **eval_sets}.items()}, "tokens")
print(f"training: {SIZES['steps']} steps of {B} x {S} tokens = {SIZES['steps'] * B * S / len(train_ids):.2f} passes "
      "over task_train")
baseline = {name: heldout_loss(base_model, ids, seq_len=SIZES["eval_seq"], num_windows=SIZES["eval_windows"])
            for name, ids in eval_sets.items()}
print({k: round(v, 4) for k, v in baseline.items()}, "(fp32, before any fine-tuning)")

# %% [markdown]
# ## Check correctness before training
# * LoRA starts as the pretrained function exactly (`B = 0`), only the adapters receive gradients, and merging
#   the adapters into the weights (`W + (alpha/r) B A`, for serving at no extra cost) gives the same outputs.
# * The memory model against the measured peak of one training step, for the three recipes and a few variants
#   (fp32, activation checkpointing, 8-bit AdamW for full fine-tuning). On the CPU the peak comes from the
#   profiler's allocator events (every allocation and free in c10's CPU allocator, with the running total), on the
#   GPU from `torch.cuda.max_memory_allocated`; both above the tensors alive at the start (weights, optimizer state,
#   the batch), which are counted storage by storage.

# %%
gen = torch.Generator().manual_seed(seed)
ids = torch.randint(0, spec.vocab_size, (2, 33), generator=gen).to(DEVICE)
check = apply_lora(copy.deepcopy(base_model), rank=lora_rank)
with torch.no_grad():
    same_at_init = torch.equal(check(ids).logits, base_model(ids).logits)
check.train()
check(input_ids=ids, labels=ids).loss.backward()
grads_only_adapters = all((p.grad is not None) == p.requires_grad for p in check.parameters())
with torch.no_grad():
    for p in trainable_parameters(check):
        p.copy_(0.02 * torch.randn(p.shape, generator=gen).to(p.device))
    check.eval()
    adapted = check(ids).logits
    merge_err = relative_error(merge_lora(check)(ids).logits, adapted)
assert same_at_init and grads_only_adapters and merge_err < 1e-5
assert not any(isinstance(m, LoRALinear) for m in check.modules())
print(f"LoRA at step 0 == pretrained: {same_at_init}; gradients only on adapters: {grads_only_adapters}; "
      f"merged vs adapted outputs: rel. err {merge_err:.1e}")
del check

cb, cs = SIZES["check_batch"], SIZES["check_seq"]
variants = [C.recipe(m, cb, cs, device=DEVICE, lora_rank=lora_rank, bf16=BF16) for m in C.METHOD_NAMES] + [
    TrainSetup(method="full", precision="fp32", batch_size=cb, seq_len=cs, device=DEVICE),
    TrainSetup(method="full", precision="bf16-mixed", optimizer="adamw8bit", checkpointing=True, batch_size=cb,
               seq_len=cs, device=DEVICE),
    C.recipe("lora", cb, cs, device=DEVICE, checkpointing=True, lora_rank=lora_rank, bf16=True),
]
mem_rows = [C.memory_row(C.fresh(base_model), st, seed=seed) for st in variants]
mem_table = pd.DataFrame(mem_rows)
display(mem_table[["setup", "measured_peak", "predicted_peak", "rel_err", "phase"]].assign(
    measured_peak=mem_table.measured_peak.map(human_bytes), predicted_peak=mem_table.predicted_peak.map(human_bytes)))
print("measured with:", mem_rows[0]["measure"])
if mem_table.rel_err.max() > 0.15:
    # recorded below against its bar either way; on the GPU the run goes on so its other numbers are not lost
    msg = f"memory model off by {mem_table.rel_err.max():.1%} (bar 15%): see the rows above"
    assert PROFILE == "gpu", msg
    print("WARNING:", msg)

# %% [markdown]
# ## Apply the technique: fine-tune three ways
# Each method starts from the same pretrained weights, trains for the same steps on the same random windows of
# `task_train` (warm-up, then cosine decay of the learning rate), and is evaluated before (the prepared model at
# step 0: for QLoRA that is already the NF4-quantised model) and after, under bf16 autocast as it trains. Peak
# memory is measured on a separate copy at the training batch size.

# %%
rows = []
for m, st in setups.items():
    row = C.method_row(copy.deepcopy(base_model), st, train_ids, eval_sets, steps=SIZES["steps"],
                       lr=C.DEFAULT_LR[m], eval_seq_len=SIZES["eval_seq"], eval_windows=SIZES["eval_windows"],
                       seed=seed, progress=True)
    mem = C.memory_row(C.fresh(base_model), st, seed=seed)
    row.update(measured_peak=mem["measured_peak"], predicted_peak=mem["predicted_peak"], mem_rel_err=mem["rel_err"])
    rows.append(row)
    print(f"{m}: task loss {row['task_heldout_before']:.4f} -> {row['task_heldout_after']:.4f}, "
          f"general {row['heldout_before']:.4f} -> {row['heldout_after']:.4f}, step {row['step_ms']:.1f} ms")
by = {r["method"]: r for r in rows}

# %% [markdown]
# ## Trade-offs: accuracy, latency, memory
# Ratios are against full fine-tuning in this run. `task drop` is the held-out loss gained on the task (positive:
# better); `forgetting` is the loss lost on the general docs (positive: worse). The step's matmul FLOP rate
# (`compare.step_flops_per_token` x tokens / step time) is given against the matmul rate of the recipes' compute
# dtype measured now on this device: the floor a step could reach if it were only large matmuls.

# %%
full = by["full"]
mm_dtype = torch.bfloat16 if BF16 else torch.float32
mm_rate = measure_matmul_flops(DEVICE, dtype=mm_dtype, iters=5)
print(f"measured {str(mm_dtype)[6:]} matmul rate on {DEVICE}: {mm_rate / 1e12:.2f} TFLOP/s")
trade = pd.DataFrame([{
    "method": r["method"], "trainable params": r["trainable_params"], "trainable frac": r["trainable_frac"],
    "peak memory": human_bytes(r["measured_peak"]), "peak vs full": r["measured_peak"] / full["measured_peak"],
    "step ms": r["step_ms"], "step vs full": r["step_ms"] / full["step_ms"],
    "task loss before": r["task_heldout_before"], "task loss after": r["task_heldout_after"],
    "task drop": r["task_heldout_drop"], "forgetting": -r["heldout_drop"],
    "matmul rate vs measured": C.step_flops_per_token(spec, setups[r["method"]]) * B * S / (r["step_ms"] / 1e3)
    / mm_rate,
} for r in rows])
display(trade.round(4))

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.8))
pred = predict.set_index("method").loc[list(C.METHOD_NAMES)]
bottom = pd.Series(0.0, index=pred.index)
for part in ["weights", "optimizer", "batch", "grads", "activations", "transient"]:
    ax0.bar(pred.index, pred[f"at peak: {part}"] / 2**20, bottom=bottom / 2**20, label=part)
    bottom += pred[f"at peak: {part}"]
ax0.scatter(pred.index, [by[m]["measured_peak"] / 2**20 for m in pred.index], color="k", marker="_", s=900,
            label="measured peak", zorder=3)
ax0.set_ylabel("MiB")
ax0.set_ylim(0, 1.45 * max(bottom.max(), max(by[m]["measured_peak"] for m in pred.index)) / 2**20)
ax0.set_title(f"peak of one step, batch {B} x {S}: predicted parts, measured total", fontsize=10)
ax0.legend(fontsize=8, ncol=3, loc="upper right")
for r in rows:
    ax1.plot(pd.Series(r["train_losses"]).rolling(max(1, SIZES["steps"] // 5), min_periods=1).mean(),
             label=r["method"])
ax1.set_xlabel("step")
ax1.set_ylabel("training loss (smoothed)")
ax1.set_title(f"task_train (rolling mean over {max(1, SIZES['steps'] // 5)} steps)", fontsize=10)
ax1.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The full-size picture (GPU profile)
# Speed and memory at a real width: the Llama-3-8B architecture with random weights (speed does not depend on
# weight values), truncated to a few layers so that full fine-tuning of it fits one GPU. Same recipes, the same
# memory model, and the matmul FLOP rate each step reaches.

# %%
scale_rows, scale_mem = [], []
if SIZES["scale_layers"]:
    def big():
        return random_model("llama-3-8b", num_layers=SIZES["scale_layers"], device="cuda", dtype="fp32", seed=seed)
    for st in [C.recipe(m, 4, 1024, device="cuda", lora_rank=lora_rank) for m in C.METHOD_NAMES] + [
            C.recipe("full", 4, 1024, device="cuda", checkpointing=True),
            TrainSetup(method="full", optimizer="adamw8bit", batch_size=4, seq_len=1024)]:
        scale_mem.append(C.memory_row(big, st, seed=seed))
        speed = C.speed_row(big, st, steps=6, seed=seed)
        scale_rows.append({**speed, "measured_peak": scale_mem[-1]["measured_peak"],
                           "predicted_peak": scale_mem[-1]["predicted_peak"], "rel_err": scale_mem[-1]["rel_err"]})
        torch.cuda.empty_cache()
    scale = pd.DataFrame(scale_rows).drop(columns=["step_times"])
    display(scale.assign(rate_vs_measured_matmul=scale.tflops_per_s * 1e12 / mm_rate,
                         measured_peak=scale.measured_peak.map(human_bytes),
                         predicted_peak=scale.predicted_peak.map(human_bytes)).round(3))
else:
    print("GPU profile only: this section needs CUDA (run with profile='gpu').")

# %% [markdown]
# ## The 175B: the same memory model at the scenario's scale
# GPT-3 175B (`PRESETS['gpt3-175b']`), sequences of 2048 tokens, one sequence per GPU per micro-batch, bf16
# autocast. Serving needs 350 GB of weights and a KV cache; full fine-tuning needs 16 bytes per parameter before
# any activation: 2.8 TB, so it is a sharding problem first. ZeRO-3 / FSDP divides weights, gradients and
# optimizer state by the data-parallel degree (and gathers one layer at a time); tensor parallelism divides the
# layers' matrices and part of the activations, at the cost of two all-reduces per layer on the critical path
# (notebook 06). LoRA removes the gradients and optimizer state but keeps the frozen weights; QLoRA cuts those
# to ~0.52 bytes per parameter.

# %%
big_spec = PRESETS["gpt3-175b"]
h200 = get_hardware("h200")
plan = pd.DataFrame(C.plan_rows(big_spec, batch_size=1, seq_len=2048, gpu_memory=h200.mem_capacity,
                                data_parallel=64, tensor_parallel=8))
display(plan.assign(**{c: (plan[c] / 1e9).round(1) for c in
                       ["weights", "grads", "optimizer", "activations / KV", "peak_per_gpu"]})
        .rename(columns=lambda c: c + " (GB)" if c in ("weights", "grads", "optimizer", "activations / KV",
                                                        "peak_per_gpu") else c))
fig, ax = plt.subplots(figsize=(9, 3.6))
ax.barh(plan.configuration, plan.peak_per_gpu / 1e9, color=["tab:green" if f else "tab:red" for f in plan.fits])
ax.axvline(h200.mem_capacity / 1e9, color="k", ls="--", label=f"H200 ({h200.mem_capacity / 1e9:.0f} GB)")
ax.set_xscale("log")
ax.set_xlabel("peak memory per GPU (GB, log)")
ax.set_title("GPT-3 175B, one 2048-token sequence per micro-batch: green fits one H200", fontsize=10)
ax.invert_yaxis()
ax.legend()
plt.tight_layout()
plt.show()
ft = C.step_flops_per_token(big_spec, TrainSetup(batch_size=1, seq_len=2048, checkpointing=True))
print(f"full fine-tuning with checkpointing: {ft / 1e12:.2f} TFLOP per token; 1 B tokens at 40% of "
      f"{h200.bf16_flops / 1e12:.0f} TFLOP/s (H200 datasheet): {ft * 1e9 / (0.4 * h200.bf16_flops) / 3600:,.0f} "
      f"GPU-hours")

# %% [markdown]
# ## Record

# %%
all_mem = mem_rows + [{"setup": r["setup"], "rel_err": r["mem_rel_err"]} for r in rows] + scale_mem
worst = max(all_mem, key=lambda r: r["rel_err"])
rec = write_record("07_finetuning", {
    "sizes": SIZES, "device": DEVICE, "lora_rank": lora_rank, "baseline_fp32": baseline,
    "predict": predict.to_dict("records"), "memory_checks": mem_rows,
    "methods": [{k: v for k, v in r.items()} for r in rows], "scale": scale_rows, "scale_memory": scale_mem,
    "plan_175b": plan.to_dict("records"),
})
where = f"embedded model, {DEVICE}, batch {B} x {S}, {SIZES['steps']} steps"
record_figure("finetune.lora_trainable_frac", by["lora"]["trainable_frac"], "fraction", rec, derived=True,
              note=f"rank {lora_rank} on all 7 linears of every layer, over all parameters incl. adapters")
record_figure("finetune.qlora_peak_mem_ratio_vs_full", by["qlora"]["measured_peak"] / by["full"]["measured_peak"],
              "ratio", rec, note=f"measured peak of one step, {where}; QLoRA NF4 + 8-bit AdamW vs full "
              f"fp32-master AdamW, both bf16 autocast")
record_figure("finetune.lora_heldout_loss_drop", by["lora"]["task_heldout_drop"], "nats/token", rec, bar="> 0",
              note=f"task_heldout loss before - after, {where}, lr {by['lora']['lr']}")
record_figure("finetune.memory_model_rel_err", worst["rel_err"], "fraction", rec, bar="<= 0.15",
              note=f"max over {len(all_mem)} measured training steps (worst: {worst['setup']})")
record_figure("finetune.lora_peak_mem_ratio_vs_full", by["lora"]["measured_peak"] / by["full"]["measured_peak"],
              "ratio", rec, note=f"measured peak of one step, {where}; LoRA (frozen base) vs full fine-tuning")
record_figure("finetune.lora_step_time_ratio_vs_full", by["lora"]["step_ms"] / by["full"]["step_ms"], "ratio", rec,
              note=f"median step time, {where}")
record_figure("finetune.full_task_loss_drop", by["full"]["task_heldout_drop"], "nats/token", rec,
              note=f"task_heldout loss before - after, {where}, lr {by['full']['lr']}")
gb = plan.set_index("configuration").peak_per_gpu / 1e9
serve_row = plan.configuration.iloc[0]
for name, row in (("gpt3_serve_peak_gb", serve_row),
                  ("gpt3_full_ft_peak_gb", "full FT, bf16 autocast, AdamW"),
                  ("gpt3_zero3_peak_gb", "full FT + ckpt, ZeRO-3 / FSDP over 64"),
                  ("gpt3_lora_peak_gb", "LoRA r=8, bf16 base, ckpt"),
                  ("gpt3_qlora_peak_gb", "QLoRA r=8, NF4 base, ckpt")):
    record_figure(f"finetune.{name}", float(gb[row]), "GB per GPU", rec, derived=True,
                  note=f"memory model (checked above), GPT-3 175B, {row}, one 2048-token sequence per micro-batch")
record_figure("finetune.h200_memory_gb", h200.mem_capacity / 1e9, "GB", rec, note="datasheet capacity", derived=True)
record_figure("finetune.full_ft_state_bytes_per_param",
              float(predict.set_index("method").loc["full", "bytes/param (weights+grads+optim)"]), "bytes", rec, derived=True,
              note="fp32 master weights + fp32 gradients + two fp32 AdamW moments, per parameter (memory model)")
print(f"record: {rec}")

# %% [markdown]
# ## Takeaways
# Each sentence with a number or a direction is a claim that `python -m labkit claims` checks against
# `results/summary.json`, rendered from the figures (here: the embedded model on the CPU, and the memory model
# checked above applied to the 175B). What changes for fine-tuning: training memory is **per parameter**, not per
# token, so the strategy starts with sharding (ZeRO-3 / FSDP over data-parallel ranks: it communicates once per
# layer per step, off the per-token critical path) rather than with the decode-latency work of notebooks 02-05;
# activation checkpointing trades one extra forward for keeping one tensor per layer; 8-bit AdamW cuts the two
# moments from 8 to about 2 bytes per parameter. **How to verify**: measure one step's peak against the memory model
# (as here), the step's matmul FLOP rate against the measured ceiling, and the held-out loss before and after.

# %%
verdicts = show(
    "Full fine-tuning with AdamW holds {finetune.full_ft_state_bytes_per_param:.0f} bytes per parameter before any "
    "activation: fp32 weights, fp32 gradients, two fp32 moments (serving in bf16 holds 2)",
    Claim("The memory model predicts every measured training step's peak within {finetune.memory_model_rel_err:.1%} "
          "(the bar: 15%)", "finetune.memory_model_rel_err <= 0.15", machine="any"),
    "The memory model applied to the 175B: one GPU would need {finetune.gpt3_full_ft_peak_gb:,.0f} GB for full "
    "fine-tuning against {finetune.gpt3_serve_peak_gb:,.0f} GB to serve it; ZeRO-3 / FSDP over 64 GPUs brings it to "
    "{finetune.gpt3_zero3_peak_gb:.0f} GB per GPU (an H200 holds {finetune.h200_memory_gb:.0f} GB)",
    "LoRA (rank 8 on every linear) trains {finetune.lora_trainable_frac:.1%} of the parameters",
    Claim("LoRA lowers the task's held-out loss by {finetune.lora_heldout_loss_drop:.2f} nats per token, full "
          "fine-tuning in the same steps by {finetune.full_task_loss_drop:.2f}: both learn the task",
          "finetune.lora_heldout_loss_drop > 0 and finetune.full_task_loss_drop > 0", machine="any"),
    Claim("LoRA's step peaks at {finetune.lora_peak_mem_ratio_vs_full:.2f}x full fine-tuning's memory and QLoRA's "
          "at {finetune.qlora_peak_mem_ratio_vs_full:.2f}x (no gradients or optimizer state for the frozen weights)",
          "finetune.lora_peak_mem_ratio_vs_full < 1 and finetune.qlora_peak_mem_ratio_vs_full < 1", machine="any"),
    Claim("A LoRA step still takes {finetune.lora_step_time_ratio_vs_full:.2f}x a full step's time, over half: "
          "forward and backward still run through every layer", "finetune.lora_step_time_ratio_vs_full > 0.5",
          machine="any"),
    "The memory model for the 175B with LoRA on a bf16 base: {finetune.gpt3_lora_peak_gb:.0f} GB per GPU; with "
    "QLoRA's NF4 base: {finetune.gpt3_qlora_peak_gb:.0f} GB (an H200 holds {finetune.h200_memory_gb:.0f} GB)",
)
