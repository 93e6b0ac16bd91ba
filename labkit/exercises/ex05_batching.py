"""Notebook 05 (batching): one step of continuous batching under a token budget, and decode slots with preemption.

Both are the policy of labkit's ``ContinuousBatchingScheduler`` (``labkit.engine.policies``), taken out of the
engine into pure functions over plain records so that a learner can write them in a cell: the engine's version also
moves K/V blocks, samples and swaps, which is beside the point here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from labkit.exercises.core import Case, Exercise, register, whole_diff


@dataclass(frozen=True)
class Req:
    """A request as the scheduler sees it: ``prompt_len`` prompt tokens, ``num_tokens`` tokens so far (prompt +
    outputs), ``num_computed`` of them with K/V in the cache. A running request with ``num_computed <
    prompt_len`` is still prefilling; one with ``num_computed == num_tokens - 1`` is decoding."""

    id: str
    prompt_len: int
    num_tokens: int
    num_computed: int = 0


def schedule_step(running: list[Req], waiting: list[Req], token_budget: int, max_seqs: int, free_blocks: int,
                  block_size: int) -> list[tuple[str, int]]:
    """Solution: the ``(request id, tokens this step)`` rows of one step, in the order they are scheduled.

    1. every decoding request in ``running`` (oldest first) gets 1 token;
    2. then each request in ``running`` still prefilling gets ``min(rest of its prompt, budget left)`` (a chunk);
    3. then requests of ``waiting`` join in order, while budget is left, fewer than ``max_seqs`` run, and their
       prompt's blocks (``ceil(prompt_len / block_size)``) fit in ``free_blocks`` (which each admission uses up);
       the first that does not fit stops admission (first come, first served); each gets a chunk as in 2.
    A request given 0 tokens is not listed.
    """
    rows, budget = [], token_budget
    for r in running:
        if r.num_computed >= r.prompt_len and budget > 0:
            rows.append((r.id, 1))
            budget -= 1
    for r in running:
        if r.num_computed < r.prompt_len and budget > 0:
            n = min(r.prompt_len - r.num_computed, budget)
            rows.append((r.id, n))
            budget -= n
    n_running = len(running)
    for r in waiting:
        need = math.ceil(r.prompt_len / block_size)
        if budget <= 0 or n_running >= max_seqs or need > free_blocks:
            break
        n = min(r.prompt_len, budget)
        rows.append((r.id, n))
        budget -= n
        free_blocks -= need
        n_running += 1
    return rows


def _random_reqs(rng: random.Random, prefix: str, k: int, running: bool) -> list[Req]:
    out = []
    for i in range(k):
        p = rng.randint(1, 300)
        if running and rng.random() < 0.6:  # decoding: prompt done, some outputs
            t = p + rng.randint(1, 50)
            out.append(Req(f"{prefix}{i}", p, t, t - 1))
        elif running:  # a chunked prefill under way
            out.append(Req(f"{prefix}{i}", p, p, rng.randint(0, p - 1)))
        else:
            out.append(Req(f"{prefix}{i}", p, p, 0))
    return out


def _step_cases() -> list[Case]:
    cases = [
        Case("3 decoding, 2 waiting, plenty of everything",
             ([Req("a", 10, 12, 11), Req("b", 5, 9, 8), Req("c", 7, 8, 7)], [Req("d", 20, 20), Req("e", 3, 3)],
              512, 8, 100, 16)),
        Case("the budget splits a prompt: chunked prefill", ([Req("a", 10, 11, 10)],
                                                             [Req("b", 100, 100), Req("c", 5, 5)], 64, 8, 100, 16)),
        Case("max_seqs reached exactly: nobody joins", ([Req("a", 4, 5, 4), Req("b", 4, 6, 5)],
                                                        [Req("c", 4, 4)], 100, 2, 100, 4)),
        Case("the head of the queue does not fit in the free blocks: it blocks the rest",
             ([], [Req("a", 33, 33), Req("b", 2, 2)], 100, 4, 2, 16)),
        Case("a prefill under way takes the budget before newcomers", ([Req("a", 50, 50, 20), Req("b", 9, 10, 9)],
                                                                       [Req("c", 8, 8)], 40, 4, 100, 8)),
    ]
    for seed in range(5):
        rng = random.Random(seed)
        running = _random_reqs(rng, "r", rng.randint(0, 6), True)
        waiting = _random_reqs(rng, "w", rng.randint(0, 6), False)
        budget, max_seqs = rng.choice([16, 64, 256, 2048]), rng.randint(max(1, len(running)), 10)
        free, bs = rng.randint(0, 40), rng.choice([4, 16])
        cases.append(Case(f"random: {len(running)} running, {len(waiting)} waiting, budget {budget}, max_seqs "
                          f"{max_seqs}, {free} free blocks of {bs}", (running, waiting, budget, max_seqs, free, bs)))
    return cases


def _run_step(fn, data):
    running, waiting, *rest = data
    return [tuple(r) for r in fn(list(running), list(waiting), *rest)]


register(Exercise(
    "05.schedule_step", "one continuous-batching step under a token budget", schedule_step, _step_cases,
    _run_step, whole_diff,
    hint="decodes first, then prefills under way, then admissions; every row spends budget; stop admitting at the "
         "first request that does not fit (no skipping ahead)"))


def reserve_decodes(running: list[Req], free_blocks: int, block_size: int) -> tuple[list[str], list[str]]:
    """Solution: give each decoding request (oldest first) a slot for its newest token; returns ``(scheduled ids,
    preempted ids)``.

    A request's cache holds ``num_tokens - 1`` token slots in ``ceil((num_tokens - 1) / block_size)`` blocks; its
    newest token needs a new block when ``num_tokens - 1`` is a multiple of ``block_size``. When no block is free,
    preempt the youngest request still running (the last of ``running``), whose blocks return to the free pool, and
    retry; if the request itself is the youngest, it is preempted and gets no slot. Prefilling requests
    (``num_computed < prompt_len``) are not scheduled here but can be preempted (they hold
    ``ceil(num_tokens / block_size)`` blocks).
    """
    alive = list(running)
    scheduled, preempted = [], []

    def held(r: Req) -> int:
        cached = r.num_tokens - 1 if r.num_computed >= r.prompt_len else r.num_tokens
        return math.ceil(cached / block_size)

    for r in running:
        if r not in alive or r.num_computed < r.prompt_len:
            continue
        need = 1 if (r.num_tokens - 1) % block_size == 0 else 0
        while need > free_blocks:
            victim = alive.pop()
            preempted.append(victim.id)
            free_blocks += held(victim)
            if victim is r:
                break
        if r in alive:
            free_blocks -= need
            scheduled.append(r.id)
    return scheduled, preempted


def _decode_cases() -> list[Case]:
    cases = [Case("block_size=4: two need a new block, one free", ([Req("a", 3, 5, 4), Req("b", 8, 9, 8),
                                                                    Req("c", 2, 4, 3)], 1, 4)),
             Case("no free block: the youngest is preempted to make room", ([Req("a", 4, 5, 4), Req("b", 6, 7, 6),
                                                                             Req("c", 1, 3, 2)], 0, 4)),
             Case("the youngest itself needs the block: it is preempted, gets no slot",
                  ([Req("a", 5, 6, 5), Req("b", 4, 5, 4)], 0, 2))]
    for seed in range(5):
        rng = random.Random(10 + seed)
        running = _random_reqs(rng, "r", rng.randint(1, 8), True)
        free, bs = rng.randint(0, 3), rng.choice([1, 2, 4, 16])
        cases.append(Case(f"random: {len(running)} running, {free} free blocks of {bs}", (running, free, bs)))
    return cases


def _run_decodes(fn, data):
    running, free, bs = data
    scheduled, preempted = fn(list(running), free, bs)
    return {"scheduled": list(scheduled), "preempted": list(preempted)}


register(Exercise(
    "05.decode_slots", "decode slots with preemption of the youngest when blocks run out", reserve_decodes,
    _decode_cases, _run_decodes, whole_diff,
    hint="a new block is needed only when the token lands at offset 0 of a block; preempt from the end of running "
         "(youngest), free its blocks, and stop if the victim is the request you were serving"))
