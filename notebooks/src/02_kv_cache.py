# %% [markdown]
# # 02 · The KV cache: growth, paging, prefix sharing, preemption and quantisation
#
# **The question.** The scenario's first area: *how to handle KV-cache growth during autoregressive generation.*
# Every generated token adds K and V vectors for every layer, and a request's final length is unknown when it
# arrives. A cache that reserves the longest possible sequence for every request wastes most of its memory, so
# few requests run at once and the GPU idles at peak traffic. The vLLM paper (Kwon et al., SOSP 2023) measured
# that earlier systems kept only 20-38% of KV memory holding tokens and lost 60-80% to reservation and
# fragmentation; its paged cache wastes under 4%.
#
# This notebook predicts KV memory by arithmetic, then simulates a realistic request mix against a fixed memory
# budget with `labkit.kvcache` and the engine's scheduler (contiguous slabs vs paged blocks, block size, prefix
# sharing), serves the embedded model with `labkit.engine` on the paged cache (token for token equal to Hugging
# Face `generate`, also through preemption), and measures what int8 and fp8 KV cost in accuracy and buy in memory.
#
# **The baseline** is a contiguous cache that reserves, for every request, the longest sequence of this workload
# (what Hugging Face's static cache and FasterTransformer reserve when told the real maximum); a slab of the
# model's whole context window (8,192 slots for Llama-3-8B) is shown only as a footnote.
#
# Two scales, as in every notebook: the memory arithmetic and the simulation use real shapes (the embedded model on `ci`/`cpu`,
# Llama-3-8B on an H200 on `gpu`); accuracy uses the embedded trained model; the `gpu` profile's latency parts
# use the Llama-3-8B shape with random weights.

# %% tags=["parameters"]
profile = "auto"
seed = 0
block_size = 16
system_prompt_len = 512
mem_utilisation = 0.9

# %%
import json

import matplotlib.pyplot as plt
import pandas as pd
import torch

import labkit  # noqa: F401  (sets up Triton for the host before anything imports it)
from labkit.bench import SUMMARY_PATH, record_figure, time_region, write_record
from labkit.claims import Claim, show
from labkit.data import sample_prompts, split_tokens
from labkit.evaluate import relative_error
from labkit.hardware import KNOWN
from labkit.engine import LLMEngine, SamplingParams
from labkit.experiments.kv_cache import (attention_latency, draw_block_table, kv_format_accuracy, lognormal_mix,
                                         simulate_contiguous, simulate_paged)
from labkit.kvcache import ContiguousKVCache, PagedKVCache, SeqBlocks, decode_attention, kv_format
from labkit.model import PRESETS, get_config, human_bytes, load_model, random_model
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
SIZES = {
    # sim_*: the request-mix simulation (max_num_seqs: the engine's cap on running sequences, both caches);
    # sweep_*/prefix_*: block-size and prefix runs; run_*: the embedded model
    "ci": dict(sim_model="tiny", sim_requests=250, sim_budget_tokens=16384, max_num_seqs=32, sweep_requests=120,
               sweep_budget_tokens=8192, sweep_blocks=[1, 4, 8, 16, 32, 64, 128, 256], prefix_requests=120,
               prefix_budget_tokens=16384, run_requests=8, run_prompt_mean=20, run_output_mean=40, run_max_len=128,
               acc_seq_len=128, acc_windows=4, lat=dict(num_seqs=4, context_len=256, num_heads=4, num_kv_heads=2,
                                                        head_dim=64), sample_every=4),
    "cpu": dict(sim_model="tiny", sim_requests=1000, sim_budget_tokens=65536, max_num_seqs=128, sweep_requests=400,
                sweep_budget_tokens=32768, sweep_blocks=[1, 4, 16, 64, 256], prefix_requests=400,
                prefix_budget_tokens=65536, run_requests=12, run_prompt_mean=48, run_output_mean=64,
                run_max_len=256, acc_seq_len=256, acc_windows=16,
                lat=dict(num_seqs=16, context_len=1024, num_heads=4, num_kv_heads=2, head_dim=64), sample_every=4),
    "gpu": dict(sim_model="llama-3-8b", sim_requests=8000, sim_budget_tokens=None, max_num_seqs=256, sweep_requests=600,
                sweep_budget_tokens=None, sweep_blocks=[1, 2, 4, 8, 16, 32, 64, 128, 256], prefix_requests=600,
                prefix_budget_tokens=None, run_requests=16, run_prompt_mean=48, run_output_mean=96,
                run_max_len=384, acc_seq_len=512, acc_windows=64,
                lat=dict(num_seqs=32, context_len=4096, num_heads=32, num_kv_heads=8, head_dim=128),
                sample_every=20),
}[PROFILE]
DEVICE = "cuda" if PROFILE == "gpu" else "cpu"
if DEVICE == "cpu":
    # The embedded model's matmuls are too small to gain from threads; on a shared CPU threads only contend.
    torch.set_num_threads(1)
print(PROFILE, DEVICE, SIZES)

# %% [markdown]
# ## Predict: KV bytes per token, per sequence, and the largest batch that fits
# Per token, every layer stores one K and one V vector per KV head: `2 x layers x kv_heads x head_dim x bytes`.
# Grouped-query attention (8 KV heads for 32 query heads in Llama-3-8B) cuts it 4x against full multi-head
# attention (GPT-3 keeps 96 KV heads). Next to the weights, what is left of the memory (we count
# `mem_utilisation` of it as usable, as vLLM does by default) bounds how many tokens can be cached at once; at
# full context that is the batch.

# %%
H200 = KNOWN["h200"]
rows = []
for name in ("tiny", "llama-3-8b", "gpt3-175b"):
    spec = PRESETS[name]
    per_tok = spec.kv_bytes_per_token("bf16")
    per_seq = per_tok * spec.max_position_embeddings
    row = {"model": name, "KV per token (bf16)": human_bytes(per_tok), "context": spec.max_position_embeddings,
           "KV per sequence at full context": human_bytes(per_seq), "weights (bf16)": human_bytes(spec.weight_bytes())}
    for gpus, label in ((1, "1 x H200"), (8, "8 x H200 node")):
        free = mem_utilisation * gpus * H200.mem_capacity - spec.weight_bytes("bf16")
        row[f"batch at full context, {label}"] = int(free // per_seq) if free > 0 else "weights do not fit"
    rows.append(row)
predict = pd.DataFrame(rows)
display(predict)

SIM_SPEC = get_config(SIZES["sim_model"])
MAX_LEN = SIM_SPEC.max_position_embeddings
if SIZES["sim_budget_tokens"] is None:  # gpu: the KV memory one H200 leaves beside Llama-3-8B's weights
    kv_budget = mem_utilisation * H200.mem_capacity - SIM_SPEC.weight_bytes("bf16")
    SIZES["sim_budget_tokens"] = int(kv_budget // SIM_SPEC.kv_bytes_per_token("bf16"))
    SIZES["sweep_budget_tokens"] = SIZES["prefix_budget_tokens"] = SIZES["sim_budget_tokens"] // 16
BUDGET = SIZES["sim_budget_tokens"]
print(f"simulation: {SIM_SPEC.name}, max_len {MAX_LEN}, budget {BUDGET} tokens = "
      f"{human_bytes(BUDGET * SIM_SPEC.kv_bytes_per_token('bf16'))} of bf16 KV")

# %% [markdown]
# **The request mix.** Prompt and output lengths are drawn independently from log-normal distributions with the
# means the vLLM paper reports for ShareGPT conversations (161 prompt and 338 output tokens) and `sigma = 1` in
# log space: a heavy right tail, where a few requests run ten times the median. Pairs longer than the model's
# context are drawn again (the count is printed), never cut.
#
# *Prediction.* A contiguous cache reserves `max_len` slots per request, while a request holds on average about
# `prompt + output/2` tokens over its life; a paged cache wastes only the unfilled part of each sequence's last
# block, about `block_size / 2` slots.

# %%
mix = lognormal_mix(SIZES["sim_requests"], MAX_LEN, seed=seed)
mean_held = sum(p + o / 2 for p, o in zip(mix.prompt_lens, mix.output_lens)) / len(mix)
pred_contig_waste = 1 - mean_held / MAX_LEN
pred_paged_waste = (block_size / 2) / (mean_held + block_size / 2)
print(mix.distribution)
print(f"{len(mix)} requests, {mix.redrawn} redrawn; prompt median {sorted(mix.prompt_lens)[len(mix) // 2]}, "
      f"max {max(mix.prompt_lens)}; output median {sorted(mix.output_lens)[len(mix) // 2]}, max {max(mix.output_lens)}")
print(f"predicted waste: contiguous {pred_contig_waste:.1%}, paged (block {block_size}) {pred_paged_waste:.1%}; "
      f"predicted concurrency ratio about {(MAX_LEN / mean_held):.1f}x")
fig, ax = plt.subplots(1, 2, figsize=(10, 3))
ax[0].hist(mix.prompt_lens, bins=60, log=True)
ax[0].set(title="prompt tokens", xlabel="tokens", ylabel="requests (log)")
ax[1].hist(mix.output_lens, bins=60, log=True, color="C1")
ax[1].set(title="output tokens", xlabel="tokens")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Baseline: one slab per request, sized to the workload's longest sequence
# `simulate_contiguous` serves the mix first come, first served: a request is admitted when a slab is free and
# holds it until its last token, with at most `max_num_seqs` running (the engine's cap, the same on both sides).
# The slab is the longest `prompt + output` of the mix: the best a contiguous cache can do when the maximum is
# known in advance. (The footnote at the end runs the same with a slab of the model's whole context.) The
# simulation advances in steps, but a step of many sequences reads more than a step of few: each run's time is
# computed from the bytes it reads (weights once per step, every running sequence's cached tokens) and its prefill
# FLOPs, at the H200's datasheet rates (`SimResult.time_s`).

# %%
WL_MAX = max(mix.total_tokens)
CAP = SIZES["max_num_seqs"]
contig = simulate_contiguous(mix, BUDGET, WL_MAX, sample_every=SIZES["sample_every"], max_num_seqs=CAP)
contig_uncapped = simulate_contiguous(mix, BUDGET, MAX_LEN, sample_every=SIZES["sample_every"], max_num_seqs=CAP)
print(f"longest sequence of the mix: {WL_MAX} tokens (the model's context: {MAX_LEN})")
print({k: round(v, 4) if isinstance(v, float) else v for k, v in contig.to_dict().items()})

# %% [markdown]
# ## Technique: the paged cache
# `simulate_paged` drives the serving engine's own continuous-batching scheduler (`labkit.engine`) over a
# `PagedKVCache` built without tensors: blocks of `block_size` tokens are allocated as sequences grow, admission
# keeps 1% of the blocks free (vLLM's watermark), at most `max_num_seqs` run at once, and when blocks run out the
# youngest running request is preempted (recompute) and requeued at the front.

# %%
paged = simulate_paged(mix, BUDGET, block_size, sample_every=SIZES["sample_every"], seed=seed, max_num_seqs=CAP)
print({k: round(v, 4) if isinstance(v, float) else v for k, v in paged.to_dict().items()})
max_seqs_ratio = paged.mean_running_saturated / contig.mean_running_saturated
max_seqs_ratio_uncapped = paged.mean_running_saturated / contig_uncapped.mean_running_saturated
TIME_HW = H200  # the time model's rates (datasheet bandwidth and bf16 matmul), for the simulated model's bytes
sim_time = {name: r.time_s(SIM_SPEC, TIME_HW) for name, r in (("contiguous", contig), ("context slab", contig_uncapped),
                                                              ("paged", paged))}
paged_speedup = sim_time["contiguous"] / sim_time["paged"]
paged_speedup_slab = sim_time["context slab"] / sim_time["paged"]
print(f"waste: contiguous {contig.waste_frac:.1%} -> paged {paged.waste_frac:.1%}; concurrent sequences while "
      f"requests wait (at most {CAP}): {contig.mean_running_saturated:.0f} -> {paged.mean_running_saturated:.0f} "
      f"({max_seqs_ratio:.1f}x); time to serve the mix from bytes read ({SIM_SPEC.name} on {TIME_HW.name}): "
      f"{sim_time['contiguous']:.2f} s -> {sim_time['paged']:.2f} s ({paged_speedup:.2f}x; in steps "
      f"{contig.steps} -> {paged.steps}, which counts a step of {CAP} sequences like a step of one)")

fig, ax = plt.subplots(1, 2, figsize=(12, 3.5))
for r, label in ((contig, f"contiguous (slabs of {WL_MAX})"), (paged, paged.name)):
    ax[0].plot(r.trace["step"], r.trace["running"], label=label)
    ax[1].plot(r.trace["step"], [h / max(s, 1) for h, s in zip(r.trace["held"], r.trace["reserved"])], label=label)
ax[0].set(xlabel="decode step", ylabel="running sequences", title="concurrency under one budget")
ax[1].set(xlabel="decode step", ylabel="tokens held / slots reserved", title="reserved memory that holds tokens",
          ylim=(0, 1.05))
for a in ax:
    a.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Correctness: the paged cache against the contiguous one and against Hugging Face
# Attention over K/V written to both caches in irregular chunks must agree to float32 tolerance; and the
# embedded model served by labkit's engine (`LLMEngine`: its model runner over the paged cache) must produce
# exactly the greedy tokens of HF `generate` with its default cache.

# %%
g = torch.Generator().manual_seed(seed)
lens, heads, kv_heads, d = [3, 17, 40, 1, 29], 4, 2, 64
cc = ContiguousKVCache(1, kv_heads, d, max_seqs=len(lens), max_len=64)
pc = PagedKVCache(1, kv_heads, d, num_blocks=32, block_size=block_size)
seqs = [SeqBlocks([0] * n, sid) for sid, n in enumerate(lens)]  # a sequence owns its tokens and its block table
for seq, n in zip(seqs, lens):
    k, v = torch.randn(2, n, kv_heads, d, generator=g)
    cc.write(0, torch.tensor(cc.allocate(seq.seq_id, n)), k, v)
    pc.allocate(seq)
    pc.write(0, torch.tensor(pc.slots(seq, 0, n)), k, v)
q = torch.randn(len(lens), heads, d, generator=g)
ids = list(range(len(lens)))
attn_err = relative_error(decode_attention(q, pc.k_caches[0], pc.v_caches[0], pc.block_tables(seqs),
                                           pc.context_lens(seqs), backend="torch"), cc.attention(0, q, ids))
print(f"paged vs contiguous attention: relative error {attn_err:.2e} (bound 1e-5)")
assert attn_err <= 1e-5

# %% [markdown]
# ### What the block table is
# A small cache (blocks of 4 tokens) after a few decode steps: four prompts are admitted, every running sequence
# gains a token per step (so their new blocks interleave in the pool), B finishes and gives its blocks back, and E
# arrives. Drawn from the cache's own block tables: each sequence's logical blocks (left) name physical blocks
# anywhere in the pool (right). Only a sequence's last block is partly empty, so at most `block_size - 1` slots per
# sequence are wasted, and nothing is reserved for tokens not yet generated.

# %%
demo = PagedKVCache(1, 1, 1, num_blocks=24, block_size=4, allocate_pools=False)
live = {sid: SeqBlocks([0] * n, sid) for sid, n in {"A": 6, "B": 3, "C": 9, "D": 2}.items()}
for seq in live.values():
    demo.allocate(seq)
for step in range(7):
    if step == 3:
        demo.free(live.pop("B"))
    if step == 5:
        live["E"] = SeqBlocks([0] * 5, "E")
        demo.allocate(live["E"])
    for seq in live.values():
        seq.token_ids.append(0)  # a decode step's new token, then its slot
        demo.append_slots(seq)
draw_block_table(demo, [live[s] for s in "ACDE"])
plt.show()

model, tok = load_model(device=DEVICE)
prompts = [p[:n] for p, n in zip(sample_prompts(tok, 3, 40, seed=seed), (40, 9, 23))]
engine = LLMEngine(model, tok, num_blocks=64, block_size=block_size)
greedy16 = SamplingParams(max_tokens=16, ignore_eos=True)
paged_out = [o.output_token_ids for o in engine.generate(prompts, greedy16, progress=False)]
hf_out = [model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
print("engine on the paged cache == HF generate, token for token:", paged_out == hf_out)
assert paged_out == hf_out
del engine

# %% [markdown]
# ## Block size: internal fragmentation against table size
# Larger blocks mean fewer block-table entries (and, in the attention kernel, longer contiguous reads per
# gather); smaller blocks waste less of each sequence's last block. A block of 1 is pure token-level paging.

# %%
sweep_mix = lognormal_mix(SIZES["sweep_requests"], MAX_LEN, seed=seed + 1)
sweep_contig = simulate_contiguous(sweep_mix, SIZES["sweep_budget_tokens"], MAX_LEN)
sweep = []
for bs in SIZES["sweep_blocks"]:
    r = simulate_paged(sweep_mix, SIZES["sweep_budget_tokens"], bs, sample_every=SIZES["sample_every"], seed=seed)
    sweep.append({"block_size": bs, "waste_frac": r.waste_frac, "running (saturated)": r.mean_running_saturated,
                  "vs contiguous": r.mean_running_saturated / sweep_contig.mean_running_saturated,
                  "table entries / seq": r.table_entries_per_seq, "table bytes / seq": 4 * r.table_entries_per_seq,
                  "preemptions": r.preemptions, "steps": r.steps})
if DEVICE == "cuda":  # the kernel's view: one layer of Llama-3-8B decode attention per block size
    for row in sweep:
        if row["block_size"] >= 8:
            t, nbytes = attention_latency("bf16", block_size=row["block_size"], dtype=torch.bfloat16, device=DEVICE,
                                          **SIZES["lat"])
            row["attention us (8B layer)"] = t.median_us
            row["TB/s"] = nbytes / t.median_s / 1e12
sweep_df = pd.DataFrame(sweep)
display(sweep_df.round(4))
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(sweep_df["block_size"], sweep_df["waste_frac"], "o-", label="waste fraction")
ax.set(xscale="log", xlabel="block size (tokens)", ylabel="reserved but empty")
ax2 = ax.twinx()
ax2.plot(sweep_df["block_size"], sweep_df["table bytes / seq"], "s--", color="C1", label="table bytes / seq")
ax2.set(yscale="log", ylabel="block-table bytes per sequence")
ax.axhline(0.04, color="gray", lw=0.8, ls=":")
fig.legend(loc="upper center")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Prefix sharing: a common system prompt
# Every request now starts with the same `system_prompt_len` tokens. With prefix caching a full block is named by
# a hash chained to the previous block's hash, so requests with the same prefix share its blocks (reference
# counted) and skip its prefill; freed blocks stay findable until evicted least-recently-used.

# %%
prefix_mix = lognormal_mix(SIZES["prefix_requests"], MAX_LEN - system_prompt_len, seed=seed + 2)
prefix_runs = {}
for on in (False, True):
    prefix_runs[on] = simulate_paged(prefix_mix, SIZES["prefix_budget_tokens"], block_size,
                                     system_prompt_len=system_prompt_len, enable_prefix_caching=on,
                                     sample_every=SIZES["sample_every"], seed=seed)
prefix_df = pd.DataFrame([{"prefix caching": on, "KV memory saved by sharing": r.sharing_saving_frac,
                           "running (saturated)": r.mean_running_saturated, "prefill tokens": r.prefill_tokens,
                           "prefill tokens from cache": r.prefix_cached_tokens, "steps": r.steps,
                           "preemptions": r.preemptions} for on, r in prefix_runs.items()])
display(prefix_df.round(4))
prefix_saving_frac = prefix_runs[True].sharing_saving_frac

# %% [markdown]
# The same on the embedded model: the system prompt is served once, then requests that extend it reuse its
# cached blocks. The outputs must not change.

# %%
sys_prompt = split_tokens("heldout", tok, max_tokens=4 * block_size + 5)[: 4 * block_size + 5].tolist()
users = sample_prompts(tok, 4, 8, seed=seed + 3)
pc_out, pc_stats, pc_ttft = {}, {}, {}
for on in (False, True):
    engine = LLMEngine(model, num_blocks=48, block_size=block_size, enable_prefix_caching=on)
    engine.generate([sys_prompt], SamplingParams(max_tokens=1), progress=False)  # the system prompt was served before
    outs = engine.generate([sys_prompt + u for u in users], SamplingParams(max_tokens=12, ignore_eos=True),
                           progress=False)
    pc_out[on] = [o.output_token_ids for o in outs]
    pc_stats[on] = engine.run_stats()  # of the second run only: each generate starts fresh statistics
    pc_ttft[on] = sum(o.metrics.ttft_s for o in outs) / len(outs)
    del engine
print("outputs identical with and without prefix caching:", pc_out[True] == pc_out[False])
assert pc_out[True] == pc_out[False]
print(f"prefill tokens computed: {pc_stats[False]['admitted_tokens']} -> {pc_stats[True]['admitted_tokens']} "
      f"({pc_stats[True]['prefix_hit_tokens']} taken from the cache); peak blocks "
      f"{pc_stats[False]['peak_blocks_used']} -> {pc_stats[True]['peak_blocks_used']}")
prefix_ttft_speedup = pc_ttft[False] / pc_ttft[True]
prefix_prefill_saved = 1 - pc_stats[True]["admitted_tokens"] / pc_stats[False]["admitted_tokens"]
print(f"mean time to first token {pc_ttft[False] * 1e3:.1f} ms -> {pc_ttft[True] * 1e3:.1f} ms "
      f"({prefix_ttft_speedup:.2f}x); prefill tokens saved: {prefix_prefill_saved:.0%}")

# %% [markdown]
# ## Over-subscription: preemption by recompute and by swap
# A cache far smaller than the workload needs at once. When a running request needs a block and none is free,
# the youngest gives its blocks up: *recompute* frees them and prefills again later; *swap* copies them to CPU
# memory and back. The engine does either (`LLMEngine(..., preemption_mode="recompute" | "swap")`); every request
# must finish with exactly the tokens of an unconstrained run.

# %%
run_mix = lognormal_mix(SIZES["run_requests"], SIZES["run_max_len"], prompt_mean=SIZES["run_prompt_mean"],
                        output_mean=SIZES["run_output_mean"], seed=seed + 4)
texts = sample_prompts(tok, len(run_mix), max(run_mix.prompt_lens), seed=seed + 5)
run_prompts = [t[:n] for t, n in zip(texts, run_mix.prompt_lens)]
need_all = sum(-(-(p + o - 1) // block_size) for p, o in zip(run_mix.prompt_lens, run_mix.output_lens))
need_one = max(-(-(p + o - 1) // block_size) for p, o in zip(run_mix.prompt_lens, run_mix.output_lens))
small = max(need_one, need_all // 4)


def run_preemption(model, prompts, outputs, num_blocks, mode):
    # on CUDA the engine's graphs take one block of the cache as scratch for padding rows: give it one more
    engine = LLMEngine(model, num_blocks=num_blocks + (DEVICE == "cuda"), block_size=block_size, preemption_mode=mode,
                       max_num_seqs=32)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in outputs]
    out = {}
    timing = time_region(lambda: out.update(res=engine.generate(prompts, params, progress=False)), device=DEVICE,
                         warmup=0, iters=1)
    s = engine.run_stats()
    del engine
    return [o.output_token_ids for o in out["res"]], {
        "mode": mode, "blocks": num_blocks, "seconds": timing.median_s, "tokens/s": sum(outputs) / timing.median_s,
        "preemptions": s["preemptions"], "recomputed tokens": s["recomputed_tokens"],
        "blocks swapped out": s["swapped_out_blocks"], "peak running": s["peak_running"], "steps": s["steps"]}


pre_rows, pre_out = [], {}
for mode, blocks in (("unconstrained", need_all), ("recompute", small), ("swap", small)):
    pre_out[mode], row = run_preemption(model, run_prompts, run_mix.output_lens, blocks,
                                        "recompute" if mode == "unconstrained" else mode)
    row["mode"] = mode
    pre_rows.append(row)
pre_df = pd.DataFrame(pre_rows)
display(pre_df.round(3))
same = {m: pre_out[m] == pre_out["unconstrained"] for m in ("recompute", "swap")}
print(f"{len(run_prompts)} requests, cache of {small} blocks for {need_all} needed at once;"
      f" outputs identical to unconstrained: {same}")
assert all(same.values())
assert pre_rows[1]["preemptions"] > 0 and pre_rows[2]["blocks swapped out"] > 0, "the cache was not over-subscribed"

# %% [markdown]
# On the `gpu` profile, the same over-subscribed run on the Llama-3-8B shape (bf16, random weights) shows what
# each preemption mode costs at full size (with random weights only the timings mean anything).

# %%
big_pre = []
if DEVICE == "cuda":
    big = random_model("llama-3-8b", device="cuda", dtype=torch.bfloat16, seed=seed)
    b_mix = lognormal_mix(24, 640, prompt_mean=256, output_mean=96, sigma=0.5, seed=seed + 6)
    b_prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in b_mix.prompt_lens]
    b_all = sum(-(-(p + o - 1) // block_size) for p, o in zip(b_mix.prompt_lens, b_mix.output_lens))
    b_one = max(-(-(p + o - 1) // block_size) for p, o in zip(b_mix.prompt_lens, b_mix.output_lens))
    for mode, blocks in (("unconstrained", b_all), ("recompute", max(b_one, b_all // 4)),
                         ("swap", max(b_one, b_all // 4))):
        _, row = run_preemption(big, b_prompts, b_mix.output_lens, blocks,
                                "recompute" if mode == "unconstrained" else mode)
        row["mode"] = mode
        big_pre.append(row)
    del big
    torch.cuda.empty_cache()
    display(pd.DataFrame(big_pre).round(3))

# %% [markdown]
# ## Quantised KV: int8 and fp8 (e4m3)
# *Speed is not measured here.* Whether reading half the bytes makes decode attention faster depends on the
# kernel that reads them; notebook 03 times it at one shape (batch 16, context 4096) and records it as
# `kvcache.int8_attn_speedup_ctx4k_b16` and `kvcache.fp8_attn_speedup_ctx4k_b16`, the one figure for each format's
# KV attention (quoted in the table below when the summary has them), and plots both over context beside bf16.
#
# K and V are stored in 8 bits with one float32 scale per token and KV head (no calibration: each token's scale
# comes from its own values) and dequantised when read. Accuracy: every scored token of the held-out text attends
# to K/V read back from the quantised cache, so it sees what decoding would. The reference is the model's own
# dtype (float32 here).

# %%
heldout = split_tokens("heldout", tok)
acc = kv_format_accuracy(model, heldout, ("int8", "fp8"), seq_len=SIZES["acc_seq_len"],
                         max_windows=SIZES["acc_windows"], batch_size=4, block_size=block_size, spread=True)
ref_ppl = acc["reference"]["ppl"]
lat_ref = "bf16" if DEVICE == "cuda" else "fp32"
spec8 = PRESETS["llama-3-8b"]
kv_free = mem_utilisation * H200.mem_capacity - spec8.weight_bytes("bf16")
quant_rows = []
for name, fmt_name in (("reference", lat_ref), ("int8", "int8"), ("fp8", "fp8")):
    a = acc[name]
    per_tok_8b = kv_format(fmt_name if name != "reference" else "bf16").bytes_per_token(
        spec8.num_layers, spec8.num_kv_heads, spec8.head_dim)
    quant_rows.append({
        "KV format": f"{name} ({fmt_name})" if name == "reference" else name,
        "perplexity": a["ppl"], "ppl delta": a["ppl"] / ref_ppl - 1, "logit rel. error": a["logit_rel_err"],
        "top-1 agreement": a["top1_agree"], "bytes/token (embedded)": a["bytes_per_token"],
        "bytes/token (Llama-3-8B)": per_tok_8b, "tokens in one H200 beside 8B": int(kv_free // per_tok_8b)})
quant_df = pd.DataFrame(quant_rows)
display(quant_df.round(5))
int8_bytes_ratio = quant_rows[1]["bytes/token (Llama-3-8B)"] / quant_rows[0]["bytes/token (Llama-3-8B)"]
print(f"accuracy on {acc['reference']['scored_tokens']} held-out tokens of the embedded model (windows spread over "
      f"the split); int8 KV holds {int8_bytes_ratio:.3f}x the bytes per token of bf16 (scales included)")
fig, ax = plt.subplots(1, 2, figsize=(10, 3))
ax[0].bar(quant_df["KV format"], quant_df["bytes/token (Llama-3-8B)"] / 1024)
ax[0].set(ylabel="KiB per token", title="Llama-3-8B KV per token")
ax[1].bar(quant_df["KV format"], 100 * quant_df["ppl delta"], color="C1")
ax[1].axhline(0.5, color="gray", ls=":", lw=0.8)
ax[1].set(ylabel="perplexity change (%)", title="accuracy cost (embedded model)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Trade-offs and the record

# %%
from labkit.figures import committed_figures  # noqa: E402  (each figure's committed value, a GPU's first)

_figs = committed_figures() if SUMMARY_PATH.exists() else {}


def kv_attention_latency(fmt: str) -> str:
    """The committed speed of notebook 03's ``fmt`` KV attention over bf16, or where it will be measured."""
    name = f"kvcache.{fmt}_attn_speedup_ctx4k_b16"
    speed = _figs.get(name)
    return (f"{speed['value']:.2f}x bf16 attention speed (notebook 03, batch 16, context 4096, {speed['machine']})"
            if speed else f"measured in notebook 03 ({name})")


int8_latency, fp8_latency = kv_attention_latency("int8"), kv_attention_latency("fp8")
tradeoff = pd.DataFrame([
    {"technique": "paged KV cache (block 16)", "accuracy": "unchanged (token-identical)",
     "memory": f"waste {contig.waste_frac:.0%} -> {paged.waste_frac:.1%}; {max_seqs_ratio:.1f}x sequences "
               f"(vs slabs of the workload's longest sequence, {WL_MAX} tokens)",
     "latency": "block-table gather in attention; more sequences share each weight read: time from bytes "
                f"{sim_time['contiguous']:.2f} s -> {sim_time['paged']:.2f} s ({paged_speedup:.2f}x)"},
    {"technique": "prefix caching", "accuracy": "unchanged (token-identical)",
     "memory": f"{prefix_saving_frac:.0%} of KV shared with a {system_prompt_len}-token system prompt",
     "latency": "shared prefix is not prefilled again (hashing per full block)"},
    {"technique": "preemption (recompute / swap)", "accuracy": "unchanged (token-identical)",
     "memory": "runs workloads larger than the cache", "latency": "recompute: prefill again; swap: PCIe copies"},
    {"technique": "int8 KV", "accuracy": f"ppl {quant_rows[1]['ppl delta']:+.3%}",
     "memory": f"{int8_bytes_ratio:.2f}x bf16", "latency": int8_latency},
    {"technique": "fp8 e4m3 KV", "accuracy": f"ppl {quant_rows[2]['ppl delta']:+.3%}",
     "memory": f"{quant_rows[2]['bytes/token (Llama-3-8B)'] / quant_rows[0]['bytes/token (Llama-3-8B)']:.2f}x bf16",
     "latency": f"{fp8_latency}; the same bytes as int8"},
])
display(tradeoff)

rec = write_record("02_kv_cache", {
    "profile": PROFILE, "sizes": SIZES, "block_size": block_size, "mem_utilisation": mem_utilisation,
    "predict": predict.to_dict("records"), "mix": {"distribution": mix.distribution, "redrawn": mix.redrawn,
                                                   "prompt_lens": mix.prompt_lens, "output_lens": mix.output_lens},
    "predicted_waste": {"contiguous": pred_contig_waste, "paged": pred_paged_waste},
    "workload_max_len": WL_MAX, "max_num_seqs": CAP, "time_model": {"hardware": TIME_HW.name, "seconds": sim_time},
    "contiguous": contig.to_dict(), "contiguous_uncapped": contig_uncapped.to_dict(),
    "paged": paged.to_dict(), "block_size_sweep": sweep,
    "prefix_sim": {str(k): v.to_dict() for k, v in prefix_runs.items()},
    "prefix_model": {str(k): v for k, v in pc_stats.items()},
    "preemption": pre_rows, "preemption_8b": big_pre, "attention_rel_err": attn_err,
    "kv_accuracy": acc, "kv_formats": quant_rows,
})
n = "sequences while requests wait"
record_figure("kvcache.contiguous_waste_frac", contig_uncapped.waste_frac, "fraction of reserved KV slots", rec,
              note=f"footnote: slabs of the whole context, {SIM_SPEC.name}, max_len {MAX_LEN}, budget {BUDGET} "
                   f"tokens, {len(mix)} log-normal requests")
record_figure("kvcache.contiguous_waste_frac_workload_max", contig.waste_frac, "fraction of reserved KV slots", rec,
              note=f"slabs of the workload's longest sequence ({WL_MAX} tokens), same mix and budget")
record_figure("kvcache.workload_max_len", WL_MAX, "tokens", rec, note=f"model context {MAX_LEN}", derived=True)
record_figure("kvcache.paged_waste_frac", paged.waste_frac, "fraction of reserved KV slots", rec, bar="<= 0.04",
              note=f"block size {block_size}, same mix and budget")
record_figure("kvcache.max_seqs_ratio", max_seqs_ratio_uncapped, "paged / contiguous running sequences", rec,
              bar=">= 2.5", note=f"footnote, slabs of the whole context ({MAX_LEN}), at most {CAP} running: mean "
                                 f"{n}: {paged.mean_running_saturated:.0f} vs "
                                 f"{contig_uncapped.mean_running_saturated:.0f}")
record_figure("kvcache.max_seqs_ratio_vs_workload_max", max_seqs_ratio, "paged / contiguous running sequences", rec,
              note=f"slabs of the workload's longest sequence ({WL_MAX}), at most {CAP} running on both sides: mean "
                   f"{n}: {paged.mean_running_saturated:.0f} vs {contig.mean_running_saturated:.0f}")
record_figure("kvcache.max_num_seqs", CAP, "sequences", rec, derived=True,
              note="the cap on running sequences of both simulated caches")
record_figure("kvcache.paged_speedup_vs_workload_max", paged_speedup, "x (contiguous time / paged time)", rec,
              note=f"time from bytes read and prefill FLOPs ({SIM_SPEC.name}, {TIME_HW.name} datasheet rates), slabs "
                   f"of the workload's longest sequence, at most {CAP} running on both sides")
record_figure("kvcache.paged_speedup_vs_context_slab", paged_speedup_slab, "x (contiguous time / paged time)", rec,
              note=f"footnote: the same against slabs of the whole context ({MAX_LEN})")
record_figure("kvcache.int8_bytes_per_token_ratio", int8_bytes_ratio, "int8 / bf16 KV bytes per token", rec,
              note="Llama-3-8B shape, one float32 scale per token and KV head", derived=True)
record_figure("kvcache.engine_matches_hf", paged_out == hf_out, "bool", rec)
record_figure("kvcache.preemption_outputs_identical", all(same.values()), "bool", rec,
              note="recompute and swap against an unconstrained run")
record_figure("kvcache.prefix_outputs_identical", pc_out[True] == pc_out[False], "bool", rec)
record_figure("kvcache.prefix_ttft_speedup", prefix_ttft_speedup, "x (mean TTFT without / with)", rec,
              note=f"embedded model, {len(users)} requests extending a {len(sys_prompt)}-token system prompt served "
                   "before, all admitted at once")
record_figure("kvcache.prefix_prefill_saved_frac", prefix_prefill_saved, "fraction of prefill tokens", rec,
              note="prompt tokens the engine did not compute because their blocks were cached (same requests)")
record_figure("kvcache.prefix_saving_frac", prefix_saving_frac, "fraction of KV memory", rec,
              note=f"{system_prompt_len}-token shared system prompt, prefix caching on")
record_figure("kvcache.int8_ppl_delta_frac", abs(quant_rows[1]["ppl delta"]), "relative perplexity change", rec,
              bar="<= 0.005", note=f"embedded model, {acc['reference']['scored_tokens']} held-out tokens")
record_figure("kvcache.fp8_ppl_delta_frac", abs(quant_rows[2]["ppl delta"]), "relative perplexity change", rec,
              note="fp8 e4m3 with per-token-head scales")
print(rec)

# %% [markdown]
# *Footnote: the uncapped slab.* Reserving the model's whole context per request (8,192 slots for Llama-3-8B on
# the `gpu` profile, 2,048 for the tiny preset on the CPU), as a cache that does not know the workload must, wastes
# far more: the figures `kvcache.contiguous_waste_frac`, `kvcache.max_seqs_ratio` and
# `kvcache.paged_speedup_vs_context_slab` keep that comparison; they are not the headline.

# %%
print(f"slabs of {MAX_LEN}: waste {contig_uncapped.waste_frac:.1%}, paged runs {max_seqs_ratio_uncapped:.1f}x the "
      f"sequences in {1 / paged_speedup_slab:.2f}x the time; slabs of {WL_MAX} (the headline): waste "
      f"{contig.waste_frac:.1%}, {max_seqs_ratio:.1f}x the sequences in {1 / paged_speedup:.2f}x the time")

# %% [markdown]
# ## Takeaways

# %%
show(
    Claim("Against a contiguous cache that reserves the workload's longest sequence "
          "({kvcache.workload_max_len} tokens) per request, {kvcache.contiguous_waste_frac_workload_max:.0%} of the "
          "reserved slots hold no token; paged blocks of 16 waste {kvcache.paged_waste_frac:.1%}",
          "kvcache.paged_waste_frac < kvcache.contiguous_waste_frac_workload_max", machine="any"),
    Claim("Paged blocks of 16 tokens leave {kvcache.paged_waste_frac:.1%} of the reserved KV slots empty, under "
          "vLLM's 4%", "kvcache.paged_waste_frac <= 0.04", machine="any"),
    Claim("The same memory runs {kvcache.max_seqs_ratio_vs_workload_max:.1f}x the sequences at once when paged "
          "(baseline: slabs of the workload's longest sequence; both sides capped at the same max_num_seqs)",
          "kvcache.max_seqs_ratio_vs_workload_max > 1", machine="any"),
    Claim("Timed by the bytes each step reads (weights once, every running sequence's cache) and the prefill FLOPs, "
          "the paged cache serves the mix in 1/{kvcache.paged_speedup_vs_workload_max:.2f} of the contiguous cache's "
          "time: at least as fast, by less than its concurrency gain, since more sequences per step means more KV "
          "read per step", "1 <= kvcache.paged_speedup_vs_workload_max < kvcache.max_seqs_ratio_vs_workload_max",
          machine="any"),
    Claim("A shared system prompt held once saves {kvcache.prefix_saving_frac:.0%} of the KV memory with prefix "
          "caching, over a fifth", "kvcache.prefix_saving_frac > 0.2", machine="any"),
    Claim("Prefix caching changes no output token", "kvcache.prefix_outputs_identical == True", machine="any"),
    Claim("The engine on the paged cache produces Hugging Face generate's greedy tokens, token for token",
          "kvcache.engine_matches_hf == True", machine="any"),
    Claim("Over-subscribed, recompute and swap preemption finish every request with the unconstrained tokens",
          "kvcache.preemption_outputs_identical == True", machine="any"),
    "int8 KV stores {kvcache.int8_bytes_per_token_ratio:.2f}x the bytes per token of bf16 (scales included)",
    Claim("int8 KV moves perplexity by {kvcache.int8_ppl_delta_frac:.4%}, within the 0.5% bar",
          "kvcache.int8_ppl_delta_frac <= 0.005", machine="any"),
    Claim("fp8 e4m3 KV (3 mantissa bits, per-token scales) moves perplexity by {kvcache.fp8_ppl_delta_frac:.3%}, "
          "within 1%", "kvcache.fp8_ppl_delta_frac <= 0.01", machine="any"),
)

# %% [markdown]
# * **Block size is a small knob.** Waste grows with the block size and the table shrinks; 16 is the usual choice
#   (the GPU kernel reads a block's tokens contiguously, so tiny blocks cost bandwidth).
# * **Whether 8-bit KV is also faster is a kernel question**, answered in notebook 03
#   (`kvcache.int8_attn_speedup_ctx4k_b16` and `kvcache.fp8_attn_speedup_ctx4k_b16` at one shape, and a sweep over
#   context): halving the bytes halves the floor, and only a kernel that dequantises in registers can approach it.
#   Its memory gain holds whatever the kernel.
