# %% [markdown]
# # 06 · Tensor and pipeline parallelism: what each costs in communication, bubbles and memory
#
# **The question.** The scenario's third area: *strategies to mitigate communication overhead in multi-node
# inference*; and its follow-up: *if the model exceeds one GPU, how do you decide between pipeline and tensor
# parallelism?* A 175B model in bf16 is 350 GB of weights: it must be split. This notebook splits a real model
# both ways, checks that the split model computes the same thing, measures what the split costs, and then works
# through the 175B case with a cost model whose inputs are the numbers measured here.
#
# * **Tensor parallelism (TP, Megatron-LM)**: every layer's matrices are cut across GPUs; each layer needs two
#   all-reduces of the activations. Latency per token falls with the GPU count, communication is on the
#   critical path of every layer.
# * **Pipeline parallelism (PP, GPipe / 1F1B)**: consecutive layers go to different GPUs; only the activations at
#   a stage boundary travel, once per stage. Communication is small, but stages wait for each other (the bubble).
#
# Everything runs for real on CPU processes with `torch.distributed` (gloo), launched from this notebook by
# `labkit.parallel.launch`, with the embedded model in float32: TP and PP outputs are checked against the
# single-process model. Multi-GPU (NCCL) numbers come from `scripts/bench_multigpu.py` on a machine with several GPUs and are quoted
# below when their records exist.

# %% tags=["parameters"]
profile = "auto"
seed = 0

# %%
import json
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display

import labkit  # noqa: F401
from labkit.bench import record_figure, time_fn, write_record
from labkit.experiments import parallelism as ex
from labkit.experiments.parallelism import bubble_table, comm_fits, plot_comm, plot_schedule_timeline, pp_bubble, pp_check
from labkit.experiments.parallelism.report import case_175b_text
from labkit.data import REPO_ROOT
from labkit.model import PRESETS, TINY, human_bytes, load_model
from labkit.parallel import cost_model as cm
from labkit.parallel import launch
from labkit.workbook import resolve_profile

PROFILE = resolve_profile(profile)
SIZES = {
    "ci": dict(tp_worlds=[2], pp_worlds=[2], prompt=(2, 16), new_tokens=6, ms=[1, 2, 4], mb_size=2, seq=32,
               repeats=2, comm_sizes=[2**k for k in range(4, 21, 2)], comm_iters=3, time_iters=5),
    "cpu": dict(tp_worlds=[2, 4], pp_worlds=[2], prompt=(4, 64), new_tokens=16, ms=[1, 2, 4, 8], mb_size=2,
                seq=128, repeats=5, comm_sizes=[2**k for k in range(4, 25, 2)], comm_iters=10, time_iters=10),
    # gpu: the cpu sizes and a 4-stage pipeline (the TP/PP processes are gloo on the host CPU on any machine; the
    # H100's first run spent 57 s + 31 s in them at micro-batches of 4 and messages up to 2**26 elements)
    "gpu": dict(tp_worlds=[2, 4], pp_worlds=[2, 4], prompt=(4, 64), new_tokens=16, ms=[1, 2, 4, 8], mb_size=2,
                seq=128, repeats=5, comm_sizes=[2**k for k in range(4, 25, 2)], comm_iters=10, time_iters=10),
}[PROFILE]
print(PROFILE, SIZES)
gen = torch.Generator().manual_seed(seed)
prompt = torch.randint(TINY.vocab_size, SIZES["prompt"], generator=gen)
tokens = prompt.numel()

# %% [markdown]
# ## Predict: bytes on the wire, the bubble, memory per device
# TP all-reduces `tokens x hidden` activations twice per layer (after attention's output projection and after
# the MLP's down projection) plus once for the vocabulary-parallel embedding, and all-gathers the logits. PP sends
# `tokens x hidden` once per stage boundary. With `p` stages and `m` micro-batches the pipeline idles a share
# `(p - 1) / (m + p - 1)` of the time.

# %%
tp_pred = cm.tp_comm(TINY, 2, tokens, dtype="fp32")
pp_pred = cm.pp_comm(TINY, 2, tokens, dtype="fp32")
print(f"embedded model, {tokens} tokens, float32")
print(f"  TP: {tp_pred['all_reduces']} all-reduces of {human_bytes(tp_pred['all_reduce_bytes'])} + an all-gather "
      f"of {human_bytes(tp_pred['all_gather_bytes'])} per forward")
print(f"  PP: {pp_pred['sends']} send of {human_bytes(pp_pred['send_bytes'])} per forward (2 stages)")
display(pd.DataFrame([{"p": p, **{f"m={m}": cm.bubble_fraction(p, m) for m in (1, 2, 4, 8, 16, 32)}}
                      for p in (2, 4, 8)]).set_index("p").round(3))
rows = []
for name in ("llama-3-8b", "llama-3-70b", "gpt3-175b"):
    for tp, pp in ((1, 1), (8, 1), (1, 8), (8, 2)):
        mem = cm.memory_per_device(PRESETS[name], tp, pp, kv_tokens=32 * 2048)
        rows.append({"model": name, "layout": f"TP{tp} x PP{pp}", "weights GB/GPU": mem["weights"] / 1e9,
                     "KV GB/GPU (32 x 2048 tokens)": mem["kv"] / 1e9})
display(pd.DataFrame(rows).round(1))

# %% [markdown]
# ## Baseline: the unsharded model in this process

# %%
model, tok = load_model()
threads = torch.get_num_threads()
torch.set_num_threads(1)  # the ranks below get one thread each; compare like with like
with torch.no_grad():
    single = time_fn(lambda: model(prompt), device="cpu", warmup=1, iters=SIZES["time_iters"])
single_s = single.median_s
torch.set_num_threads(threads)
print(f"one process, one thread: {single_s * 1e3:.1f} ms per forward of {tuple(prompt.shape)}")

# %% [markdown]
# ## Technique 1: tensor parallelism, by hand and as a DTensor plan
# `labkit.parallel.tensor_parallel` swaps every linear layer of the Hugging Face model for a column- or
# row-parallel one and the embedding and LM head for vocabulary-parallel ones; the model's own forward and
# `generate` then run unchanged on every rank. The embedded model has 4 query heads and 2 KV heads, so at TP 4
# each KV head is replicated on the two ranks whose query heads use it. `dtensor_plan` expresses the same
# sharding with PyTorch's `parallelize_module`. Each rank function computes the unsharded reference itself.

# %%
tp_results = {}
for world in SIZES["tp_worlds"]:
    t0 = time.perf_counter()
    calls = [(ex.tp_check, (prompt,), dict(max_new_tokens=SIZES["new_tokens"], time_iters=SIZES["time_iters"]))]
    if world == 2:  # the DTensor plan in the same processes (process start-up costs more than the checks)
        calls.append((ex.dtensor_check, (prompt,), dict(max_new_tokens=SIZES["new_tokens"])))
    out = launch(ex.sequence, world, calls, backend="gloo")
    tp_results[world] = [r[0] for r in out]
    if world == 2:
        dt = [r[1] for r in out]
    print(f"TP {world}: {time.perf_counter() - t0:.1f} s including process start-up")

# %% [markdown]
# ## Check: same logits, same tokens, the predicted traffic

# %%
rows = []
for world, res in tp_results.items():
    r0 = res[0]
    rows.append({"TP": world, "logits rel err": max(r["logits_rel_err"] for r in res),
                 "greedy tokens equal": all(torch.equal(r["tokens"], r["ref_tokens"]) for r in res),
                 "max grad rel err": max(max(r["grad_rel_err"].values()) for r in res),
                 "all-reduces / forward": r0["collectives_per_forward"]["all_reduce"],
                 "all-reduce bytes": r0["bytes_per_forward"]["all_reduce"],
                 "predicted bytes": tp_pred["all_reduces"] * tp_pred["all_reduce_bytes"],
                 "forward ms (1 process)": single_s * 1e3, "forward ms (TP)": r0["tp_s"] * 1e3})
tp_table = pd.DataFrame(rows)
display(tp_table)
print(f"DTensor plan vs hand-written: {max(r['plan_vs_hand_rel_err'] for r in dt):.2e}; vs unsharded: "
      f"{max(r['plan_vs_single_rel_err'] for r in dt):.2e}; tokens equal: "
      f"{all(torch.equal(r['tokens_plan'], r['tokens_hand']) for r in dt)}")
tp_err = max(tp_table["logits rel err"])
assert tp_err < 1e-5 and tp_table["greedy tokens equal"].all()
assert (tp_table["all-reduce bytes"] == tp_table["predicted bytes"]).all()
assert max(r["plan_vs_hand_rel_err"] for r in dt) < 1e-5

# %% [markdown]
# Whether TP is faster than one process here depends on two numbers: the matmul time it splits and the
# 17 all-reduces it adds (each with the gloo latency measured below). The embedded model is so
# small that the two are of the same order, and other processes on the machine move the balance from run to
# run. On GPUs the same trade decides: TP pays when each GPU's share of the weights takes longer to read than an
# all-reduce takes.
#
# ## Technique 2: pipeline stages, GPipe and 1F1B
# `labkit.parallel.pipeline` cuts the model into stages balanced by cost (the LM head counts as the layers it
# equals); the schedules in `labkit.parallel.schedules` run on `send`/`recv`. The check covers the forward,
# micro-batched greedy decoding (the last stage sends each token back to stage 0), `torch.distributed.pipelining`'s
# GPipe on the same stage modules, and training gradients under both schedules. The same processes then measure
# the bubble (next section).

# %%
pp_world = SIZES["pp_worlds"][0]
bubble_args = dict(microbatch_size=SIZES["mb_size"], seq_len=SIZES["seq"], repeats=SIZES["repeats"])
out = launch(ex.sequence, pp_world, [(pp_check, (prompt,), dict(max_new_tokens=SIZES["new_tokens"],
                                                                num_microbatches=2)),
                                     (pp_bubble, (SIZES["ms"],), bubble_args)], backend="gloo")
pp_res, bubble_res = [r[0] for r in out], {pp_world: [r[1] for r in out]}  # bubbles: measured in the next section
last = pp_res[-1]
pp_err = max(last["logits_rel_err"], last["torch_pipelining_rel_err"])
print(f"{pp_world} stages, layers {[r['layers'] for r in pp_res]}")
print(f"logits rel err: send/recv GPipe {last['logits_rel_err']:.2e}, torch.distributed.pipelining "
      f"{last['torch_pipelining_rel_err']:.2e}")
print("greedy tokens equal to HF generate:", all(torch.equal(r["tokens"], r["ref_tokens"]) for r in pp_res))
for s in ("gpipe", "1f1b"):
    print(f"training, {s}: max grad rel err {max(r[f'train_{s}']['grad_rel_err_max'] for r in pp_res):.2e}, "
          f"loss rel err {last[f'train_{s}']['loss_rel_err']:.2e}")
assert pp_err < 1e-5 and all(torch.equal(r["tokens"], r["ref_tokens"]) for r in pp_res)

# %% [markdown]
# ## Measure: the bubble against `(p - 1) / (m + p - 1)`
# The micro-batch size is fixed, so each stage's work per micro-batch is the same for every `m`: the formula's
# setting. Each rank records when it computes; the bubble is the idle share of the schedule's time, averaged over
# stages. Other processes on this machine add noise; the stage imbalance (one stage slower than the other) adds a
# bubble the formula does not have.

# %%
for p in SIZES["pp_worlds"][1:]:
    bubble_res[p] = launch(pp_bubble, p, SIZES["ms"], backend="gloo", **bubble_args)
bubbles = {p: (res, bubble_table(res)) for p, res in bubble_res.items()}
btab = pd.DataFrame([r for _, t in bubbles.values() for r in t])
display(btab[["kind", "stages", "m", "bubble_measured", "bubble_formula", "total_s", "peak_activation_bytes"]]
        .round(3))
fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
for kind, ax in zip(("forward", "train_gpipe", "train_1f1b"), axes, strict=True):
    for p in bubbles:
        sel = btab[(btab.kind == kind) & (btab.stages == p)]
        ax.plot(sel.m, sel.bubble_measured, "o-", label=f"measured, p={p}")
        ax.plot(sel.m, sel.bubble_formula, "k--", alpha=0.6, label=f"(p-1)/(m+p-1), p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share)")
    ax.set_title(kind)
    ax.legend(fontsize=7)
plt.show()
res2 = bubbles[SIZES["pp_worlds"][0]][0]
m_show = min(4, max(SIZES["ms"]))
fig, axes = plt.subplots(1, 2, figsize=(16, 2.8))
plot_schedule_timeline(res2, "train_gpipe", m_show, axes[0])
plot_schedule_timeline(res2, "train_1f1b", m_show, axes[1])
plt.show()

# %% [markdown]
# GPipe runs every forward before any backward, so each stage holds all `m` micro-batches' activations; 1F1B
# starts the backward as soon as the last stage can, so stage `s` holds at most `p - s`: same bubble, less memory
# (the `peak_activation_bytes` column, measured from what autograd saved). For inference there is no backward: the
# only lever on the bubble is `m`, and at decode time each micro-batch re-reads the stage's weights.
#
# ## Communication: latency, bandwidth, the alpha-beta model, overlap

# %%
cres = launch(ex.comm_check, 2, SIZES["comm_sizes"], iters=SIZES["comm_iters"], backend="gloo")[0]
crow = cres["rows"]
fits = comm_fits(crow)
fig, ax = plt.subplots(figsize=(7, 4))
plot_comm(crow, fits, ax)
ax.set_title("gloo on this machine, 2 ranks")
plt.show()
display(pd.DataFrame(fits).T.round(3))
ov = cres["overlap"]
print(f"overlap: all-reduce of {human_bytes(ov['bytes'])} {ov['comm'] * 1e3:.2f} ms, matmul {ov['matmul_n']}^2 "
      f"{ov['compute'] * 1e3:.2f} ms, one after the other {ov['serial'] * 1e3:.2f} ms, overlapped "
      f"{ov['overlapped'] * 1e3:.2f} ms: {ov['hidden_frac']:.0%} of the shorter one hidden")

# %% [markdown]
# With gloo the collective runs on a CPU thread that competes with the matmul for the same two cores, so overlap
# hides little here. On GPUs NCCL runs on its own stream and copy engines/SMs; `scripts/bench_multigpu.py`
# measures the same overlap with two half-batches on two communicators.
#
# ## The 175B case
# GPT-3 175B in bf16 on nodes of 8 GPUs, through the planner's cost model (`labkit.plan.decode_step_parts`: the
# roofline of each stage's weights and KV, scaled by the efficiencies fitted on the engine's measured single-GPU
# steps, plus ring collectives over the published link bandwidths). The planner of notebook 08 calls the same
# function, so a layout has one step time in both notebooks. No multi-GPU record calibrates the collectives or
# checks a multi-GPU step yet: every row says so in its `caveat` column. The reading below the tables
# is rendered from the same function, so its numbers cannot drift from them.

# %%
from labkit.experiments.quantization.format_gemm import run_format_gemm  # noqa: E402
from labkit.plan import SCENARIO_175B, calibrated_cluster, every_layout, recommend, worked_example_175b  # noqa: E402

# each weight format's kernels by batch: measured in this run under the gpu profile (or 04's, reused)
this_run_gemm = run_format_gemm(PROFILE)
rec175 = recommend(SCENARIO_175B, format_gemm=this_run_gemm[1] if this_run_gemm else None)
cols = ["layout", "microbatches", "weights_gb", "kv_gb", "fits", "weights_read_s", "kv_read_s", "tp_comm_s",
        "pp_comm_s", "step_s", "tokens_per_s", "comm_frac", "caveat"]
for hw_name in ("h200", "h100"):
    rows175 = worked_example_175b(hw_name, batch=32, context=2048)
    print(f"{hw_name.upper()}: {rows175[0]['hardware']}")
    display(pd.DataFrame(rows175)[cols].round(4))
cluster16, cal175, _ = calibrated_cluster("h200")
layouts16 = pd.DataFrame(every_layout(PRESETS["gpt3-175b"], cluster16, cal175, 16, batch=32, context=2048))
display(layouts16[["layout", "fits", "mem_gb", "tp_comm_s", "step_s", "tokens_per_s", "caveat"]].round(4))
q = cm.tp_comm(PRESETS["gpt3-175b"], 16, 32, "ib-ndr", "bf16")
q8 = cm.tp_comm(PRESETS["gpt3-175b"], 16, 32, "ib-ndr", "int8")
print(f"TP16 across InfiniBand: {q['time_s'] * 1e3:.1f} ms of all-reduce per step in bf16, "
      f"{q8['time_s'] * 1e3:.1f} ms with int8 communication")

# %%
display(Markdown("Reading the tables:\n\n" + case_175b_text(batch=32, context=2048, rec=rec175)))

# %% [markdown]
# * **PP across nodes.** A stage boundary sends `batch x hidden` once per step: kilobytes, microseconds. PP adds
#   memory (16 GPUs hold twice the KV) but not speed for memory-bound decode: a step still reads every weight once
#   per micro-batch, and the bubble means a token must pass all stages before the next one starts.
# * **Where overlap, sequence parallelism and quantised communication help.** Overlap hides an all-reduce behind
#   independent work (another micro-batch's layer), which matters most where communication is large: prefill and
#   cross-node links. Sequence parallelism replaces each all-reduce by a reduce-scatter + all-gather (same bytes)
#   and shards the norms' activations: it saves activation memory in prefill and training, not decode time.
#   Quantising the all-reduce payload (int8, as above) halves the bandwidth term; it does nothing for the
#   latency term that dominates small decode messages.
#
# ## Measured on several GPUs

# %%
mg = sorted(REPO_ROOT.glob("results/*x[0-9]*/records/multigpu_*.json"))  # results/h200x8/...: scripts/bench_multigpu.py
if not mg:
    print("No multi-GPU records yet: the NCCL measurements (scripts/bench_multigpu.py) need a machine with "
          "several GPUs, which has not been available. The cost model above uses datasheet links.")
for path in mg:
    data = json.loads(path.read_text())["data"]
    print(path.relative_to(REPO_ROOT))
    if "fits" in data and "rows" in data and path.stem.endswith("comm"):
        display(pd.DataFrame(data["fits"]).T)
    elif "rows" in data:
        display(pd.DataFrame(data["rows"]).drop(columns=["events"], errors="ignore").round(4))

# %% [markdown]
# ## Trade-offs

# %%
fwd = btab[(btab.kind == "forward") & (btab.stages == SIZES["pp_worlds"][0])]
row_m = fwd[fwd.m == min(4, max(SIZES["ms"]))].iloc[0]
row_1 = fwd[fwd.m == 1].iloc[0]
pp_gain = float(row_m.m * row_1.total_s / row_m.total_s)  # m micro-batches of work in row_m's time
pp_stage_frac = max(r["stage_param_bytes"] for r in pp_res) / pp_res[0]["model_param_bytes"]
print(f"PP {pp_world}: throughput x{pp_gain:.2f} at m={int(row_m.m)} against m=1; the largest stage holds "
      f"{pp_stage_frac:.0%} of the weights")
trade = pd.DataFrame([
    {"technique": f"TP {w} (hand-written)", "logits rel err": r["logits rel err"],
     "latency (CPU, ms/forward)": r["forward ms (TP)"],
     "vs 1 process": r["forward ms (TP)"] / r["forward ms (1 process)"],
     "weights per rank": f"1/{w} (KV heads x{max(1, w // TINY.num_kv_heads)})",
     "communication / forward": f"{r['all-reduces / forward']} all-reduces"}
    for w, r in zip(tp_table["TP"], tp_table.to_dict("records"), strict=True)] + [
    {"technique": "TP 2 (DTensor plan)", "logits rel err": max(r["plan_vs_single_rel_err"] for r in dt),
     "latency (CPU, ms/forward)": float("nan"), "vs 1 process": float("nan"), "weights per rank": "1/2",
     "communication / forward": "same collectives, inserted by DTensor"},
    {"technique": f"PP {pp_world}, GPipe m={int(row_m.m)}", "logits rel err": last["logits_rel_err"],
     "latency (CPU, ms/forward)": row_m.total_s * 1e3, "vs 1 process": float("nan"),
     "weights per rank": f"~1/{pp_world}",
     "communication / forward": f"{pp_world - 1} send per micro-batch; bubble {row_m.bubble_measured:.2f} "
                                f"(formula {row_m.bubble_formula:.2f})"},
])
display(trade.round({"latency (CPU, ms/forward)": 2, "vs 1 process": 2}))
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.bar([str(w) for w in tp_results], [tp_results[w][0]["tp_s"] * 1e3 for w in tp_results], label="TP forward")
ax.axhline(single_s * 1e3, color="k", ls="--", label="1 process")
ax.set_xlabel("TP ranks (gloo, 1 thread each)")
ax.set_ylabel("ms per forward")
ax.legend()
plt.show()

# %%
rec = write_record("06_parallelism", {
    "profile": PROFILE, "sizes": SIZES, "single_process_s": single_s,
    "tp": {w: [{k: v for k, v in r.items() if "tokens" not in k} for r in res] for w, res in tp_results.items()},
    "dtensor": [{k: v for k, v in r.items() if "tokens" not in k} for r in dt],
    "pp_check": [{k: v for k, v in r.items() if "tokens" not in k} for r in pp_res],
    "bubble": {p: t for p, (_, t) in bubbles.items()},
    "bubble_events": {p: [{"rank": r["rank"], "rows": r["rows"]} for r in res] for p, (res, _) in bubbles.items()},
    "comm_rows": crow, "comm_fits": fits, "overlap": ov,
    "worked_175b_h200": worked_example_175b("h200"),
    "layouts_175b_16gpu": layouts16.to_dict("records"),
})
record_figure("parallel.tp_logits_rel_err", tp_err, "relative", rec, bar="<= 1e-5",
              note=f"TP {SIZES['tp_worlds']} vs one process, float32, embedded model")
record_figure("parallel.pp_logits_rel_err", pp_err, "relative", rec, bar="<= 1e-5",
              note=f"PP {pp_world} stages (send/recv GPipe and torch.distributed.pipelining) vs one process")
record_figure("parallel.pp_bubble_measured", float(row_m.bubble_measured), "fraction", rec,
              note=f"forward-only GPipe, {pp_world} gloo stages, m={int(row_m.m)}, mean idle share over stages")
record_figure("parallel.pp_bubble_formula", float(row_m.bubble_formula), "fraction", rec, derived=True,
              note=f"(p-1)/(m+p-1) at p={pp_world}, m={int(row_m.m)}")
record_figure("parallel.pp_max_stage_weight_frac", pp_stage_frac, "fraction of the model's weights", rec, derived=True,
              note=f"largest of {pp_world} stages' parameter bytes over the whole model's (tied embeddings held by "
                   "the first and last stage)")
record_figure("parallel.pp_microbatch_throughput_gain", pp_gain, "x", rec,
              note=f"forward-only GPipe, {pp_world} gloo stages: tokens/s at m={int(row_m.m)} micro-batches over "
                   "m=1 (the same micro-batch size)")
ar = fits["all_reduce"]
if "alpha_us" in ar:
    record_figure("parallel.gloo_allreduce_alpha_us", ar["alpha_us"], "us", rec, note="2 gloo ranks, this CPU")
    record_figure("parallel.gloo_allreduce_beta_gb_s", ar["beta_gb_s"], "GB/s", rec,
                  note="algorithm bandwidth of the fit t = alpha + bytes / beta, 2 gloo ranks")
else:
    print("all-reduce timings too noisy to fit on this run:", ar["error"])

# %% [markdown]
# ## Takeaways
#
# * **Correctness first, then speed.** Hand-written Megatron TP (2 and 4 ranks, KV heads replicated at 4), the
#   DTensor plan, and GPipe/1F1B pipelines all reproduce the single-process logits within 1e-5 in float32 (the
#   claims below give the errors) and the same greedy tokens; training gradients agree too.
# * **TP puts communication on every layer's critical path**: 2 all-reduces per layer, `tokens x hidden` each,
#   exactly the bytes the cost model predicts. It is the tool for latency *inside* a node (NVLink); across nodes
#   it is dominated by the link.
# * **PP sends little but idles**: the measured bubble follows `(p - 1)/(m + p - 1)` (plus stage imbalance and
#   noise); 1F1B keeps the bubble and cuts activation memory to `p - s` micro-batches. For decode it adds memory
#   capacity, not speed.
# * **Decision guide**: fit the model with TP up to the node size as long as per-GPU weight reads dominate
#   all-reduce latency; add PP across nodes when the model or its KV cache does not fit one node; use enough
#   micro-batches (`m >= 4p`) to keep the bubble small where throughput matters; never run TP over InfiniBand.
#   The 175B recommendation is the planner's (next cell), the same one notebook 08 quotes.

# %%
from labkit.claims import Claim, show  # noqa: E402

rrec = write_record("06_parallelism_175b", {"layout": rec175.layout, "calibration": rec175.cal.source,
                                            "plans": [p.to_dict() for p in rec175.plans[:20]]})
record_figure("parallel.recommended_175b_layout", rec175.layout, "layout", rrec, machine=rec175.cal.machine,
              note="labkit.plan.recommend(SCENARIO_175B): the planner notebook 08 quotes")
print("recommended for 175B:", rec175.layout)
show(
    "The planner recommends {parallel.recommended_175b_layout} for the 175B scenario (notebook 08 checks that it "
    "gets the same answer in the same run)",
    Claim("TP and PP reproduce the single-process logits (TP {parallel.tp_logits_rel_err:.1e}, PP "
          "{parallel.pp_logits_rel_err:.1e}, both within 1e-5)", "parallel.tp_logits_rel_err <= 1e-5 and "
          "parallel.pp_logits_rel_err <= 1e-5", machine="cpu"),
    Claim("The measured bubble {parallel.pp_bubble_measured:.2f} is within 0.1 of (p-1)/(m+p-1) = "
          "{parallel.pp_bubble_formula:.2f}", "abs(parallel.pp_bubble_measured - parallel.pp_bubble_formula) < 0.1",
          machine="cpu"),
    Claim("A gloo all-reduce costs {parallel.gloo_allreduce_alpha_us:.0f} us of latency on this CPU (the alpha of "
          "t = alpha + bytes / beta), over ten microseconds", "parallel.gloo_allreduce_alpha_us > 10", machine="cpu"),
    title="Checked claims",
)
