"""Serving a request mix against a fixed KV budget, contiguous vs paged, without running a model.

The paged side drives the real ``Scheduler`` and ``PagedKVCache`` (built without tensors), so admission,
preemption and prefix hits follow exactly the code the model runs with; the contiguous side gives each admitted
request a slab of ``max_len`` slots (``ContiguousKVCache``). Time advances in decode steps: each step every
running request adds one token, and newly admitted ones add their prompt.

Request lengths come from ``lognormal_mix``: prompt and output lengths drawn independently from log-normal
distributions (heavy right tail: a few requests are ten times the median), with means matching those the vLLM
paper reports for ShareGPT (161 prompt and 338 output tokens on average); pairs longer than the model's context
are redrawn (and counted), never cut.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from labkit.kvcache.contiguous import ContiguousKVCache
from labkit.kvcache.paged import PagedKVCache
from labkit.kvcache.preemption import Request, Scheduler


@dataclass(frozen=True)
class RequestMix:
    """Prompt and output lengths of ``n`` requests, and how they were drawn."""

    prompt_lens: list[int]
    output_lens: list[int]
    distribution: str
    redrawn: int = 0  # pairs drawn again because prompt + output exceeded max_len

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def total_tokens(self) -> list[int]:
        return [p + o for p, o in zip(self.prompt_lens, self.output_lens, strict=True)]


def lognormal_mix(n: int, max_len: int, prompt_mean: float = 161.0, output_mean: float = 338.0,
                  sigma: float = 1.0, seed: int = 0) -> RequestMix:
    """``n`` requests with log-normal prompt and output lengths of the given means and log-space ``sigma``.

    A log-normal with log-space mean ``mu`` has mean ``exp(mu + sigma^2 / 2)``, so ``mu = ln(mean) - sigma^2/2``.
    Lengths are rounded and at least 1; a pair whose total exceeds ``max_len`` is redrawn.
    """
    if n < 1 or max_len < 2:
        raise ValueError(f"n={n} must be >= 1 and max_len={max_len} >= 2")
    if min(prompt_mean, output_mean, sigma) <= 0:
        raise ValueError("prompt_mean, output_mean and sigma must be positive")
    g = torch.Generator().manual_seed(seed)
    mus = (math.log(prompt_mean) - sigma**2 / 2, math.log(output_mean) - sigma**2 / 2)
    prompts, outputs, redrawn = [], [], 0
    while len(prompts) < n:
        z = torch.randn(2, 4 * n, generator=g, dtype=torch.float64)
        p = (mus[0] + sigma * z[0]).exp().round().clamp(min=1).long().tolist()
        o = (mus[1] + sigma * z[1]).exp().round().clamp(min=1).long().tolist()
        for a, b in zip(p, o, strict=True):
            if len(prompts) == n:
                break
            if a + b > max_len:
                redrawn += 1
                continue
            prompts.append(a)
            outputs.append(b)
    desc = (f"log-normal, sigma={sigma} in log space; mean prompt {prompt_mean:g}, mean output {output_mean:g} "
            f"tokens (ShareGPT means per the vLLM paper); pairs over max_len={max_len} redrawn")
    return RequestMix(prompts, outputs, desc, redrawn)


@dataclass
class SimResult:
    """One simulated run. Time averages are over sampled steps; *saturated* means some request was waiting."""

    name: str
    requests: int
    steps: int
    slots_total: int
    preemptions: int = 0
    mean_running: float = 0.0
    mean_running_saturated: float = 0.0
    peak_running: int = 0
    waste_frac: float = 0.0  # 1 - sum(tokens held) / sum(slots reserved)
    utilisation: float = 0.0  # mean tokens held / slots_total
    sharing_saving_frac: float = 0.0  # 1 - sum(tokens held) / sum(sequence lengths)
    prefill_tokens: int = 0
    prefix_cached_tokens: int = 0
    table_entries_per_seq: float = 0.0  # block-table entries (int32) per running sequence, mean
    trace: dict = field(default_factory=lambda: {"step": [], "running": [], "held": [], "reserved": []})

    def to_dict(self, with_trace: bool = False) -> dict:
        d = asdict(self)
        if not with_trace:
            d.pop("trace")
        return d


class _Sampler:
    """Accumulates occupancy samples into a ``SimResult``."""

    def __init__(self, result: SimResult):
        self.r = result
        self.held = self.reserved = self.logical = self.entries = 0
        self.n = self.n_sat = self.running_sum = self.running_sat_sum = 0

    def add(self, step: int, running: int, held: int, reserved: int, logical: int, saturated: bool,
            entries: int = 0) -> None:
        self.held, self.reserved, self.logical = self.held + held, self.reserved + reserved, self.logical + logical
        self.entries += entries
        self.n += 1
        self.running_sum += running
        if saturated:
            self.n_sat += 1
            self.running_sat_sum += running
        self.r.peak_running = max(self.r.peak_running, running)
        for k, v in (("step", step), ("running", running), ("held", held), ("reserved", reserved)):
            self.r.trace[k].append(v)

    def finish(self) -> SimResult:
        r = self.r
        r.waste_frac = 1 - self.held / self.reserved if self.reserved else 0.0
        r.utilisation = self.held / (self.n * r.slots_total) if self.n else 0.0
        r.sharing_saving_frac = 1 - self.held / self.logical if self.logical else 0.0
        r.mean_running = self.running_sum / self.n if self.n else 0.0
        r.mean_running_saturated = self.running_sat_sum / self.n_sat if self.n_sat else r.mean_running
        r.table_entries_per_seq = self.entries / self.running_sum if self.running_sum else 0.0
        return r


def simulate_contiguous(mix: RequestMix, budget_tokens: int, max_len: int, sample_every: int = 1) -> SimResult:
    """Serve ``mix`` first come, first served with one ``max_len`` slab per running request."""
    max_seqs = budget_tokens // max_len
    if max_seqs < 1:
        raise ValueError(f"budget_tokens={budget_tokens} holds no slab of max_len={max_len}")
    cache = ContiguousKVCache(1, 1, 1, max_seqs=max_seqs, max_len=max_len, allocate_pools=False)
    res = SimResult("contiguous", len(mix), 0, max_seqs * max_len)
    sampler = _Sampler(res)
    waiting = list(range(len(mix)))[::-1]  # a stack: pop() is the oldest
    generated: dict[int, int] = {}
    while waiting or generated:
        for rid in list(generated):  # decode: one token each (its slot holds the previous output token)
            cache.append_slots(rid, 1)
        while waiting and cache.num_free_slabs:
            rid = waiting.pop()
            cache.allocate(rid, mix.prompt_lens[rid])
            res.prefill_tokens += mix.prompt_lens[rid]
            generated[rid] = 0
        if res.steps % sample_every == 0:
            held = sum(cache.lens.values())
            sampler.add(res.steps, len(generated), held, len(generated) * max_len, held, bool(waiting))
        res.steps += 1
        for rid in list(generated):
            generated[rid] += 1
            if generated[rid] == mix.output_lens[rid]:
                cache.free(rid)
                del generated[rid]
    return sampler.finish()


def simulate_paged(mix: RequestMix, budget_tokens: int, block_size: int = 16, system_prompt_len: int = 0,
                   enable_prefix_caching: bool = False, max_num_seqs: int = 1 << 30,
                   max_prefill_tokens: int = 1 << 30, watermark: float = 0.01, sample_every: int = 1,
                   seed: int = 0) -> SimResult:
    """Serve ``mix`` with the real ``Scheduler`` on a paged cache of ``budget_tokens // block_size`` blocks.

    With ``system_prompt_len`` every prompt starts with the same ``system_prompt_len`` tokens (counted on top of
    the mix's prompt length), which prefix caching can share. Preemption is by recompute (swapping needs tensors).
    """
    num_blocks = budget_tokens // block_size
    cache = PagedKVCache(1, 1, 1, num_blocks=num_blocks, block_size=block_size,
                         enable_prefix_caching=enable_prefix_caching, allocate_pools=False)
    sched = Scheduler(cache, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens, watermark=watermark)
    g = torch.Generator().manual_seed(seed)
    vocab = 1 << 20  # distinct random ids: requests share nothing but the system prompt
    system = torch.randint(0, vocab, (system_prompt_len,), generator=g).tolist()
    for rid in range(len(mix)):
        user = torch.randint(0, vocab, (mix.prompt_lens[rid],), generator=g).tolist()
        sched.add(Request(rid, system + user, mix.output_lens[rid]))
    name = f"paged (block {block_size}" + (", prefix caching)" if enable_prefix_caching else ")")
    res = SimResult(name, len(mix), 0, num_blocks * block_size)
    sampler = _Sampler(res)
    while sched.has_unfinished:
        batch = sched.schedule()
        if not batch:
            raise RuntimeError("the scheduler found nothing to run with requests unfinished")
        for req in batch:  # a model step would write these tokens' K/V now
            cache.mark_computed(req.request_id, cache.seqs[req.request_id].num_tokens)
        if res.steps % sample_every == 0:
            s = cache.stats()
            entries = sum(len(seq.block_table) for seq in cache.seqs.values())
            sampler.add(res.steps, len(sched.running), s.tokens_held, s.slots_reserved, s.logical_tokens,
                        bool(sched.waiting or sched.swapped), entries)
        res.steps += 1
        sched.finish_step(batch, [(req.request_id * 7919 + len(req.output)) % vocab + vocab for req in batch])
    res.preemptions = sched.stats.preemptions
    res.prefill_tokens = sched.stats.prefill_tokens
    res.prefix_cached_tokens = sched.stats.prefix_cached_tokens
    return sampler.finish()
