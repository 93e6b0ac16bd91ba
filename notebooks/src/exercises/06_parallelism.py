# %% [markdown]
# ## Exercises
#
# Tensor parallelism by hand, with the ranks simulated in one process: your functions take the full weight and
# the tensor-parallel size `tp`, and return what each rank holds (a list indexed by rank), so the check sees the
# sharding itself. The all-reduce is a sum over ranks. labkit's `ColumnParallelLinear` and `RowParallelLinear` do
# the same on `torch.distributed`. `tp` divides the sharded dimension in every case.
# `python -m labkit exercises` lists your progress.
#
# ### Exercise 06.column_parallel (10 minutes)
# `column_parallel(x, weight, bias, tp)`: `weight` is `[out, in]`, `bias` `[out]` or `None`, `x` `[..., in]` is on
# every rank. Rank `r` keeps rows `r * out / tp .. (r + 1) * out / tp - 1` of the weight (and of the bias) and
# computes its slice of the output `[..., out / tp]`. Return the list of the `tp` outputs.

# %%
import torch
import torch.nn.functional as F


def column_parallel(x, weight, bias, tp):
    outs = []
    # TODO: one output slice per rank
    raise NotImplementedError("fill in column_parallel")


# %%
from labkit.exercises import check

check("06.column_parallel", column_parallel)

# %% [markdown]
# ### Exercise 06.row_parallel (15 minutes)
# `row_parallel(x_shards, weight, bias, tp)`: rank `r` holds `x_shards[r]` `[..., in / tp]` (what a
# column-parallel layer before it produced) and columns `r * in / tp .. (r + 1) * in / tp - 1` of `weight`
# `[out, in]`. Each rank computes a partial output `[..., out]`; the all-reduce sums them. Return
# `(partials, y)`: the list of partial outputs by rank, and the summed output with the bias added.

# %%
def row_parallel(x_shards, weight, bias, tp):
    partials = []
    # TODO: partial products per rank, the all-reduce, the bias
    raise NotImplementedError("fill in row_parallel")


# %%
check("06.row_parallel", row_parallel)
