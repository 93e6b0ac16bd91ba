# %% [markdown]
# ## Exercises
#
# LoRA keeps the base weight `W` `[out, in]` frozen and learns a low-rank update: `A` `[r, in]` and `B` `[out, r]`,
# scaled by `alpha / r`. Both checks compare with labkit's `LoRALinear`. `python -m labkit exercises` lists your
# progress.
#
# ### Exercise 07.lora_forward (10 minutes)
# `lora_forward(x, weight, bias, lora_a, lora_b, alpha)`: `x` `[..., in]` to `[..., out]`: the base layer
# (`weight`, and `bias` when it is not `None`) plus the update `x A^T B^T` scaled by `alpha / r`, where
# `r = lora_a.shape[0]`.

# %%
import torch
import torch.nn.functional as F


def lora_forward(x, weight, bias, lora_a, lora_b, alpha):
    # TODO
    raise NotImplementedError("fill in lora_forward")


# %%
from labkit.exercises import check

check("07.lora_forward", lora_forward)

# %% [markdown]
# ### Exercise 07.lora_merge (10 minutes)
# For inference the adapter can be folded into the weight: `lora_merge(weight, lora_a, lora_b, alpha)` returns the
# `[out, in]` weight that gives the same output as base + adapter with a single matmul (no extra latency).

# %%
def lora_merge(weight, lora_a, lora_b, alpha):
    # TODO
    raise NotImplementedError("fill in lora_merge")


# %%
check("07.lora_merge", lora_merge)
