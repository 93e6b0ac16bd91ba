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
# on the busiest GPU of a layout of `pp` pipeline stages of `tp` GPUs. Use `labkit.models.dtype_bytes` and the
# `ModelSpec` (`spec.attn_params_per_layer`, `spec.mlp_params_per_layer`, `spec.norm_params_per_layer`,
# `spec.vocab_size`, `spec.hidden_size`, `spec.num_kv_heads`, `spec.head_dim`, `spec.tie_embeddings`).
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

from labkit.models import dtype_bytes


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
