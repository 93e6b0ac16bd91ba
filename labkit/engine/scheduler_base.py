"""The scheduler's interface and bookkeeping shared by its policies (``labkit.engine.scheduler``): the queues
(waiting, running, swapped), admission checks, preemption, the step's postprocess (the computed counts advance, the
sampled tokens are appended) and taking a request out early (an abort, or a step that failed on it) with its blocks
freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from labkit.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenOutput
from labkit.kvcache import CacheFullError, PagedKVCache, SwapSpace

SCHEDULERS = ("fifo", "static", "continuous")
"""Scheduling policies of the engine."""
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
    the scheduler is built are the usable ones.
    """

    name = "scheduler"

    def __init__(self, cache: PagedKVCache, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        for arg, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                       ("max_model_len", max_model_len), ("num_cpu_blocks", num_cpu_blocks)):
            if (v is not None or arg.startswith("max_num")) and (not isinstance(v, int) or isinstance(v, bool)
                                                                  or v < 1):
                raise ValueError(f"{arg}={v!r} must be a positive int" + ("" if arg.startswith("max_num")
                                                                          else " or None"))
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={preemption_mode!r} is unknown; allowed: {PREEMPTION_MODES}")
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
        """Raise unless ``seq`` could run: it fits ``max_model_len`` and, at its longest, the whole cache."""
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

    def postprocess(self, batch: ScheduledBatch, tokens: list[int], now_s: float) -> list[TokenOutput]:
        """After the step computed ``batch``: each sequence's computed count advances by its scheduled tokens (their
        K/V now exist, so full blocks among them become findable by the prefix cache), each sampling sequence gets
        its token (``tokens``, in the order of the sampling rows), and finished ones leave ``running`` and free
        their blocks. Returns the streamed tokens."""
        sampling = [s for s, smp in zip(batch.seqs, batch.sample) if smp]
        if len(tokens) != len(sampling):
            raise ValueError(f"got {len(tokens)} tokens for {len(sampling)} sampling sequences")
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.cache.mark_computed(seq, seq.num_computed + n)
        out = []
        for seq, tok in zip(sampling, tokens):
            done = seq.append_token(tok, now_s)
            if done:
                self.running.remove(seq)
                self.cache.free(seq)
            out.append(TokenOutput(seq.seq_id, tok, now_s, done))
        return out

    # --- requests leaving early -----------------------------------------------------------------------------
    def find(self, seq_id: Hashable) -> Sequence | None:
        """The unfinished sequence ``seq_id`` (waiting, running or swapped out), or ``None``."""
        for q in (self.running, self.waiting, self.swapped):
            for seq in q:
                if seq.seq_id == seq_id:
                    return seq
        return None

    def finish_early(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take an unfinished ``seq`` out wherever it is (queue, running, swap space), free its blocks and finish
        it with ``reason`` (``ABORT``, or ``ERROR`` with the message ``error``)."""
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
        seq.finish(reason, error)

    def abort_all(self) -> list[Sequence]:
        """Abort every unfinished sequence (the cache is left as empty as the scheduler found it)."""
        seqs = [*self.running, *self.waiting, *self.swapped]
        for seq in seqs:
            self.finish_early(seq, FinishReason.ABORT)
        return seqs

    # --- helpers for the policies ---------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        cached = self.cache.allocate(seq)
        self.prefix_hit_tokens += cached
        self.admitted_tokens += seq.num_tokens - cached
        if seq.num_preemptions:
            self.recomputed_tokens += seq.num_tokens - cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @staticmethod
    def _uncomputed(seq: Sequence) -> int:
        """Tokens of ``seq`` whose K/V are not written yet: one for a decoding sequence (its last sampled token)."""
        return seq.num_tokens - seq.num_computed

    def _preempt(self, seq: Sequence) -> None:
        """Take ``seq``'s blocks back: swap them out to CPU memory (``preemption_mode='swap'``, while the swap space
        has room), else free them and requeue it first, to be prefilled again; its tokens so far are kept."""
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.swap is not None and self.swap.can_swap_out(seq):
            self.swap.swap_out(self.cache, seq)
            self.swapped.appendleft(seq)  # like a requeued one: the last preempted comes back first
        else:
            self.cache.free(seq)
            self.waiting.appendleft(seq)

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
