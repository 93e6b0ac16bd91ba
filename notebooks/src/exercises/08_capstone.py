# %% [markdown]
# ## Exercises
#
# The planner's first two questions for a model it has never seen: does a layout fit, and how many sequences can
# it serve? The checks compare with labkit's `memory_per_device`, which `labkit.plan` uses, on new shapes (a
# 60-layer model with 7 query heads per KV head, a small model with tied embeddings, and presets).
# `python -m labkit exercises` lists your progress.
#
# ### Exercise 08.memory_per_gpu (25 minutes)
# `memory_per_gpu(spec, tp, pp, kv_tokens, dtype="bf16", kv_dtype=None)` returns `{"weights": bytes, "kv": bytes}`
# on the busiest GPU of a layout of `pp` pipeline stages of `tp` GPUs. Use `labkit.model.dtype_bytes` and the
# `ModelConfig` (`spec.attn_params_per_layer`, `spec.mlp_params_per_layer`, `spec.norm_params_per_layer`,
# `spec.vocab_size`, `spec.hidden_size`, `spec.num_kv_heads`, `spec.head_dim`, `spec.tie_word_embeddings`).
#
# * A stage holds `ceil(num_layers / pp)` layers.
# * Attention and MLP matrices are split `tp` ways; the embedding table and the LM head too (vocabulary-parallel).
#   The norms are replicated on every GPU.
# * The busiest stage holds one table (`vocab_size x hidden_size`): the first stage the embedding, the last the
#   head. With `pp == 1` the one stage holds both, unless they are tied (one table).
# * KV: `kv_tokens` tokens, K and V, the stage's layers, `max(1, num_kv_heads // tp)` KV heads per GPU (with more
#   GPUs than KV heads, heads are replicated), in `kv_dtype` (default: `dtype`).

# %%
import math

from labkit.model import dtype_bytes


def memory_per_gpu(spec, tp, pp, kv_tokens, dtype="bf16", kv_dtype=None):
    # TODO
    raise NotImplementedError("fill in memory_per_gpu")


# %%
from labkit.exercises import check

check("08.memory_per_gpu", memory_per_gpu)

# %% [markdown]
# ### Exercise 08.max_batch (10 minutes)
# `max_batch(spec, tp, context, gpu_bytes, dtype="bf16", kv_dtype=None, headroom=0.9)`: the largest number of
# sequences of `context` tokens that one stage of `tp` GPUs can hold, using at most `headroom` of each GPU's
# `gpu_bytes`: what the weights leave, divided by one sequence's KV bytes per GPU, rounded down; 0 when the weights
# alone do not fit. Use your `memory_per_gpu` (or labkit's `labkit.parallel.cost_model.memory_per_device`).

# %%
def max_batch(spec, tp, context, gpu_bytes, dtype="bf16", kv_dtype=None, headroom=0.9):
    # TODO
    raise NotImplementedError("fill in max_batch")


# %%
check("08.max_batch", max_batch)

# %% [markdown]
# ### Exercise 08.gpus_175b (predict, then measure; 25 minutes)
# Count the scenario's GPUs by hand, then compare with the planner. Write `gpus_for_slo(spec, batch, context,
# weights, kv, gpu_bytes, rate_req_s, output_mean, tpot_s, headroom=0.9, gpus_per_node=8)` returning
# `{"kv_bytes_per_token", "mem_per_gpu", "tp", "replicas", "gpus"}`:
#
# * KV bytes per token: K and V for every layer and KV head. GPT-3 175B has multi-head attention (96 layers, 96
#   heads of 128, d_model 12288), so in bf16 that is `2 x 96 x 12288 x 2` bytes = 4.5 MiB per token;
# * one replica holds all the weights (`spec.num_params` at `dtype_bytes(weights)`) and the KV of `batch`
#   sequences of `context` tokens; `tp` is the smallest power of two that divides `spec.num_heads`, at most
#   `gpus_per_node`, that brings `need / tp` under `headroom x gpu_bytes` (`mem_per_gpu = need / tp`);
# * Little's law: `rate_req_s x output_mean x tpot_s` requests are decoding at any moment; `replicas` is that over
#   `batch`, rounded up; `gpus = tp x replicas`. When no `tp` fits, every field but the KV bytes is `None`.
#
# The check then feeds your function the planner's best bf16 plan (its batch, KV format and time per output token,
# at the scenario's traffic) and compares your GPU count and memory per GPU with the planner's.

# %%
def gpus_for_slo(spec, batch, context, weights, kv, gpu_bytes, rate_req_s, output_mean, tpot_s, headroom=0.9,
                 gpus_per_node=8):
    # TODO: KV per token, memory per replica, the smallest TP that fits, replicas by Little's law
    raise NotImplementedError("fill in gpus_for_slo")


# %%
check("08.gpus_175b", gpus_for_slo)
