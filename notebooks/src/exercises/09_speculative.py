# %% [markdown]
# ## Exercises
#
# Each exercise is a skeleton to fill in, followed by a check cell. `check` runs your code and labkit's on the same
# irregular cases and prints which passed and, for the first that failed, what was expected and what you returned
# (never labkit's code). The *predict-then-measure* check goes on to set your prediction against the speed-ups this
# notebook measured (this run's record, else the committed one, and it says which) and explains the gap.
# `python -m labkit exercises` lists your progress.
#
# ### Exercise 09.spec_speedup (predict, then measure; 15 minutes)
# Write `spec_speedup(alpha, k, verify_cost, draft_cost=0.0)` returning `{"tokens_per_step", "speedup"}`: a step
# that proposes `k` tokens accepted with probability `alpha` each emits `E = 1 + alpha + ... + alpha^k` tokens on
# average (`(1 - alpha^(k+1)) / (1 - alpha)`; `k + 1` when `alpha` is 1) and costs `k` draft steps of `draft_cost`
# plus one verify forward of `verify_cost`, both in units of a plain decode step; the speed-up is `E` over that
# cost. The check then predicts both proposers' batch-1 speed-up from the alpha, `c(k)` and `c_d` this notebook
# measured and compares with the measured speed-ups.

# %%
def spec_speedup(alpha, k, verify_cost, draft_cost=0.0):
    # TODO: expected tokens per step, and the speed-up
    raise NotImplementedError("fill in spec_speedup")


# %%
from labkit.exercises import check

check("09.spec_speedup", spec_speedup)

# %% [markdown]
# ### Exercise 09.best_k (decide; 15 minutes)
# `c(k)` grows with the batch: a verify over `k + 1` tokens per sequence is nearly free while the step is
# bandwidth-bound and costs `k + 1` steps once it is compute-bound. Write `best_k(alpha, verify_cost,
# draft_cost=0.0)`, where `verify_cost` maps each batch size to `{k: c(k)}`, returning `{batch: (k, speedup)}`: the
# `k` with the highest predicted speed-up at that batch and the speed-up (use your `spec_speedup`), or `(0, 1.0)`
# where no `k` beats plain decoding (a speed-up of exactly 1 does not). On a tie keep the smaller `k`: it wastes
# fewer verified rows.

# %%
def best_k(alpha, verify_cost, draft_cost=0.0):
    out = {}
    # TODO: for each batch, the best k or none
    raise NotImplementedError("fill in best_k")


# %%
check("09.best_k", best_k)
