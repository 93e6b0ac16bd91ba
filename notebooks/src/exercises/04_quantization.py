# %% [markdown]
# ## Exercises
#
# Two judgements this notebook's numbers rest on: which group size a 4-bit format should use, and how much faster
# fewer bytes should make a decode step. Each check runs your code and labkit's on the same irregular cases and
# prints which passed and, for the first that failed, what was expected and what you returned (never labkit's
# code). A *predict-then-measure* check goes on to set your prediction against the measured step times (this
# run's, under the `gpu` profile; otherwise the committed H200 record, and it says which) and explains the gap.
# `python -m labkit exercises` lists your progress.
#
# ### Exercise 04.group_size (decide; 20 minutes)
# int4 with one scale and zero-point per group of `g` inputs pays `0.5 + 2 x scale_bytes / g` bytes per weight:
# smaller groups follow the weights more closely and cost more bytes. Write
# `choose_group_size(weight, group_sizes, max_rel_err, scale_bytes=2)` returning
# `{"table": {g: {"rel_err": ..., "bytes_per_weight": ...}}, "choice": g}`:
#
# * `rel_err`: the relative error `||W - dequantised|| / ||W||` (Frobenius norms) of round-to-nearest int4 with
#   group size `g`: use labkit's `quantize_int4(weight, g)` and `dequantize_int4(packed, scales, zeros, g)`
#   (imported below; notebook 04's format) or your own of the same format;
# * `choice`: the group size with the fewest bytes per weight whose error is at most `max_rel_err`, or `None`.
#
# The cases include weights with outlier input columns, the shape real LLM weights have: watch how fast the error of
# large groups grows there.

# %%
import torch

from labkit.kernels.quantized_matmul.packing import dequantize_int4
from labkit.quant.weight_only import quantize_int4


def choose_group_size(weight, group_sizes, max_rel_err, scale_bytes=2):
    table = {}
    # TODO: error and bytes per weight for each group size, then the cheapest one under the bar
    raise NotImplementedError("fill in choose_group_size")


# %%
from labkit.exercises import check

check("04.group_size", choose_group_size)

# %% [markdown]
# ### Exercise 04.decode_speedup (predict, then measure; 20 minutes)
# At batch 1 a decode step reads every weight once, so its time should follow the bytes it reads. Predict the
# speed-up of int8 and int4 weights over bf16: write `predict_decode_speedup(spec, method, context, group_size=128,
# scale_bytes=2)` returning `{"bf16_bytes", "bytes", "speedup"}`, where a step reads
#
# * the decoder's linear layers (`spec.num_layers x (spec.attn_params_per_layer + spec.mlp_params_per_layer)`
#   weights) at the method's bytes per weight: `"bf16"` 2; `"int8"` 1 plus one scale per output channel,
#   `1 + scale_bytes / spec.hidden_size`; `"int4"` `0.5 + 2 x scale_bytes / group_size`;
# * the LM head (`vocab_size x hidden_size`) and the norms (`num_layers x norm_params_per_layer + hidden_size`) in
#   bf16, whatever the method; the embedding table not at all (one row per token);
# * the bf16 KV cache of `context` tokens (`spec.kv_bytes(context, "bf16")`);
#
# and `speedup` is the bf16 step's bytes over the method's. The check compares it with the measured speed-ups of the
# engine's CUDA-graph-replayed steps on the Llama-3-8B shape and shows how fast each step read its bytes.

# %%
def predict_decode_speedup(spec, method, context, group_size=128, scale_bytes=2):
    # TODO: bytes of a bf16 step and of a step in `method`, and their ratio
    raise NotImplementedError("fill in predict_decode_speedup")


# %%
check("04.decode_speedup", predict_decode_speedup)
