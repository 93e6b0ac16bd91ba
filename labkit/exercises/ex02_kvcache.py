"""Notebook 02 (KV cache): a block allocator with reference counts, block tables with fork and copy on write, and
a prediction of how many more sequences a paged cache runs (set against the notebook's simulation).

The solutions are labkit's own ``BlockAllocator`` and ``PagedKVCache`` (bookkeeping only, ``allocate_pools=False``).
Block ids are compared up to a renaming: a learner's allocator may hand out other ids, as long as the same blocks
are shared by the same sequences.
"""

from __future__ import annotations

import math
import random

from labkit.exercises.core import NOTE, Case, Exercise, Measurement, Prediction, register, trace_diff
from labkit.exercises.measured import data_of, figure
from labkit.kvcache.block_allocator import BlockAllocator
from labkit.kvcache.paged import PagedKVCache, SeqBlocks


def _outcome(f, *args):
    """('ok', value) or ('error', what it said): a full cache, a double free, an unknown sequence must raise."""
    try:
        return "ok", f(*args)
    except NotImplementedError:
        raise
    except (RuntimeError, ValueError, KeyError, IndexError, AssertionError) as e:  # raising can be the right answer
        return "error", f"{type(e).__name__}: {e}"[:160]


def _obs(kind: str, value) -> dict:
    """An observation's outcome, with what an exception said as a note (shown, never compared)."""
    return {"outcome": kind, NOTE + "raised": value} if kind == "error" else {"outcome": kind}


def _allocator_cases() -> list[Case]:
    cases = []
    for seed, n in ((0, 1), (1, 5), (2, 13), (3, 64)):
        rng = random.Random(seed)
        ops = []
        for _ in range(12 + 3 * n):
            r = rng.random()
            if r < 0.45:
                ops.append(("allocate", rng.randint(0, max(1, n // 2 + 1))))
            elif r < 0.65:
                ops.append(("incref", rng.randrange(n)))
            else:
                ops.append(("free", rng.randrange(n)))
        cases.append(Case(f"{n} blocks, {len(ops)} random allocate / incref / free calls (some must raise)",
                          (n, ops)))
    cases.insert(0, Case("3 blocks: allocate 2, share one, free it twice (a third free must raise), allocate 2",
                         (3, [("allocate", 2), ("incref", 0), ("free", 0), ("free", 0), ("allocate", 2),
                              ("allocate", 1), ("free", 1), ("free", 1)])))
    return cases


def _run_allocator(cls, data):
    """Drive an allocator class through ``ops``. Blocks are named by *handle*, the order they were handed out in,
    so another free-list order still matches; incref/free pick among the handles still referenced (by the
    checker's own count), and a block whose last reference went is freed and incref'd once more: both must raise."""
    n, ops = data
    a = cls(n)
    handles: list[int] = []  # this implementation's block id of each handle
    counts: list[int] = []  # references of each handle, counted by the checker
    trace = [("construct", {"num_free": a.num_free})]
    for op, arg in ops:
        live = [h for h, c in enumerate(counts) if c > 0]
        if op == "allocate":
            kind, got = _outcome(a.allocate, arg)
            obs = _obs(kind, got)
            if kind == "ok":
                got = list(got)
                in_use = {handles[h] for h in live}
                obs["returned n distinct ids in 0..num_blocks-1"] = (
                    len(got) == arg and len(set(got)) == arg and all(isinstance(b, int) and 0 <= b < n for b in got))
                obs["returned a block still in use"] = any(b in in_use for b in got)
                handles += got
                counts += [1] * len(got)
            obs["num_free"] = a.num_free
            trace.append((f"allocate({arg})", obs))
            continue
        if not live:
            continue
        h = live[arg % len(live)]
        kind, said = _outcome(getattr(a, op), handles[h])
        if kind == "ok":
            counts[h] += 1 if op == "incref" else -1
        trace.append((f"{op}(block handed out #{h})", {**_obs(kind, said), "num_free": a.num_free}))
        if op == "free" and kind == "ok" and counts[h] == 0:
            for again in ("free", "incref"):  # the block is free now: a double free and a share of it must raise
                kind, said = _outcome(getattr(a, again), handles[h])
                trace.append((f"{again}(block handed out #{h}) again, now that it is free",
                              {**_obs(kind, said), "num_free": a.num_free}))
    return trace


register(Exercise(
    "02.allocator", "block allocator: allocate(n), incref(block), free(block), num_free", BlockAllocator,
    _allocator_cases, _run_allocator, trace_diff,
    hint="allocate takes all n or raises (CacheFullError) and changes nothing; free of a free block raises; a "
         "block returns to the free list when its last reference goes"))


class CowSolution(PagedKVCache):
    """Solution of 02.cow: labkit's ``PagedKVCache`` bookkeeping over sequences named by id (a ``SeqBlocks`` each,
    its K/V counted as written after every operation), recording each copy on write in ``copies``."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(1, 1, 1, num_blocks, block_size, allocate_pools=False)
        self.copies: list[tuple[int, int]] = []
        self.seqs: dict = {}

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))

    def block_table(self, seq_id) -> list[int]:
        return list(self.seqs[seq_id].block_table)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def allocate(self, seq_id, num_tokens: int) -> None:
        self.seqs[seq_id] = seq = SeqBlocks([0] * num_tokens, seq_id)
        super().allocate(seq)
        self.mark_computed(seq, num_tokens)

    def append(self, seq_id) -> None:
        seq = self.seqs[seq_id]
        seq.token_ids.append(0)
        self.append_slots(seq)
        self.mark_computed(seq, seq.num_tokens)

    def fork(self, parent_id, child_id) -> None:
        parent = self.seqs[parent_id]
        self.seqs[child_id] = child = SeqBlocks(list(parent.token_ids), child_id)
        super().fork(parent, child)

    def free(self, seq_id) -> None:
        super().free(self.seqs.pop(seq_id))


def _cow_cases() -> list[Case]:
    fixed = [("allocate", "a", 5), ("fork", "a", "b"), ("append", "b"), ("append", "a"), ("append", "b"),
             ("free", "a"), ("append", "b"), ("free", "b")]
    cases = [Case("block_size=4: a with 5 tokens, fork b, both append (last block shared and partly full)",
                  (8, 4, fixed)),
             Case("block_size=3: fork at a block boundary (6 tokens): appends need new blocks, no copy",
                  (10, 3, [("allocate", "a", 6), ("fork", "a", "b"), ("append", "a"), ("append", "b"),
                           ("append", "a"), ("fork", "b", "c"), ("append", "c"), ("free", "b"), ("append", "c")]))]
    for seed, (nb, bs) in enumerate(((16, 2), (40, 5), (64, 16))):
        rng = random.Random(seed)
        live, ops, k = [], [], 0
        for _ in range(40):
            r = rng.random()
            if not live or r < 0.15:
                ops.append(("allocate", f"s{k}", rng.randint(1, 3 * bs)))
                live.append(f"s{k}")
                k += 1
            elif r < 0.35:
                ops.append(("fork", rng.choice(live), f"s{k}"))
                live.append(f"s{k}")
                k += 1
            elif r < 0.85:
                ops.append(("append", rng.choice(live)))
            else:
                s = rng.choice(live)
                live.remove(s)
                ops.append(("free", s))
        cases.append(Case(f"{nb} blocks of {bs} tokens: 40 random allocate / fork / append / free (may fill up)",
                          (nb, bs, ops)))
    return cases


def _run_cow(cls, data):
    """Trace each live sequence's table, num_free and the copies after every call. Block ids are renamed afresh at
    every step, in order of appearance across the tables, so the trace compares which blocks are shared by which
    sequences, not which ids an allocator picked."""
    nb, bs, ops = data
    c = cls(nb, bs)
    live: list[str] = []
    trace = []
    for op in ops:
        before = len(c.copies)
        kind, said = _outcome(getattr(c, op[0]), *op[1:])
        if kind == "ok":
            if op[0] in ("allocate", "fork"):
                live.append(op[1] if op[0] == "allocate" else op[2])
            elif op[0] == "free":
                live.remove(op[1])
        tables = {s: list(c.block_table(s)) for s in live}
        names: dict[int, str] = {}
        for t in tables.values():
            for b in t:
                names.setdefault(b, f"B{len(names)}")
        obs = _obs(kind, said)
        for s, t in tables.items():
            obs[f"block table of {s}"] = [names[b] for b in t]
        obs["copies made by this call (src, dst)"] = [(names.get(s, "a block no table holds"),
                                                       names.get(d, "a block no table holds"))
                                                      for s, d in c.copies[before:]]
        obs["num_free"] = c.num_free
        trace.append((f"{op[0]}({', '.join(map(repr, op[1:]))})", obs))
    return trace


register(Exercise(
    "02.cow", "block tables with fork and copy on write: allocate, append, fork, free", CowSolution,
    _cow_cases, _run_cow, trace_diff,
    hint="fork shares every block (incref); append copies the last block first only if it is shared AND partly "
         "full; a full last block means a new block, never a copy"))


def paged_capacity(prompt_lens: list[int], output_lens: list[int], budget_tokens: int, slab_tokens: int,
                   block_size: int) -> dict:
    """Solution: how many sequences a KV budget of ``budget_tokens`` slots holds at once, contiguous (a slab of
    ``slab_tokens`` per sequence) and paged (whole blocks of ``block_size`` as the sequence grows).

    A request of prompt ``p`` and output ``o`` decodes for ``o`` steps; at its step ``t`` (1..o) it holds ``p + t``
    token slots, rounded up to whole blocks. The paged capacity is the budget over the slots a running sequence holds
    *averaged over steps* (a long request is running for more steps, so it weighs more), not over requests."""
    contiguous = budget_tokens // slab_tokens
    held = sum(-(-(p + t) // block_size) * block_size for p, o in zip(prompt_lens, output_lens)
               for t in range(1, o + 1))
    paged = budget_tokens / (held / sum(output_lens))
    return {"contiguous_seqs": contiguous, "paged_seqs": paged, "ratio": paged / contiguous}


def _capacity_cases() -> list[Case]:
    cases = [Case("one request: prompt 5, output 3, blocks of 4, budget 64, slabs of 16", ([5], [3], 64, 16, 4)),
             Case("two requests, a short and a long one: the long one weighs 50x", ([10, 10], [2, 100], 4096, 128, 16)),
             Case("blocks of 1 token (no rounding)", ([7, 30, 2], [9, 1, 40], 1000, 50, 1))]
    for seed, (n, bs, budget) in enumerate(((50, 16, 65536), (333, 8, 100_000), (1000, 32, 1 << 20))):
        rng = random.Random(seed)
        p = [max(1, round(rng.lognormvariate(4.5, 1.0))) for _ in range(n)]
        o = [max(1, round(rng.lognormvariate(5.3, 1.0))) for _ in range(n)]
        cases.append(Case(f"{n} log-normal requests (means ~150 / ~330), blocks of {bs}, budget {budget}, slabs of "
                          f"the longest request ({max(a + b for a, b in zip(p, o))})",
                          (p, o, budget, max(a + b for a, b in zip(p, o)), bs)))
    return cases


def _capacity_measure() -> list[Measurement]:
    _, rec, source = figure("kvcache.max_seqs_ratio_vs_workload_max")
    data = data_of(rec, "notebook 02's capacity simulation")
    mix, bs = data["mix"], data["block_size"]
    p, o = mix["prompt_lens"], mix["output_lens"]
    budget, slab = data["sizes"]["sim_budget_tokens"], data["workload_max_len"]
    cap = data.get("max_num_seqs") or math.inf  # the engine's cap on running sequences, both sides (when recorded)
    measured = data["paged"]["mean_running_saturated"] / data["contiguous"]["mean_running_saturated"]
    naive = (min(cap, budget / (sum(-(-(a + b / 2) // bs) * bs for a, b in zip(p, o)) / len(p)))
             / min(cap, budget // slab))

    def explain(pred, meas):
        return (f"averaged over requests instead of steps (each holding its prompt and half its output) the model "
                f"would say {naive:.2f}x: long requests stay longer, so the running mix is longer than the request "
                f"mix. What is left: in the simulation a request joins holding only its prompt's blocks, the "
                f"youngest are preempted when blocks run out, and the mean counts only steps where requests wait; "
                f"the contiguous side is exact ({budget} // {slab} = {budget // slab} slabs)"
                + (f"; both sides run at most {cap} sequences, so each count is capped there" if cap < math.inf
                   else ""))
    return [Measurement(f"paged / contiguous sequences running at once ({len(p)} requests, budget {budget} slots, "
                        f"slabs of {slab}, blocks of {bs}" + (f", at most {cap} running" if cap < math.inf else "")
                        + ")", (p, o, budget, slab, bs), measured, "x", source, 0.25, explain,
                        pick=lambda obs: min(cap, obs["paged_seqs"]) / min(cap, obs["contiguous_seqs"]))]


register(Prediction(
    "02.paged_capacity", "predict how many more sequences a paged cache runs than contiguous slabs",
    paged_capacity, _capacity_cases, lambda fn, c: fn(list(c[0]), list(c[1]), *c[2:]), measure=_capacity_measure,
    hint="contiguous = budget // slab; paged = budget / (sum over requests and their decode steps t of "
         "ceil((p + t) / block) x block, divided by the number of steps, sum of o)"))
