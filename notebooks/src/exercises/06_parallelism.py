# %% [markdown]
# ## Exercises
#
# Two decisions of a multi-GPU layout: where tensor parallelism communicates and how much, and whether TP or PP
# serves a given link better. Each check runs your code and labkit's on the same irregular cases and prints which
# passed and, for the first that failed, what was expected and what you returned (never labkit's code). The
# *predict-then-measure* one goes on to set your prediction against the TP forward this notebook measured over gloo
# (this run's record, else the committed one, and it says which). `python -m labkit exercises` lists your progress.
#
# ### Exercise 06.tp_plan (decide; 20 minutes)
# Megatron-LM splits a linear **column-wise** (by output features: each rank computes a slice of the output, no
# communication) when its input is whole on every rank, and **row-wise** (by input features: each rank's output is a
# partial sum) when its input is a column-split linear's sharded output. Attention per head and elementwise products
# (SwiGLU's `silu(gate) * up`) keep a sharded tensor sharded. A sub-block's row-split outputs are added into the
# residual stream, so **one** all-reduce of `hidden` elements per token sums them all.
#
# Write `tp_plan(block, hidden, bytes_per_el, tp)`. `block` is a list of sub-blocks, each
# `{"linears": {name: [inputs]}, "residual": [names]}`; an input is `"x"` (the normed residual stream) or `"encoder"`
# (an encoder's output), both whole on every rank, or the name of another linear. Return
#
# * `"splits"`: `{name: "column" or "row"}` for every linear;
# * `"all_reduces"`: all-reduces per layer (one per sub-block whose residual outputs are row-split);
# * `"bytes_per_token"`: the all-reduce payload per token per layer, `all_reduces x hidden x bytes_per_el`;
# * `"wire_bytes_per_token"`: what each GPU sends for it on a ring, `2 (tp - 1) / tp` of the payload.
#
# The cases include a GPT-2 layer (fused QKV), a *parallel* block (GPT-J, PaLM, Falcon: attention and MLP read the
# same input: how many all-reduces then?) and a decoder layer with cross-attention.

# %%
def tp_plan(block, hidden, bytes_per_el, tp):
    splits = {}
    # TODO: column or row for each linear, then the all-reduces and their bytes
    raise NotImplementedError("fill in tp_plan")


# %%
from labkit.exercises import check

check("06.tp_plan", tp_plan)

# %% [markdown]
# ### Exercise 06.tp_or_pp (predict, then measure; 25 minutes)
# `gpus` GPUs joined by a link of `bandwidth` bytes/s and `latency` seconds per message run a forward of `tokens`
# tokens through `layers` layers of width `hidden`; the forward's work takes `compute_s` on one GPU. Write
# `tp_or_pp(layers, hidden, tokens, bytes_per_el, gpus, bandwidth, latency, compute_s, objective="latency")`
# returning `{"tp_comm_s", "pp_comm_s", "tp_latency_s", "pp_latency_s", "tp_step_s", "pp_step_s", "choice"}`:
#
# * a message is `tokens x hidden x bytes_per_el` bytes;
# * **TP** splits every layer: `compute_s / gpus` of work plus two ring all-reduces per layer, each
#   `2 (p - 1) x latency + 2 (p - 1) / p x message / bandwidth` (0 on one GPU); its latency and its time per batch
#   (`tp_step_s`) are the same;
# * **PP** cuts the layers into `gpus` stages with `gpus` micro-batches in flight: a batch passes every stage, so
#   its latency is `compute_s` plus `p - 1` sends of `latency + message / bandwidth` (`pp_comm_s`), while in steady
#   state a batch leaves every `compute_s / gpus` plus one send (`pp_step_s`);
# * `choice`: `"TP"` or `"PP"`, whichever has the lower latency (`objective="latency"`) or time per batch
#   (`"throughput"`); TP on a tie.
#
# The check then predicts this notebook's TP 2 forward of the embedded model on this machine's gloo link (its
# latency and bandwidth from the all-reduce fit above, `compute_s` the one-process forward) and compares with the
# measured one. Predict first: will the measurement land near your number?

# %%
def tp_or_pp(layers, hidden, tokens, bytes_per_el, gpus, bandwidth, latency, compute_s, objective="latency"):
    # TODO: the message, TP's all-reduces, PP's sends, both layouts' latency and time per batch, the choice
    raise NotImplementedError("fill in tp_or_pp")


# %%
check("06.tp_or_pp", tp_or_pp)
