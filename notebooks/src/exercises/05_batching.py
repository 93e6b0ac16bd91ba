# %% [markdown]
# ## Exercises
#
# The heart of the engine's continuous-batching scheduler, as two pure functions over plain records. A `Req`
# (`labkit.exercises.ex05_batching.Req`) has an `id`, its `prompt_len`, `num_tokens` (prompt + outputs so far) and
# `num_computed` (tokens whose K/V are in the cache). A running request with `num_computed < prompt_len` is still
# prefilling; one with `num_computed == num_tokens - 1` is decoding (its newest token needs computing).
# `python -m labkit exercises` lists your progress.
#
# ### Exercise 05.schedule_step (25 minutes)
# `schedule_step(running, waiting, token_budget, max_seqs, free_blocks, block_size)` returns the rows
# `[(request id, tokens this step), ...]` of one step, in this order:
#
# 1. every decoding request of `running` (oldest first) gets 1 token;
# 2. then every request of `running` still prefilling gets a chunk: `min(rest of its prompt, budget left)`;
# 3. then requests of `waiting` join, in order, while budget is left, fewer than `max_seqs` requests run, and the
#    blocks of the prompt, `ceil(prompt_len / block_size)`, fit in `free_blocks` (each admission uses its blocks
#    up). The first request that cannot join stops admission: nobody skips the queue. Each gets a chunk as in 2.
#
# Every token given spends budget; a request given 0 tokens is not listed.

# %%
import math


def schedule_step(running, waiting, token_budget, max_seqs, free_blocks, block_size):
    rows, budget = [], token_budget
    # TODO: decodes, then prefills under way, then admissions
    raise NotImplementedError("fill in schedule_step")


# %%
from labkit.exercises import check

check("05.schedule_step", schedule_step)

# %% [markdown]
# ### Exercise 05.decode_slots (20 minutes)
# Before a step, each decoding request needs a slot for its newest token. Its cache holds `num_tokens - 1`
# tokens in `ceil((num_tokens - 1) / block_size)` blocks, so it needs a new block exactly when `num_tokens - 1` is
# a multiple of `block_size`. Write `reserve_decodes(running, free_blocks, block_size) -> (scheduled ids, preempted
# ids)`: go through the decoding requests oldest first; while a request needs a block and none is free, preempt the
# youngest request still running (the last one of `running` not yet preempted) and add its blocks to the free ones;
# if the victim is the request itself, it gets no slot. A prefilling request is never scheduled here, but it can be
# preempted; it holds `ceil(num_tokens / block_size)` blocks.

# %%
def reserve_decodes(running, free_blocks, block_size):
    scheduled, preempted = [], []
    # TODO
    raise NotImplementedError("fill in reserve_decodes")


# %%
check("05.decode_slots", reserve_decodes)
