"""Running out of blocks: a scheduler that preempts by recompute or swap, and a greedy generator built on it.

When a running sequence needs a new block and none is free, the most recently admitted running sequence gives
its blocks up (vLLM's policy: the youngest has the least work to lose):

* ``recompute``: free its blocks and put it back at the head of the waiting queue; when readmitted it prefills
  prompt + generated tokens again (cheaper with prefix caching, since its freed blocks may still be cached).
* ``swap``: copy its blocks to CPU memory (``SwapSpace``), free them, and copy them back into fresh blocks
  later. Nothing is recomputed; the price is PCIe traffic both ways. Falls back to recompute when the swap
  space is full.

A request is never dropped: every request finishes, and a request that could not fit even in an empty cache is
refused up front with a ``CacheFullError`` naming the sizes. Swapping copies bytes, so its outputs equal an
unconstrained run exactly; recompute re-derives K/V in a differently shaped batch, equal up to float rounding.

``Scheduler`` decides, step by step, which sequences run and reserves their slots; it does not run a model, so
the request-mix simulation (``labkit.kvcache.simulate``) drives the same policy on a cache without tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from labkit.kvcache.block_allocator import CacheFullError
from labkit.kvcache.model import PagedModelRunner, prepare_step
from labkit.kvcache.paged import PagedKVCache
from labkit.kvcache.swap import SwapSpace

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(eq=False)  # requests are compared by identity (list.remove must find this one, not an equal one)
class Request:
    """One prompt to continue for ``max_new_tokens`` tokens (fewer if the end-of-sequence token comes)."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class SchedulerStats:
    """What a scheduler did so far."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens computed in prefills, recomputation included
    prefix_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead
    recomputed_tokens: int = 0  # tokens prefilled again after a recompute preemption
    preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    max_running: int = 0
    max_blocks_used: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Scheduler:
    """First-come-first-served continuous batching over one ``PagedKVCache``, preempting when blocks run short.

    Each ``schedule()`` reserves one slot for every running sequence's pending token (preempting the youngest
    while blocks are short), then, if nothing was preempted, resumes swapped sequences and admits waiting ones
    (``max_num_seqs`` running at most, ``max_prefill_tokens`` prefilled per step; one request is admitted
    regardless so a long prompt is never starved). A new request is admitted only if ``watermark`` of the blocks
    stay free after it (vLLM keeps 1%): headroom for the running ones to grow, so that admitting does not
    immediately force a preemption. ``finish_step`` appends the sampled tokens and frees finished requests.
    """

    def __init__(self, cache: PagedKVCache, preemption: str = "recompute", swap_blocks: int | None = None,
                 max_num_seqs: int = 256, max_prefill_tokens: int = 4096, eos_token_id: int | None = None,
                 watermark: float = 0.01):
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption={preemption!r} is unknown; allowed: {PREEMPTION_MODES}")
        if max_num_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_prefill_tokens={max_prefill_tokens} must "
                             f"be >= 1")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark} must be in [0, 1)")
        self.cache = cache
        self.watermark_blocks = int(watermark * cache.num_blocks)
        self.swap = SwapSpace(cache, swap_blocks or cache.num_blocks) if preemption == "swap" else None
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.stats = SchedulerStats()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, req: Request) -> None:
        """Queue a request; refuse one that could not fit even alone in the empty cache."""
        if req.max_new_tokens < 1 or not req.prompt:
            raise ValueError(f"request {req.request_id}: needs a non-empty prompt and max_new_tokens >= 1")
        need = self.cache.blocks_for(len(req.prompt) + req.max_new_tokens - 1)  # the last token needs no slot
        if need > self.cache.num_blocks:
            raise CacheFullError(f"request {req.request_id}: prompt of {len(req.prompt)} tokens + "
                                 f"max_new_tokens={req.max_new_tokens} needs {need} blocks of "
                                 f"{self.cache.block_size} tokens, but the cache has {self.cache.num_blocks}: "
                                 f"it can never fit; give the cache more blocks or lower max_new_tokens")
        self.waiting.append(req)

    # --- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> list[Request]:
        """The requests to run this step, in batch order, with their slots reserved (may be empty)."""
        preemptions_before = self.stats.preemptions
        batch = self._reserve_decode_slots()
        if self.stats.preemptions == preemptions_before:  # blocks were short this step: admit nothing new
            batch += self._swap_in()
            if not self.swapped:
                batch += self._admit()
        if batch:
            self.stats.steps += 1
            self.stats.max_running = max(self.stats.max_running, len(self.running))
            self.stats.max_blocks_used = max(self.stats.max_blocks_used, self.cache.allocator.num_used)
        return batch

    def finish_step(self, batch: Sequence[Request], tokens: Sequence[int]) -> None:
        """Append each request's new token; free the requests that are done."""
        for req, tok in zip(batch, tokens, strict=True):
            req.output.append(tok)
            if len(req.output) >= req.max_new_tokens or tok == self.eos_token_id:
                self.cache.free(req.request_id)
                self.running.remove(req)

    def _reserve_decode_slots(self) -> list[Request]:
        decode, i = [], 0
        while i < len(self.running):
            req = self.running[i]
            if self.cache.can_append(req.request_id, 1):
                self.cache.append_slots(req.request_id, req.output[-1:])
                decode.append(req)
                i += 1
            else:
                self._preempt(self.running.pop())  # the youngest; may be req itself, which ends the loop
        return decode

    def _preempt(self, req: Request) -> None:
        req.num_preemptions += 1
        self.stats.preemptions += 1
        if self.swap is not None and self.swap.can_swap_out(self.cache, req.request_id):
            self.swap.swap_out(self.cache, req.request_id)
            self.stats.swapped_out_blocks = self.swap.blocks_out
            self.swapped.appendleft(req)
        else:
            self.cache.free(req.request_id)
            self.waiting.appendleft(req)

    def _swap_in(self) -> list[Request]:
        resumed = []
        while self.swapped and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            seq = self.swap.seqs[req.request_id]
            # its blocks, plus one more if the pending token starts a new block
            need = len(seq.block_table) + (seq.num_tokens % self.cache.block_size == 0)
            if need > self.cache.allocator.num_free:
                break
            self.swapped.popleft()
            self.swap.swap_in(self.cache, req.request_id)
            self.stats.swapped_in_blocks = self.swap.blocks_in
            self.cache.append_slots(req.request_id, req.output[-1:])
            self.running.append(req)
            resumed.append(req)
        return resumed

    def _can_admit(self, tokens: list[int]) -> bool:
        if not self.running:  # alone it always fits (checked in add); the watermark must not block it
            return self.cache.can_allocate(tokens)
        return self.cache.blocks_needed(tokens) + self.watermark_blocks <= self.cache.allocator.num_free

    def _admit(self) -> list[Request]:
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_tokens  # after a recompute preemption: prompt + everything generated so far
            if (admitted and len(tokens) > budget) or not self._can_admit(tokens):
                break
            self.waiting.popleft()
            cached = self.cache.allocate(req.request_id, tokens)
            self.stats.prefix_cached_tokens += cached
            self.stats.prefill_tokens += len(tokens) - cached
            if req.num_preemptions:
                self.stats.recomputed_tokens += len(tokens) - cached
            budget -= len(tokens) - cached
            self.running.append(req)
            admitted.append(req)
        return admitted


class PagedGenerator:
    """Greedy decoding of many requests with a ``Scheduler`` and a ``PagedModelRunner``: each step decodes one
    token for every running sequence and prefills newly admitted ones, all in one flat batch."""

    def __init__(self, model, cache: PagedKVCache, preemption: str = "recompute",
                 swap_blocks: int | None = None, max_num_seqs: int = 256, max_prefill_tokens: int = 4096,
                 eos_token_id: int | None = None, watermark: float = 0.01, attention_backend: str = "auto"):
        self.cache = cache
        self.runner = PagedModelRunner(model, cache, attention_backend)
        self.scheduler_args = dict(preemption=preemption, swap_blocks=swap_blocks, max_num_seqs=max_num_seqs,
                                   max_prefill_tokens=max_prefill_tokens, eos_token_id=eos_token_id,
                                   watermark=watermark)
        Scheduler(cache, **self.scheduler_args)  # check the arguments now
        self.stats = SchedulerStats()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 progress: bool = False) -> list[list[int]]:
        """Greedy continuations of ``prompts`` (token id lists), in order; statistics land in ``self.stats``."""
        lens = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(lens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(lens)} entries for {len(prompts)} prompts")
        if self.cache.seqs:
            raise ValueError("the cache must be empty when generate starts")
        sched = Scheduler(self.cache, **self.scheduler_args)
        reqs = [Request(i, list(p), m) for i, (p, m) in enumerate(zip(prompts, lens, strict=True))]
        for r in reqs:
            sched.add(r)  # refuses a request that can never fit before any work is done
        bar = tqdm(total=sum(lens), desc="generate", unit="tok", disable=not progress)
        with torch.inference_mode():
            while sched.has_unfinished:
                batch = sched.schedule()
                if not batch:  # every request fits alone, so some request can always run
                    raise RuntimeError("the scheduler found nothing to run with requests unfinished")
                logits = self.runner.forward(prepare_step(self.cache, [r.request_id for r in batch]))
                sched.finish_step(batch, logits.argmax(-1).tolist())
                bar.update(len(batch))
        bar.close()
        self.stats = sched.stats
        return [r.output for r in reqs]
