# %% [markdown]
# # 00 · The baseline: a slow LLM service, made real
#
# **The scenario.** A transformer LLM is served on GPUs with *high latency* and *low GPU utilisation* at peak
# traffic. Before optimising anything we reproduce both symptoms with the most common naive server: Hugging Face
# `generate`, requests taken one at a time from a FIFO queue as they arrive (Poisson arrivals), and the
# slightly less naive variant, static batches. Everything below is measured on the machine running this notebook.
#
# * `ci` / `cpu` profiles: the embedded model (`data/pydocs-llama`, 8.4 M parameters, trained weights) on the CPU.
# * `gpu` profile: `random_model("llama-3-8b")` in bf16 (full-size Llama-3-8B architecture, random weights: speed
#   does not depend on weight values).
#
# What we look for: (1) latency that grows with traffic, (2) a device that is mostly idle, and (3) decode speed
# far below the floor that memory bandwidth sets.

# %% tags=["parameters"]
profile = "auto"
seed = 0

# %%
import math

import matplotlib.pyplot as plt
import pandas as pd
import torch

import labkit  # noqa: F401  (sets up Triton for the host before anything imports it)
from labkit.bench import record_figure, write_record
from labkit.data import split_tokens
from labkit.engine import LengthDist, make_workload
from labkit.experiments.baseline import run_generate, sweep_load
from labkit.hardware import detect, measure_ceilings
from labkit.models import get_spec, human_bytes, load_model, random_model
from labkit.profiling import plot_timeline, profile_run, roofline
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
SIZES = {
    "ci": dict(n_requests=8, prompt=(32, 96), out_mean=8, out_max=16, loads=[0.3, 0.9, 1.5], static_batch=4,
               probe_tokens=16),
    "cpu": dict(n_requests=32, prompt=(64, 256), out_mean=24, out_max=64, loads=[0.25, 0.5, 0.75, 1.0, 1.5],
                static_batch=8, probe_tokens=64),
    "gpu": dict(n_requests=12, prompt=(64, 192), out_mean=12, out_max=32, loads=[0.3, 0.9, 1.5], static_batch=4,
                probe_tokens=32),
}[PROFILE]
print(PROFILE, SIZES)

# %% [markdown]
# ## The model and the machine
# The `gpu` profile builds the 8B architecture directly on the GPU (16 GB of bf16 weights, never on the CPU first).

# %%
if PROFILE == "gpu":
    model = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=seed)
    tokenizer, source, weight_dtype, model_name = None, model.config.vocab_size, "bf16", "llama-3-8b (random weights)"
else:
    model, tokenizer = load_model(device="cpu", dtype="fp32")
    source, weight_dtype, model_name = split_tokens("heldout", tokenizer), "fp32", "pydocs-llama (embedded)"
spec = get_spec(model)
ceilings = measure_ceilings()
hw = detect()
print(f"{model_name}: {spec.num_params / 1e6:,.1f} M parameters, {human_bytes(spec.weight_bytes(weight_dtype))} "
      f"of {weight_dtype} weights")
print(f"{ceilings['device']}: measured copy bandwidth {ceilings['copy_bytes_per_s'] / 1e12:.3f} TB/s, "
      f"{ceilings['matmul_dtype']} matmul {ceilings['matmul_flops'] / 1e12:.1f} TFLOP/s")

# %% [markdown]
# ## Predict
# A decode step must read every weight once (plus the KV cache), whatever the batch size. At batch 1 that makes
# decode memory-bound: the floor for one token is *weight bytes / bandwidth*. Prefill processes the whole prompt
# at once and is far more arithmetic-intensive.

# %%
context = SIZES["prompt"][1]
dec = roofline(spec, hw, batch=1, context=context, phase="decode", dtype=weight_dtype)
pre = roofline(spec, hw, batch=1, context=context, phase="prefill", dtype=weight_dtype)
floor_s = dec.bytes / ceilings["copy_bytes_per_s"]
print(f"decode, batch 1: {dec.bytes / 1e9:.3f} GB moved, {dec.flops / 1e9:.2f} GFLOP -> intensity "
      f"{dec.intensity:.1f} FLOP/B")
print(f"prefill of {context} tokens: intensity {pre.intensity:.0f} FLOP/B; ridge point of this device "
      f"{ceilings['ridge_flop_per_byte']:.0f} FLOP/B")
print(f"bandwidth floor: {floor_s * 1e3:.3f} ms per token -> at most {1 / floor_s:,.0f} tokens/s at batch 1")

# %% [markdown]
# ## Measure: one request, batch 1
# `generate` timed token by token (a streamer takes the time of each token as it reaches the host). Decode
# tokens/s excludes the prefill; its fraction of the bandwidth floor is the model bandwidth utilisation (MBU).

# %%
probe = make_workload(1, math.inf, LengthDist.fixed(context), LengthDist.fixed(SIZES["probe_tokens"]), source,
                      seed=seed)[0]
run_generate(model, [probe.prompt_ids], 4)  # warm-up: kernels selected, caches allocated
execution, _ = run_generate(model, [probe.prompt_ids], probe.max_new_tokens)
decode_tok_s = execution.decode_tok_s()
decode_mbu = dec.bytes * decode_tok_s / ceilings["copy_bytes_per_s"]
print(f"time to first token {execution.first_token_s * 1e3:.1f} ms; decode {decode_tok_s:.1f} tokens/s "
      f"({1e3 / decode_tok_s:.2f} ms/token) = {decode_mbu:.1%} of the bandwidth floor")

# %% [markdown]
# ### Where the time goes inside one `generate`
# The profiler records every kernel (on the CPU: every aten operator). Time not covered by any kernel is the
# device sitting idle while Python and the framework decide what to launch next.

# %%
prof = profile_run(lambda: run_generate(model, [probe.prompt_ids], probe.max_new_tokens), steps=probe.max_new_tokens,
                   warmup=0)
busy_in_generate = prof.busy_s / prof.wall_s
print(f"{prof.device}: busy {prof.busy_s * 1e3:.1f} ms of {prof.wall_s * 1e3:.1f} ms "
      f"({busy_in_generate:.1%}); {prof.kernels_per_step:.0f} kernels per decode step")
display(pd.DataFrame(prof.table()).round(4))
plot_timeline(prof, max_ms=min(prof.wall_s * 1e3, 3 * prof.wall_s * 1e3 / probe.max_new_tokens))
plt.title("three decode steps of HF generate: the gaps are an idle device")
plt.show()

# %% [markdown]
# ## Serve a queue of requests as traffic rises
# Requests arrive as a Poisson process; prompt lengths are uniform, output lengths exponential (clipped). The
# offered load is expressed as a multiple of what the FIFO server can complete back to back (its capacity). Each
# request's execution is real; the queue around it is replayed on a virtual clock from the arrival times.

# %%
workload = make_workload(SIZES["n_requests"], 1.0, LengthDist.uniform(*SIZES["prompt"]),
                         LengthDist.exponential(SIZES["out_mean"], low=2, high=SIZES["out_max"]), source, seed=seed)
rows = sweep_load(model, workload, SIZES["loads"], SIZES["static_batch"], busy_in_generate=busy_in_generate)
table = pd.DataFrame(rows)[["policy", "offered_load", "rate_req_s", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s",
                            "tpot_p50_s", "output_tok_s", "server_util", "device_busy_frac"]]
display(table.round(3))

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
for policy, g in table.groupby("policy"):
    axes[0].plot(g.offered_load, g.ttft_p99_s, "o-", label=f"{policy} p99")
    axes[0].plot(g.offered_load, g.ttft_p50_s, "x--", label=f"{policy} p50")
    axes[1].plot(g.offered_load, g.output_tok_s, "o-", label=policy)
    axes[2].plot(g.offered_load, g.device_busy_frac, "o-", label=policy)
axes[0].set(xlabel="offered load (x FIFO capacity)", ylabel="time to first token (s)", yscale="log",
            title="latency grows with traffic")
axes[1].set(xlabel="offered load (x FIFO capacity)", ylabel="output tokens/s", title="throughput")
axes[2].set(xlabel="offered load (x FIFO capacity)", ylabel="device busy share", ylim=(0, 1),
            title="the device is mostly idle")
for ax in axes:
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The symptoms, in numbers

# %%
fifo = table[table.policy.str.startswith("FIFO")]
ttft_growth = fifo.ttft_p99_s.iloc[-1] / fifo.ttft_p99_s.iloc[0]
peak_busy = table.device_busy_frac.max()
rec = write_record("00_baseline", {
    "model": model_name, "spec": spec.__dict__, "ceilings": ceilings, "sizes": SIZES,
    "decode_probe": {"context": context, "new_tokens": probe.max_new_tokens, "token_times_s": execution.token_times_s,
                     "total_s": execution.total_s, "decode_tok_s": decode_tok_s, "bytes_per_step": dec.bytes,
                     "floor_s": floor_s, "mbu": decode_mbu},
    "profile": {"wall_s": prof.wall_s, "busy_s": prof.busy_s, "by_category_s": prof.by_category(),
                "kernels_per_step": prof.kernels_per_step, "top_kernels": prof.top_kernels(15)},
    "workload": {"prompt": LengthDist.uniform(*SIZES["prompt"]).describe(),
                 "output": LengthDist.exponential(SIZES["out_mean"], 2, SIZES["out_max"]).describe(),
                 "requests": [(r.request_id, r.prompt_len, r.max_new_tokens) for r in workload]},
    "load_sweep": rows,
})
record_figure("baseline.hf_decode_bs1_tok_s", decode_tok_s, "tokens/s", rec,
              note=f"HF generate, batch 1, {model_name}, context {context}")
record_figure("baseline.hf_decode_bs1_mbu", decode_mbu, "fraction of bandwidth floor", rec)
record_figure("baseline.hf_busy_frac_in_generate", busy_in_generate, "fraction of wall time", rec)
record_figure("baseline.fifo_ttft_p99_growth", ttft_growth, "x (highest / lowest load)", rec)
pd.DataFrame([
    {"symptom": "decode speed vs bandwidth floor", "measured": f"{decode_tok_s:.1f} tok/s",
     "floor allows": f"{1 / floor_s:,.0f} tok/s", "ratio": f"{decode_mbu:.1%}"},
    {"symptom": "device busy inside generate", "measured": f"{busy_in_generate:.1%}", "floor allows": "100%",
     "ratio": ""},
    {"symptom": "p99 TTFT, highest vs lowest load (FIFO)", "measured": f"{ttft_growth:.1f}x",
     "floor allows": "flat", "ratio": ""},
    {"symptom": "peak device busy share while serving", "measured": f"{peak_busy:.1%}", "floor allows": "100%",
     "ratio": ""},
])

# %% [markdown]
# ## Takeaways
# * **Latency grows with traffic** because one request at a time cannot keep up: past the FIFO capacity the queue
#   (and time to first token) grows without bound. Static batches raise capacity but make every request wait for
#   the longest one in its batch.
# * **The device is mostly idle**: inside `generate` the profiler shows gaps between kernels (Python and launch
#   overhead), and between requests the server idles at low load.
# * **Decode runs far below the bandwidth floor** at batch 1. The floor is set by reading every weight once per
#   step, so batching (more tokens per weight read), removing launch overhead (CUDA graphs), moving fewer bytes
#   (quantisation, fused kernels) and a KV cache that admits more sequences are the levers. Notebook 01 diagnoses
#   which one binds where; 02–06 apply them one at a time.
