"""Running out of blocks: preempt by recompute or by swap, and a greedy generation loop that does both.

When a running sequence needs a new block and none is free, the most recently admitted running sequence gives
its blocks up (vLLM's policy: the youngest has the least work to lose):

* ``recompute``: free its blocks and put it back at the head of the waiting queue; when readmitted it prefills
  prompt + generated tokens again (cheaper with prefix caching, since its freed blocks may still be cached).
* ``swap``: copy its blocks to CPU memory (``SwapSpace``), free them, and copy them back into fresh blocks
  later. Nothing is recomputed; the price is PCIe traffic both ways. Falls back to recompute when the swap
  space is full.

A request is never dropped: every request finishes, and a request that could not fit even in an empty cache is
refused up front with a ``CacheFullError`` naming the sizes. Swapping copies bytes, so its outputs equal an
unconstrained run exactly; recompute re-derives K/V with a different batch shape, equal to float rounding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError
from labkit.kvcache.model import PagedModelRunner, prepare_step
from labkit.kvcache.paged import PagedKVCache, SeqBlocks

PREEMPTION_MODES = ("recompute", "swap")


class SwapSpace:
    """CPU memory for blocks swapped out of a ``PagedKVCache``: pools of the same block shape (pinned when the
    cache is on CUDA, so copies are asynchronous-capable DMA) with their own allocator."""

    def __init__(self, cache: PagedKVCache, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        pin = cache.device.type == "cuda"
        self.pools = [[torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in pools]
                      for pools in (cache.k_caches, cache.v_caches, cache.k_scales, cache.v_scales)]
        self.seqs: dict[Hashable, SeqBlocks] = {}
        self.blocks_out = 0  # blocks copied device -> CPU so far
        self.blocks_in = 0

    def can_swap_out(self, cache: PagedKVCache, seq_id: Hashable) -> bool:
        return len(cache.seq(seq_id).block_table) <= self.allocator.num_free

    def swap_out(self, cache: PagedKVCache, seq_id: Hashable) -> None:
        """Copy a sequence's blocks to CPU memory and release them in the cache."""
        seq = cache.seq(seq_id)
        cpu_blocks = self.allocator.allocate(len(seq.block_table))
        src = torch.tensor(seq.block_table, device=cache.device)
        dst = torch.tensor(cpu_blocks)
        for cpu_pools, dev_pools in zip(self.pools, (cache.k_caches, cache.v_caches, cache.k_scales,
                                                     cache.v_scales), strict=True):
            for cpu, dev in zip(cpu_pools, dev_pools, strict=True):
                cpu[dst] = dev[src].cpu()
        self.seqs[seq_id] = SeqBlocks(cpu_blocks, list(seq.token_ids), seq.num_computed)
        self.blocks_out += len(cpu_blocks)
        cache.free(seq_id)

    def blocks_to_swap_in(self, seq_id: Hashable) -> int:
        return len(self.seqs[seq_id].block_table)

    def swap_in(self, cache: PagedKVCache, seq_id: Hashable) -> None:
        """Copy a swapped sequence back into fresh blocks of the cache (``CacheFullError`` if too few are
        free)."""
        seq = self.seqs[seq_id]
        if seq_id in cache.seqs:
            raise ValueError(f"seq_id={seq_id!r} is already in the cache")
        dev_blocks = cache.allocator.allocate(len(seq.block_table))
        src = torch.tensor(seq.block_table)
        dst = torch.tensor(dev_blocks, device=cache.device)
        for cpu_pools, dev_pools in zip(self.pools, (cache.k_caches, cache.v_caches, cache.k_scales,
                                                     cache.v_scales), strict=True):
            for cpu, dev in zip(cpu_pools, dev_pools, strict=True):
                dev[dst] = cpu[src].to(cache.device, non_blocking=True)
        del self.seqs[seq_id]
        for b in seq.block_table:
            self.allocator.free(b)
        self.blocks_in += len(dev_blocks)
        cache.seqs[seq_id] = SeqBlocks(dev_blocks, seq.token_ids, 0)
        cache.mark_computed(seq_id, seq.num_computed)  # re-registers its full blocks with the prefix cache


@dataclass
class Request:
    """One prompt to continue greedily for ``max_new_tokens`` tokens (fewer if ``eos_token_id`` comes)."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class GenerationStats:
    """What a ``PagedGenerator.generate`` call did."""

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


class PagedGenerator:
    """Greedy decoding of many requests on one ``PagedKVCache``: admit while blocks last, preempt when short.

    Each step decodes one token for every running sequence and prefills newly admitted ones, all in one flat
    batch (``PagedModelRunner``). Admission is first come, first served; preempted requests resume before any
    new one is admitted. ``max_num_seqs`` caps the running batch; ``max_prefill_tokens`` caps the tokens
    prefilled per step (one request is admitted regardless, so a long prompt is never starved).
    """

    def __init__(self, model, cache: PagedKVCache, preemption: str = "recompute",
                 swap_blocks: int | None = None, max_num_seqs: int = 256, max_prefill_tokens: int = 4096,
                 eos_token_id: int | None = None, attention_backend: str = "auto"):
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption={preemption!r} is unknown; allowed: {PREEMPTION_MODES}")
        if max_num_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_prefill_tokens={max_prefill_tokens} must "
                             f"be >= 1")
        self.cache = cache
        self.runner = PagedModelRunner(model, cache, attention_backend)
        self.preemption = preemption
        self.swap = SwapSpace(cache, swap_blocks or cache.num_blocks) if preemption == "swap" else None
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.eos_token_id = eos_token_id

    def _check_fits(self, req: Request) -> None:
        # The last generated token is never fed back, so it needs no slot.
        tokens = len(req.prompt) + req.max_new_tokens - 1
        need = self.cache.blocks_for(tokens)
        if need > self.cache.num_blocks:
            raise CacheFullError(f"request {req.request_id}: prompt of {len(req.prompt)} tokens + "
                                 f"max_new_tokens={req.max_new_tokens} needs {need} blocks of "
                                 f"{self.cache.block_size} tokens, but the cache has {self.cache.num_blocks}: "
                                 f"it can never fit; give the cache more blocks or lower max_new_tokens")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 progress: bool = False) -> list[list[int]]:
        """Greedy continuations of ``prompts`` (token id lists), in order. Statistics land in
        ``self.stats``."""
        lens = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(lens) != len(prompts) or any(m < 1 for m in lens) or any(len(p) < 1 for p in prompts):
            raise ValueError("need one max_new_tokens >= 1 per prompt, and non-empty prompts")
        if self.cache.seqs:
            raise ValueError("the cache must be empty when generate starts")
        reqs = [Request(i, list(p), m) for i, (p, m) in enumerate(zip(prompts, lens, strict=True))]
        for r in reqs:
            self._check_fits(r)
        self.stats = GenerationStats()
        self.waiting: deque[Request] = deque(reqs)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        bar = tqdm(total=sum(lens), desc="generate", unit="tok", disable=not progress)
        while self.waiting or self.running or self.swapped:
            bar.update(self._step())
        bar.close()
        return [r.output for r in reqs]

    # --- one step -------------------------------------------------------------------------------------------
    def _step(self) -> int:
        preemptions_before = self.stats.preemptions
        decode = self._reserve_decode_slots()
        prefill: list[Request] = []
        if self.stats.preemptions == preemptions_before:  # blocks were short this step: admit nothing new
            decode += self._swap_in()
            if not self.swapped:
                prefill = self._admit()
        batch_reqs = decode + prefill
        if not batch_reqs:
            return 0
        logits = self.runner.forward(prepare_step(self.cache, [r.request_id for r in batch_reqs]))
        self.stats.steps += 1
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        self.stats.max_blocks_used = max(self.stats.max_blocks_used, self.cache.allocator.num_used)
        for req, tok in zip(batch_reqs, logits.argmax(-1).tolist(), strict=True):
            req.output.append(tok)
            if len(req.output) >= req.max_new_tokens or tok == self.eos_token_id:
                self.cache.free(req.request_id)
                self.running.remove(req)
        return len(batch_reqs)

    def _reserve_decode_slots(self) -> list[Request]:
        """A slot for each running sequence's pending token, preempting the youngest while blocks are
        short."""
        decode, i = [], 0
        while i < len(self.running):
            req = self.running[i]
            if self.cache.can_append(req.request_id, 1):
                self.cache.append_slots(req.request_id, req.output[-1:])
                decode.append(req)
                i += 1
                continue
            victim = self.running.pop()  # the youngest; may be req itself, which ends the loop
            self._preempt(victim)
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
            need = self.swap.blocks_to_swap_in(req.request_id) + (seq.num_tokens % self.cache.block_size == 0)
            if need > self.cache.allocator.num_free:
                break
            self.swapped.popleft()
            self.swap.swap_in(self.cache, req.request_id)
            self.stats.swapped_in_blocks = self.swap.blocks_in
            self.cache.append_slots(req.request_id, req.output[-1:])
            self.running.append(req)
            resumed.append(req)
        return resumed

    def _admit(self) -> list[Request]:
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_tokens
            if (admitted and len(tokens) > budget) or not self.cache.can_allocate(tokens):
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
