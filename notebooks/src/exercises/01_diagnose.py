# %% [markdown]
# ## Exercises
#
# Each exercise below is a skeleton to fill in, followed by a check cell. `check` runs your code and labkit's on
# the same irregular cases and prints which passed and, for the first that failed, what was expected and what you
# returned; it never shows labkit's answer. `python -m labkit exercises` lists your progress. (Run headless, as
# `python -m labkit run` does, an unfilled skeleton is replaced by labkit's solution, and the check says so.)
#
# ### Exercise 01.linear_roofline (15 minutes)
# A linear layer `y = x @ W.T` multiplies `tokens` rows of `x` `[tokens, d_in]` by `W` `[d_out, d_in]`. Write
# `linear_roofline(tokens, d_in, d_out, bytes_per_el, peak_flops, bandwidth)` returning a tuple
# `(flops, bytes, seconds, bound)`:
#
# * `flops`: every multiply-add counts as two FLOPs;
# * `bytes`: `W`, `x` and `y` each moved once, at `bytes_per_el` bytes per element (0.5 for int4);
# * `seconds`: the time of the binding ceiling, the larger of compute time (`flops / peak_flops`) and memory time
#   (`bytes / bandwidth`);
# * `bound`: `"compute"` when compute time is at least memory time, else `"memory"`.
#
# Then look at which cases come out memory-bound: the number of tokens decides.

# %%
def linear_roofline(tokens, d_in, d_out, bytes_per_el, peak_flops, bandwidth):
    # TODO: flops, bytes moved, the time of the binding ceiling, and which ceiling binds
    raise NotImplementedError("fill in linear_roofline")


# %%
from labkit.exercises import check

check("01.linear_roofline", linear_roofline)

# %% [markdown]
# ### Exercise 01.kv_bytes (10 minutes)
# Write `kv_cache_bytes(spec, batch, context, dtype)`: the bytes of the KV cache that `batch` sequences of `context`
# tokens hold, stored in `dtype` (`"bf16"`, `"fp8"`, `"int8"`, `"fp32"`; `labkit.model.dtype_bytes(dtype)` gives
# bytes per element). `spec` is a `labkit.model.ModelConfig`: use `spec.num_layers`, `spec.num_kv_heads` and
# `spec.head_dim` (not `hidden_size / num_heads`: some models differ). Every layer stores a K and a V vector of
# `head_dim` per KV head per token.

# %%
from labkit.model import dtype_bytes


def kv_cache_bytes(spec, batch, context, dtype):
    # TODO: K and V, every layer, every KV head, every token of every sequence
    raise NotImplementedError("fill in kv_cache_bytes")


# %%
check("01.kv_bytes", kv_cache_bytes)

# %% [markdown]
# ### Exercise 01.decode_floor (15 minutes)
# Decode at small batch is memory-bound, so its floor is the bytes a step must read over memory bandwidth. Write
# `decode_floor(spec, batch, context, dtype, bandwidth)`, the seconds of one decode step at that floor:
#
# * every weight is read once, except the embedding table: a step reads only one row of it per token, so leave it
#   out, unless the model ties it to the LM head (`spec.tie_word_embeddings`), which reads it in full;
#   `spec.num_params` counts every parameter, `spec.embedding_params` the table;
# * plus the KV cache of `batch` sequences of `context` tokens (your `kv_cache_bytes` above).

# %%
def decode_floor(spec, batch, context, dtype, bandwidth):
    # TODO: bytes of one step over the bandwidth
    raise NotImplementedError("fill in decode_floor")


# %%
check("01.decode_floor", decode_floor)

# %% [markdown]
# ### Exercise 01.classify_ops (predict, then measure; 20 minutes)
# A profile gives each row's time; the roofline gives its FLOPs and bytes. Write
# `classify_ops(ops, peak_flops, bandwidth, overhead_factor=5.0)` that labels each row of a profile table, each
# `{"op", "time_s", "flops", "bytes"}`, and returns `{op: bound}`:
#
# * its floor is the larger of `flops / peak_flops` and `bytes / bandwidth`;
# * `"launch-bound"` when the measured time is more than `overhead_factor` times its floor, or the floor is 0:
#   neither FLOPs nor bytes explain the time, a per-call cost does (launches, dispatch, the host);
# * otherwise `"compute-bound"` when its intensity `flops / bytes` reaches the ridge point `peak_flops / bandwidth`
#   (no bytes at all counts as above it), else `"memory-bound"`.
#
# The check then classifies this run's decode step, category by category (time per step at the regimes test's base
# point; FLOPs and bytes from the roofline), and compares your labels with what the regimes test concluded by
# doubling the batch and the context. Predict first: which categories will one profile get wrong, and why?

# %%
def classify_ops(ops, peak_flops, bandwidth, overhead_factor=5.0):
    out = {}
    # TODO: a floor per row, then launch-, compute- or memory-bound
    raise NotImplementedError("fill in classify_ops")


# %%
check("01.classify_ops", classify_ops)
