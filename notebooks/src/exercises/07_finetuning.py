# %% [markdown]
# ## Exercises
#
# The check runs your code and labkit's on the same irregular cases and prints which passed and, for the first that
# failed, what was expected and what you returned (never labkit's code). `python -m labkit exercises` lists your
# progress.
#
# ### Exercise 07.lora_rank (decide; 20 minutes)
# A LoRA adapter of rank `r` on a linear `[in -> out]` trains `r x (in + out)` numbers, and each trained number
# costs `bytes_per_trainable` bytes of training state (16 with AdamW: an fp32 copy, its gradient, two fp32 moments).
# A rank sweep gives a held-out loss per rank. Choose the rank: write
# `choose_lora_rank(spec, losses, budget_bytes, targets, bytes_per_trainable=16, loss_tolerance=0.0)` returning
# `{"table": {r: {"trainable_params", "bytes", "loss"}}, "choice": r}`:
#
# * `losses` maps each rank of the sweep to its loss; `targets` names the adapted linears of every layer among
#   `q_proj, k_proj, v_proj, o_proj` (attention: `q` is `hidden -> num_heads x head_dim`, `k` and `v` are
#   `hidden -> num_kv_heads x head_dim`, `o` the reverse of `q`) and `gate_proj, up_proj, down_proj` (MLP:
#   `hidden -> intermediate_size` and back); every one of the `spec.num_layers` layers has them;
# * the choice is the **smallest** rank whose state fits `budget_bytes` and whose loss is within `loss_tolerance`
#   of the best loss among the ranks that fit (`None` when no rank fits).
#
# The cases include a sweep where the largest rank overfits and models whose `head_dim` is not
# `hidden_size / num_heads`.

# %%
def choose_lora_rank(spec, losses, budget_bytes, targets, bytes_per_trainable=16, loss_tolerance=0.0):
    table = {}
    # TODO: trainable parameters and bytes per rank, then the rank to train
    raise NotImplementedError("fill in choose_lora_rank")


# %%
from labkit.exercises import check

check("07.lora_rank", choose_lora_rank)
