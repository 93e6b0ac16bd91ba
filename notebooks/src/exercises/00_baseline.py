# %% [markdown]
# ## Exercises
#
# Each exercise is a skeleton to fill in, followed by a check cell. `check` runs your code and labkit's on the same
# irregular cases and prints which passed and, for the first that failed, what was expected and what you returned;
# it never shows labkit's answer. A *predict-then-measure* exercise goes on: once every case passes, the check runs
# your function on the inputs this notebook measured and sets your prediction against the measurement (this run's
# record when it has one, else the committed record, and it says which), with the gap explained.
# `python -m labkit exercises` lists your progress. (Run headless, as `python -m labkit run` does, an unfilled
# skeleton is replaced by labkit's solution, and the check says so.)
#
# ### Exercise 00.fifo_p99_ttft (predict, then measure; 20 minutes)
# The FIFO server above takes one request at a time. Predict its p99 time to first token before looking at the
# load sweep: write `fifo_p99_ttft(n_requests, rate_req_s, service_s, prefill_s)`, with `n_requests` Poisson
# arrivals at `rate_req_s`, a mean service time `service_s` per request, and `prefill_s` from the moment a request
# starts to its first token.
#
# * The utilisation is `rho = rate_req_s * service_s`.
# * Below capacity (`rho < 1`) use M/M/1: the chance that a request waits longer than `t` is
#   `rho * exp(-(1 - rho) * t / service_s)`. Solve for the wait that only 1% exceed (0 if that is negative).
# * At or above capacity the queue never drains while requests arrive. Space the arrivals evenly (`1 / rate`
#   apart) and serve each in `service_s`: request `i` (counting from 0) waits `i * (service_s - 1 / rate)`. The p99
#   request is `i = 0.99 * (n_requests - 1)`.
# * The time to first token is the wait plus `prefill_s`.
#
# The check then takes each FIFO row of the sweep: the service time is its busy time over its requests, the prefill
# the batch-1 probe's time to first token. Before running it, decide: which load will your model predict better, and
# why does the p99 at the highest load depend on how many requests were sent?

# %%
import math


def fifo_p99_ttft(n_requests, rate_req_s, service_s, prefill_s):
    rho = rate_req_s * service_s
    # TODO: the p99 wait below capacity (M/M/1) or at and above it (a queue that grows), plus the prefill
    raise NotImplementedError("fill in fifo_p99_ttft")


# %%
from labkit.exercises import check

check("00.fifo_p99_ttft", fifo_p99_ttft)

# %% [markdown]
# ### Exercise 00.static_vs_fifo (decide; 15 minutes)
# Static batches multiply the work per weight read, but a batch runs until its longest request ends. Decide, for a
# queue of requests, whether static batches beat serving them one at a time: write
# `static_vs_fifo(output_lens, batch, step_s)`, where `output_lens` are the decode steps each request needs (in
# arrival order), batches take `batch` consecutive requests (the last one may be smaller), and a decode step of `b`
# requests takes `step_s[b]` seconds (a profile table: flat in `b` on a GPU at small batch, nearly linear on a
# small CPU model). Return a dict:
#
# * `"fifo_s"`: every request alone, one after the other; `"static_s"`: each batch runs `max(its lengths)` steps;
# * `"speedup"`: `fifo_s / static_s`;
# * `"useful_slot_frac"`: decode slots that hold a live request, over all slots the batches ran
#   (`sum(output_lens) / sum over batches of size x max length`);
# * `"choice"`: `"static"` when it is faster, else `"FIFO"`.

# %%
def static_vs_fifo(output_lens, batch, step_s):
    # TODO: time both ways, the useful slots, and the choice
    raise NotImplementedError("fill in static_vs_fifo")


# %%
check("00.static_vs_fifo", static_vs_fifo)
