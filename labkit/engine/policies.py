"""The engine's scheduling policies, each a ``labkit.engine.scheduler.Scheduler`` (the queues, admission checks,
preemption, postprocess and speculation's lookahead slots live there; a policy decides only what the next step runs):

* ``FIFOScheduler``: one request at a time, start to finish (the naive server of notebook 00).
* ``StaticBatchScheduler``: when idle, take up to ``batch_size`` waiting requests whose worst case (prompt +
  ``max_tokens``) fits in the free cache, and run that batch until its longest request ends; nobody joins a
  running batch. Finished members stop computing (that is generous: HF ``generate`` keeps decoding padding).
* ``ContinuousBatchingScheduler`` (Orca's iteration-level scheduling, vLLM's policy): every step, first one
  decode token for each running sequence, then prefill chunks up to a token budget (Sarathi-Serve's chunked
  prefill: a long prompt no longer stalls everyone's next token), then new requests while the budget, the
  sequence cap and the free blocks allow. Blocks are allocated as sequences grow; when a decode needs a block and
  none is free, the youngest running sequence (the least work to lose, vLLM's choice) is *preempted*:

  * ``preemption_mode='recompute'``: its blocks are freed and it goes back to the head of the queue, to be
    prefilled again (prompt + its outputs so far) when blocks return (cheaper with prefix caching: its freed
    blocks may still be cached);
  * ``preemption_mode='swap'``: its blocks are copied to CPU memory (``labkit.kvcache.SwapSpace``) and freed;
    swapped sequences come back (the last preempted first, as requeued ones) before any new request is admitted,
    into fresh blocks holding the same bytes, so nothing is recomputed (the price is the copies both ways). When
    the swap space is full the victim is recomputed instead.

  Nothing is dropped and no cache entry is overwritten while its owner runs; a request that could not fit even
  in the empty cache is refused when added (``CacheFullError``).
"""

from __future__ import annotations

from labkit.checks import check_bool, check_choice, check_int, check_number, check_positive_int
from labkit.engine.scheduler import PREEMPTION_MODES, ScheduledBatch, Scheduler
from labkit.engine.sequence import Sequence, SequenceStatus
from labkit.kvcache import PagedKVCache

SCHEDULERS = ("fifo", "static", "continuous")
"""Scheduling policies of the engine."""


class FIFOScheduler(Scheduler):
    """One request at a time: prefill its whole prompt, decode it to the end, then take the next."""

    name = "fifo"

    def schedule(self) -> ScheduledBatch:
        if not self.running and self.waiting:
            self._admit(self.waiting.popleft())  # the cache is empty but for it: add() checked that it fits
        if not self.running:
            return ScheduledBatch()
        seq = self.running[0]
        if not self._uncomputed(seq):  # its last token is pending (async scheduling): nothing to compute
            return ScheduledBatch()
        self.cache.append_slots(seq)  # a slot for its sampled token (nothing while it prefills)
        rows = [(seq, self._uncomputed(seq))]
        self._add_lookahead(rows, self.max_num_batched_tokens - 1)
        return self._batch(rows)


class StaticBatchScheduler(Scheduler):
    """Batches of up to ``batch_size`` requests that run until the longest one ends (module docstring): each
    reserves memory for its worst case as HF's static cache does, so it never needs preemption."""

    name = "static"

    def __init__(self, cache: PagedKVCache, batch_size: int = 8, max_model_len: int | None = None,
                 num_speculative_tokens: int | None = None):
        check_positive_int("batch_size", batch_size)
        super().__init__(cache, max_num_seqs=batch_size, max_model_len=max_model_len,
                         num_speculative_tokens=num_speculative_tokens)
        self.batch_size = batch_size

    def schedule(self) -> ScheduledBatch:
        if not self.running:
            self._form_batch()
        rows = []
        for seq in self.running:
            if self._uncomputed(seq):  # not one whose last token is pending (async scheduling)
                self.cache.append_slots(seq)
                rows.append((seq, self._uncomputed(seq)))
        self._add_lookahead(rows, self.max_num_batched_tokens - len(rows))
        return self._batch(rows)

    def _form_batch(self) -> None:
        worst, free = 0, self.cache.allocator.num_free
        while self.waiting and len(self.running) < self.batch_size:
            need = self.cache.blocks_for(self.waiting[0].max_kv_tokens)
            if worst + need > free:
                break
            worst += need
            self._admit(self.waiting.popleft())


class ContinuousBatchingScheduler(Scheduler):
    """Iteration-level admission and retirement with a token budget, chunked prefill, decode first, and
    preemption by recompute or swap (see the module docstring).

    ``max_num_batched_tokens``: tokens computed per step at most (decode tokens count one each).
    ``chunked_prefill=False``: a prompt is prefilled in one step, so prompt + ``max_tokens`` must fit the budget
    (a preempted request is prefilled again with its outputs).
    ``min_admit``: while sequences are decoding, admit waiting requests only once this many can start together
    (or all that wait, if fewer). A step that carries a prefill costs more than a decode step (its chunk's
    compute, and padding up to a captured token count; run eagerly, where no graph is captured, several times a
    replayed step), so grouping admissions trades a little time to first token for fewer such steps (vLLM's
    ``scheduler_delay_factor`` makes the same trade by time). ``1`` admits at once.
    ``watermark``: while others run, admit (or swap in) a sequence only if this fraction of the blocks stays free
    after it: headroom for the running ones to grow, so an admission does not force a preemption at once (vLLM
    keeps 1%; the engine's default 0 admits whatever fits).
    """

    name = "continuous"

    def __init__(self, cache: PagedKVCache, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 chunked_prefill: bool = True, max_model_len: int | None = None, min_admit: int = 1,
                 preemption_mode: str = "recompute", num_cpu_blocks: int | None = None, watermark: float = 0.0,
                 num_speculative_tokens: int | None = None):
        super().__init__(cache, max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode, num_cpu_blocks,
                         num_speculative_tokens)
        self.watermark_blocks = int(check_number("watermark", watermark, 0, 1, high_open=True) * cache.num_blocks)
        check_bool("chunked_prefill", chunked_prefill)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs="
                             f"{max_num_seqs}: every running sequence needs a decode token each step")
        check_int("min_admit", min_admit, 1, max_num_seqs + 1)
        self.chunked_prefill = chunked_prefill
        self.min_admit = min_admit

    def check(self, seq: Sequence) -> None:
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if not self.chunked_prefill and total > self.max_num_batched_tokens:
            raise ValueError(f"request {seq.seq_id}: prompt of {seq.num_prompt_tokens} tokens + max_tokens="
                             f"{seq.params.max_tokens} exceeds max_num_batched_tokens={self.max_num_batched_tokens}"
                             f" and chunked_prefill is off; raise the budget or turn chunked_prefill on")
        super().check(seq)

    def schedule(self) -> ScheduledBatch:
        rows, preempted = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(rows)
        budget -= self._add_lookahead(rows, budget)
        decoding = {s.seq_id for s, _ in rows}
        for seq in self.running:  # prefills already under way (chunked), oldest first
            if budget and seq.seq_id not in decoding and self._uncomputed(seq) > 0:
                n = self._chunk(self._uncomputed(seq), budget)
                if n:
                    rows.append((seq, n))
                    budget -= n
        if not preempted:  # after a preemption blocks are short: bring nobody in
            swapped_in = self._swap_in(budget)
            rows += swapped_in
            budget -= sum(n for _, n in swapped_in)
            if not self.swapped and self._admission_due(bool(rows)):  # the swapped ones first
                rows += self._admit_waiting(budget)
        return self._batch(rows, preempted)

    def _fits(self, blocks: int) -> bool:
        """Whether ``blocks`` more blocks can be taken now, keeping the watermark while others run (alone, any
        request fits: ``check`` refused the others)."""
        return blocks + (self.watermark_blocks if self.running else 0) <= self.cache.allocator.num_free

    def _swap_in(self, budget: int) -> list[tuple[Sequence, int]]:
        """Swapped sequences back into fresh blocks while blocks, sequence slots and the budget allow; each
        continues where it stopped (its next decode token, or the rest of its prompt)."""
        rows = []
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self._fits(self.cache.blocks_for(seq.num_tokens)):  # its blocks and its pending token's
                break
            self.swapped.popleft()
            self.swap.swap_in(self.cache, seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.cache.append_slots(seq)  # its pending token's slot, if it was decoding
            n = self._chunk(self._uncomputed(seq), budget)
            if n:
                rows.append((seq, n))
                budget -= n
        return rows

    def _admission_due(self, busy: bool) -> bool:
        """Admit now: nothing else would run, or ``min_admit`` requests (all that wait, if fewer) can start."""
        free = self.max_num_seqs - len(self.running)
        return not busy or free >= min(self.min_admit, len(self.waiting))

    def _chunk(self, uncomputed: int, budget: int) -> int:
        if self.chunked_prefill:
            return min(uncomputed, budget)
        return uncomputed if uncomputed <= budget else 0

    def _schedule_decodes(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """A slot and one token for each sequence with one token to compute (a decoding one: its sampled token),
        oldest first; preempt the youngest while short."""
        rows, preempted = [], []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or self._uncomputed(seq) != 1:
                continue  # preempted below, or prefilling
            while not self.cache.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.cache.append_slots(seq)
                rows.append((seq, 1))
        return rows, preempted

    def _admit_waiting(self, budget: int) -> list[tuple[Sequence, int]]:
        rows = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.chunked_prefill and seq.num_tokens > budget:
                break
            if not self._fits(self.cache.blocks_needed(seq)):
                break
            self._admit(self.waiting.popleft())
            n = self._chunk(self._uncomputed(seq), budget)
            rows.append((seq, n))
            budget -= n
        return rows


def make_scheduler(name: str, cache: PagedKVCache, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                   chunked_prefill: bool = True, static_batch_size: int | None = None,
                   max_model_len: int | None = None, min_admit: int = 1, preemption_mode: str = "recompute",
                   num_cpu_blocks: int | None = None, watermark: float = 0.0,
                   num_speculative_tokens: int | None = None) -> Scheduler:
    """A scheduler by name: 'fifo', 'static' (batches of ``static_batch_size``, default ``max_num_seqs``) or
    'continuous' (the one that preempts, by ``preemption_mode``; the others never need to). Each gives speculating
    decodes lookahead slots when ``num_speculative_tokens`` is set (module docstring)."""
    check_choice("preemption_mode", preemption_mode, PREEMPTION_MODES)
    k = num_speculative_tokens
    if name == "fifo":
        return FIFOScheduler(cache, max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, num_speculative_tokens=k)
    if name == "static":
        return StaticBatchScheduler(cache, max_num_seqs if static_batch_size is None else static_batch_size,
                                    max_model_len=max_model_len, num_speculative_tokens=k)
    if name == "continuous":
        return ContinuousBatchingScheduler(cache, max_num_seqs, max_num_batched_tokens, chunked_prefill,
                                           max_model_len, min_admit, preemption_mode, num_cpu_blocks, watermark, k)
    raise ValueError(f"scheduler={name!r} is unknown; allowed: {SCHEDULERS}")
