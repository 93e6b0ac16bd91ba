"""Schedulers: which sequences run in the next step, and how many of their tokens. One interface (``Scheduler``:
the queues waiting / running / swapped, admission checks, preemption, the step's postprocess, requests leaving
early); the three policies (FIFO, static batches, continuous batching with preemption) are in
``labkit.engine.policies``.

The cache (``PagedKVCache``) is the block manager, working on the sequences: ``allocate`` gives a sequence blocks
for its tokens at admission, ``append_slots`` a slot for its sampled token, and its ``num_computed`` says how far its
K/V are written (``postprocess`` advances it after each step). A step computes a *chunk* of each scheduled sequence;
a sequence samples its next token when the chunk reaches its last token.

Async scheduling (``labkit.engine.async_step``) changes one rule here: a sequence whose pending token is its
``max_tokens``-th is not scheduled again (``_uncomputed``). Speculative decoding (``labkit.engine.speculative``): once
every decoding sequence has its slot, each one that speculates gets up to ``k`` lookahead slots from what is left
(``_add_lookahead``: never a preemption), and ``postprocess`` takes the 1 to ``k + 1`` tokens the step kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from labkit.checks import check_choice, check_int, check_positive_int, check_type
from labkit.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenOutput
from labkit.kvcache import CacheFullError, PagedKVCache, SwapSpace

PREEMPTION_MODES = ("recompute", "swap")
"""What preemption does with a victim's KV: drop and recompute, or swap to host memory."""


@dataclass
class ScheduledBatch:
    """One step's work. Sequences with one new token come first (``num_decode`` of them: they use the decode
    attention kernel), prefill chunks after. ``sample[i]``: the chunk ends at sequence ``i``'s last token, so
    the step yields its next token."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    num_decode: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_tokens[self.num_decode:])


class Scheduler(ABC):
    """The queue (``waiting``), the admitted sequences (``running``, oldest first) and the cache they share.

    ``max_model_len`` bounds prompt + ``max_tokens`` of a request. Requests that could never fit (in the model's
    context, in the whole cache, or in a step's token budget where that is required) are refused when added.
    ``preemption_mode`` ('recompute' or 'swap', with a swap space of ``num_cpu_blocks`` blocks, default as many as
    the cache) says what a preemption does; only the continuous policy ever preempts. The cache's free blocks when
    the scheduler is built are the usable ones. ``num_speculative_tokens``: the engine's ``k`` when it speculates
    (module docstring), ``None`` when it does not (a request asking for ``k > 0`` is then refused).
    ``release_hooks``: functions called with each sequence whose blocks are taken back (it finished, was aborted or
    failed, or was preempted): the speculative proposer frees the draft model's cache of it.
    """

    name = "scheduler"

    def __init__(self, cache: PagedKVCache, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None, num_speculative_tokens: int | None = None):
        check_type("cache", cache, PagedKVCache)
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        check_positive_int("max_model_len", max_model_len, none_ok=True)
        check_positive_int("num_cpu_blocks", num_cpu_blocks, none_ok=True)
        check_choice("preemption_mode", preemption_mode, PREEMPTION_MODES)
        self.num_speculative_tokens = check_int("num_speculative_tokens", num_speculative_tokens, 1, none_ok=True)
        self.release_hooks: list[Callable[[Sequence], None]] = []
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.swap = SwapSpace(cache, num_cpu_blocks or cache.num_blocks) if preemption_mode == "swap" else None
        self.usable_blocks = cache.allocator.num_free
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # preempted by swap, oldest preemption first
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the counters of ``stats()`` (the engine does at the start of each run)."""
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens found in the prefix cache instead of computed
        self.admitted_tokens = 0  # tokens to prefill at admission (prompt, + outputs after a recompute), hits excluded
        self.recomputed_tokens = 0  # of those, tokens prefilled again after a recompute preemption
        self.peak_blocks_used = 0
        self.peak_running = 0
        if self.swap is not None:
            self.swap.blocks_out = self.swap.blocks_in = 0

    # --- queue ----------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence, or refuse it (``ValueError`` / ``CacheFullError`` naming the sizes)."""
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise unless ``seq`` could run: it fits ``max_model_len`` and, at its longest, the whole cache; it asks for
        speculation only from a scheduler that speculates."""
        k = seq.params.num_speculative_tokens
        if k and self.num_speculative_tokens is None:
            raise ValueError(f"request {seq.seq_id}: num_speculative_tokens={k} but the engine does not speculate; "
                             "give it EngineConfig(speculative=SpeculativeConfig(...)) or leave the request's "
                             "num_speculative_tokens None or 0")
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"request {seq.seq_id}: prompt of {seq.num_prompt_tokens} tokens + max_tokens="
                             f"{seq.params.max_tokens} exceeds max_model_len={self.max_model_len}")
        need = self.cache.blocks_for(seq.max_kv_tokens)
        if need > self.usable_blocks:
            raise CacheFullError(f"request {seq.seq_id}: prompt of {seq.num_prompt_tokens} tokens + max_tokens="
                                 f"{seq.params.max_tokens} needs {need} KV blocks of {self.cache.block_size} tokens "
                                 f"but the cache has {self.usable_blocks}: it could never run; give the cache more "
                                 f"blocks or lower max_tokens")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @abstractmethod
    def schedule(self) -> ScheduledBatch:
        """The next step's batch (empty only when nothing is queued or running)."""

    def postprocess(self, batch: ScheduledBatch, tokens: list[int | list[int]], now_s: float) -> list[TokenOutput]:
        """After the step computed ``batch``: each sampling sequence gets its token (``tokens``, in the order of the
        sampling rows; a list of tokens where speculation kept several: they are taken up to the first that
        finishes the request), each sequence's computed count advances by its scheduled tokens (their K/V now exist,
        so full blocks among them become findable by the prefix cache), and finished ones leave ``running`` and free
        their blocks. Returns the streamed tokens."""
        if len(tokens) != sum(batch.sample):
            raise ValueError(f"got {len(tokens)} tokens for {sum(batch.sample)} sampling sequences")
        out, it = [], iter(tokens)
        for seq, n, smp in zip(batch.seqs, batch.num_tokens, batch.sample):
            done, toks = False, next(it) if smp else []
            for tok in toks if isinstance(toks, list) else [toks]:
                done = seq.append_token(tok, now_s)
                out.append(TokenOutput(seq.seq_id, tok, now_s, done))
                if done:
                    break
            self.cache.mark_computed(seq, min(seq.num_computed + n, seq.num_tokens))
            if done:
                self.running.remove(seq)
                self.cache.free(seq)
                self._released(seq)
        return out

    # --- requests leaving early -----------------------------------------------------------------------------
    def finish_early(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take an unfinished ``seq`` out wherever it is (queue, running, swap space), free its blocks and finish
        it with ``reason`` (``ABORT``, or ``ERROR`` with the message ``error``)."""
        self.remove(seq)
        seq.finish(reason, error)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out wherever it is (queue, running, swap space) and free what it holds (``ValueError`` if it
        is in none). Async scheduling removes a sequence this way once its stop shows up one step late: by then it
        may have been preempted into the queue or the swap space."""
        if seq in self.running:
            self.running.remove(seq)
            if seq.block_table:
                self.cache.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap.discard(seq)
        else:
            raise ValueError(f"sequence {seq.seq_id} is not queued, running or swapped out ({seq.status.value})")
        seq.num_lookahead = 0
        self._released(seq)

    def _released(self, seq: Sequence) -> None:
        """``seq``'s blocks were taken back: tell the ``release_hooks``."""
        for hook in self.release_hooks:
            hook(seq)

    def speculative_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` may propose in its next decode step: its request's ``num_speculative_tokens``, else the
        engine's (0 when the engine does not speculate), and never more than it may still emit after the step's own
        token (the last token of a request is always the target's)."""
        k = seq.params.num_speculative_tokens
        k = (self.num_speculative_tokens or 0) if k is None else k
        return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1))

    def _add_lookahead(self, rows: list[tuple[Sequence, int]], budget: int) -> int:
        """Lookahead slots for the decoding rows (one token each, slot reserved) that speculate, oldest first, from
        the free blocks and at most ``budget`` tokens: each gets up to its ``speculative_tokens``, fewer where blocks
        or budget run short (never a preemption). Sets ``seq.num_lookahead``; returns the tokens they took."""
        used = 0
        for seq, n in rows:
            if n != 1 or self._uncomputed(seq) != 1:
                continue
            k = min(self.speculative_tokens(seq), budget - used)
            while k > 0 and not self.cache.can_append(seq, k):
                k -= 1
            if k > 0:
                self.cache.append_slots(seq, k)
            seq.num_lookahead = max(k, 0)
            used += max(k, 0)
        return used

    def abort_all(self) -> list[Sequence]:
        """Abort every unfinished sequence (the cache is left as empty as the scheduler found it)."""
        seqs = [*self.running, *self.waiting, *self.swapped]
        for seq in seqs:
            self.finish_early(seq, FinishReason.ABORT)
        return seqs

    # --- helpers for the policies ---------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        if seq.num_pending:  # its placeholder would be prefilled (and hashed by the prefix cache)
            raise RuntimeError(f"sequence {seq.seq_id} is admitted before its pending token was read")
        cached = self.cache.allocate(seq)
        self.prefix_hit_tokens += cached
        self.admitted_tokens += seq.num_tokens - cached
        if seq.num_preemptions:
            self.recomputed_tokens += seq.num_tokens - cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @staticmethod
    def _uncomputed(seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V are not written yet: one for a decoding sequence (its last sampled token).
        None for a sequence whose last token is its ``max_tokens``-th (under async scheduling it is still pending,
        read one step late): that token is never fed back, so nothing is scheduled for it."""
        return 0 if seq.reached_max_tokens else seq.num_tokens - seq.num_computed

    def _preempt(self, seq: Sequence) -> None:
        """Take ``seq``'s blocks back: swap them out to CPU memory (``preemption_mode='swap'``, while the swap space
        has room), else free them and requeue it first, to be prefilled again; its tokens so far are kept."""
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.num_lookahead = 0
        if self.swap is not None and self.swap.can_swap_out(seq):
            self.swap.swap_out(self.cache, seq)
            self.swapped.appendleft(seq)  # like a requeued one: the last preempted comes back first
        else:
            self.cache.free(seq)
            self.waiting.appendleft(seq)
        self._released(seq)

    def _batch(self, rows: list[tuple[Sequence, int]], preempted: list[Sequence] | None = None) -> ScheduledBatch:
        """Single-token rows first (decode kernel), then the rest; records peaks."""
        rows = [r for r in rows if r[1] == 1] + [r for r in rows if r[1] > 1]
        self.peak_blocks_used = max(self.peak_blocks_used, self.cache.allocator.num_used)
        self.peak_running = max(self.peak_running, len(self.running))
        sample = [s.num_computed + n == s.num_tokens for s, n in rows]
        return ScheduledBatch([s for s, _ in rows], [n for _, n in rows], sample,
                              sum(1 for _, n in rows if n == 1), preempted or [])

    def check_invariants(self, reserved: tuple[int, ...] = ()) -> None:
        """The running sequences' block tables agree with the cache's reference counts (``reserved``: blocks held
        outside any sequence, a CUDA graph's scratch block), the swapped ones' with the swap space's, and the
        waiting ones hold nothing (tests call this after every step)."""
        self.cache.check_invariants(self.running, reserved)
        for seq in self.waiting:
            assert not seq.block_table and seq.num_computed == 0, f"waiting {seq} holds blocks"
        if self.swap is not None:
            held = sorted(b for seq in self.swapped for b in seq.block_table)
            assert held == [b for b, n in enumerate(self.swap.allocator.ref_counts) for _ in range(n)], "swap space"

    def stats(self) -> dict:
        out, back = (self.swap.blocks_out, self.swap.blocks_in) if self.swap is not None else (0, 0)
        return {"scheduler": self.name, "preemption_mode": self.preemption_mode, "preemptions": self.num_preemptions,
                "peak_blocks_used": self.peak_blocks_used, "usable_blocks": self.usable_blocks,
                "peak_running": self.peak_running, "prefix_hit_tokens": self.prefix_hit_tokens,
                "admitted_tokens": self.admitted_tokens, "recomputed_tokens": self.recomputed_tokens,
                "swapped_out_blocks": out, "swapped_in_blocks": back}
