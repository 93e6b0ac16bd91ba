"""The block manager (nano-vllm's ``BlockManager``, with vLLM's prefix caching and copy on write). It keeps no
sequences: a sequence owns its token ids, block table, computed count and prefix-block hashes (``KVSequence``:
``engine.Sequence``, or ``SeqBlocks`` to use the cache alone), and ``allocate`` / ``append_slots`` (a block at a time:
only a last block's tail is reserved but empty) / ``mark_computed`` / ``fork`` / ``rollback`` / ``free`` work on it.
Full blocks become findable by the prefix cache when ``mark_computed`` says their K/V exist, never before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from labkit.checks import check_attrs, check_bool, check_int, check_positive_int, check_token_ids
from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError
from labkit.kvcache.prefix import block_hashes, hash_block


class KVSequence(Protocol):
    """What the block manager needs of a sequence (``engine.Sequence`` and ``SeqBlocks`` have it): ``seq_id`` (for
    messages); ``token_ids`` (a list of int: read for prefix hashes and a step's input ids only; a pipeline stage's
    sequence, whose inputs are hidden states, holds none) and ``num_tokens``; and what the manager sets:
    ``block_table`` (its blocks; the swap space's while swapped out), ``num_computed`` (its first tokens whose K/V
    are written) and ``block_hashes`` (chained hashes of its first computed full blocks, with prefix caching)."""

    seq_id: Hashable
    token_ids: list[int]
    block_table: list[int]
    num_computed: int
    block_hashes: list[bytes]

    @property
    def num_tokens(self) -> int: ...


SEQ_ATTRS = ("seq_id", "token_ids", "block_table", "num_computed", "block_hashes", "num_tokens")
"""What ``check_seq`` asks of a sequence (``KVSequence``'s members)."""


def check_seq(seq, name: str = "seq") -> KVSequence:
    """``seq`` if it has what a ``KVSequence`` has, else an ``ArgumentTypeError`` naming ``name``."""
    return check_attrs(name, seq, SEQ_ATTRS, "a sequence the block manager keeps blocks on (engine.Sequence or "
                       "kvcache.SeqBlocks)")


@dataclass(eq=False)
class SeqBlocks:
    """A sequence for using the cache alone (tests, notebook 02, the speculative decoder and its draft model): its
    token ids (a list of ints >= 0 of its own, copied from ``token_ids``; none for a pipeline stage's rows) and what
    the block manager keeps on it."""

    token_ids: list[int]
    seq_id: Hashable = None
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        # a list of its own: appending to it must not change the caller's
        self.token_ids = check_token_ids("token_ids", self.token_ids, allow_empty=True)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Blocks ``0 .. num_blocks-1`` of ``block_size`` tokens handed to sequences (module docstring). ``copy_block``
    (copy on write) copies nothing here; ``PagedKVCache`` copies the block's K/V."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        self.enable_prefix_caching = check_bool("enable_prefix_caching", enable_prefix_caching)
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return _cdiv(check_int("num_tokens", num_tokens, 0), self.block_size)

    def num_slots(self, seq: KVSequence) -> int:
        """Tokens of ``seq`` that have a slot (all but those appended since its last ``allocate`` /
        ``append_slots``)."""
        return min(seq.num_tokens, len(seq.block_table) * self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's contents (copy on write); the block manager alone holds none."""

    # --- admission ------------------------------------------------------------------------------------------
    def _prefix_hits(self, seq: KVSequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks for the longest cached prefix of ``seq``'s tokens, and their hashes.

        Only blocks inside the first ``num_tokens - 1`` tokens count: the last prompt token is always computed,
        because its logits are what the step is for (vLLM does the same)."""
        if not self.enable_prefix_caching:
            return [], []
        hits, hashes = [], []
        for h in block_hashes(seq.token_ids[:seq.num_tokens - 1], self.block_size):
            block = self.allocator.lookup(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
        return hits, hashes

    def _blocks_to_allocate(self, seq: KVSequence) -> tuple[list[int], list[bytes], int]:
        check_seq(seq)
        hits, hashes = self._prefix_hits(seq)
        new = self.blocks_for(seq.num_tokens) - len(hits)
        # A hit on a free (cached, unreferenced) block takes it off the free queue too.
        from_free = new + sum(1 for b in hits if self.allocator.ref_counts[b] == 0)
        return hits, hashes, from_free

    def blocks_needed(self, seq: KVSequence) -> int:
        """Free blocks ``allocate(seq)`` would take now (prefix hits on cached free blocks count)."""
        return self._blocks_to_allocate(seq)[2]

    def allocate(self, seq: KVSequence) -> int:
        """Blocks for every token of ``seq``, which holds none, all or none; sets its ``block_table``,
        ``block_hashes`` and ``num_computed`` (the tokens found in the prefix cache, a multiple of ``block_size``)
        and returns the last. ``CacheFullError`` when too few blocks are free (nothing changes); ``ValueError`` /
        ``TypeError`` on a bad sequence (not one, no token, token ids not ints, blocks held)."""
        if check_seq(seq).block_table:
            raise ValueError(f"sequence {seq.seq_id!r} already holds {len(seq.block_table)} blocks; free it first")
        n = seq.num_tokens
        if n < 1:
            raise ValueError(f"sequence {seq.seq_id!r} holds no token; allocate needs at least one")
        bad = next((i for i, t in enumerate(seq.token_ids) if type(t) is not int), None)
        if bad is not None:
            t = seq.token_ids[bad]
            raise TypeError(f"sequence {seq.seq_id!r}: token_ids[{bad}]={t!r} is a {type(t).__name__}; token ids "
                            f"must be ints")
        need = self.blocks_for(n)
        if need > self.num_blocks:
            raise CacheFullError(f"sequence {seq.seq_id!r} of {n} tokens needs {need} blocks of {self.block_size} "
                                 f"but the whole cache has {self.num_blocks}: it can never fit")
        hits, hashes, from_free = self._blocks_to_allocate(seq)
        if from_free > self.allocator.num_free:
            raise CacheFullError(f"sequence {seq.seq_id!r} needs {from_free} free blocks, "
                                 f"{self.allocator.num_free} of {self.num_blocks} are free")
        for b in hits:
            self.allocator.take_cached(b)
        seq.block_table = hits + self.allocator.allocate(need - len(hits))
        seq.block_hashes = hashes
        seq.num_computed = len(hits) * self.block_size
        return seq.num_computed

    # --- growth ---------------------------------------------------------------------------------------------
    def _append_cost(self, seq: KVSequence, lookahead: int = 0) -> tuple[int, list[int]]:
        """New blocks ``append_slots(seq, lookahead)`` takes, and the indices of the shared blocks it copies: those
        its uncomputed tokens will be written into."""
        check_int("lookahead", lookahead, 0)  # slots past the sequence's tokens
        try:  # every step: the check costs nothing unless the attributes are missing
            table, bs, n = seq.block_table, self.block_size, seq.num_tokens + lookahead
        except AttributeError:
            check_seq(seq)
            raise
        new = max(0, _cdiv(n, bs) - len(table))
        if n <= seq.num_computed:
            return new, []
        refs = self.allocator.ref_counts
        return new, [j for j in range(seq.num_computed // bs, min(len(table), _cdiv(n, bs))) if refs[table[j]] > 1]

    def can_append(self, seq: KVSequence, lookahead: int = 0) -> bool:
        """Whether ``append_slots(seq, lookahead)`` would succeed now."""
        new, cow = self._append_cost(seq, lookahead)
        return not (new or cow) or new + len(cow) <= self.allocator.num_free

    def append_slots(self, seq: KVSequence, lookahead: int = 0) -> None:
        """Slots for every token of ``seq`` (those appended since the last call) and ``lookahead`` more past them
        (vLLM's lookahead slots: speculative decoding's proposals, appended before the step computes them; cut by
        ``rollback`` to what is kept), all or nothing (``CacheFullError``); a shared block its uncomputed tokens
        will be written into (a partly filled last block after ``fork``) is first copied to a private block: copy
        on write, so the other sequences keep their tokens."""
        new, cow = self._append_cost(seq, lookahead)
        if not (new or cow):
            return
        if new + len(cow) > self.allocator.num_free:
            raise CacheFullError(f"sequence {seq.seq_id!r} needs {new + len(cow)} more blocks, "
                                 f"{self.allocator.num_free} of {self.num_blocks} are free")
        table = seq.block_table
        for j in cow:
            (private,) = self.allocator.allocate(1)
            self.copy_block(table[j], private)
            self.allocator.free(table[j])
            table[j] = private
        table += self.allocator.allocate(new)

    def slots(self, seq: KVSequence, start: int, end: int) -> list[int]:
        """Slots of ``seq``'s tokens ``start .. end-1`` (reserved: within its blocks)."""
        check_int("start", start, 0)
        check_int("end", end, 0)
        if not start <= end <= self.num_slots(check_seq(seq)):
            raise ValueError(f"token range [{start}, {end}) is outside sequence {seq.seq_id!r}'s "
                             f"{self.num_slots(seq)} reserved slots")
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def mark_computed(self, seq: KVSequence, num_computed: int) -> None:
        """Record that K/V of ``seq``'s first ``num_computed`` tokens are written; full blocks among them become
        findable by the prefix cache (their chained hashes go to ``seq.block_hashes`` and the allocator)."""
        check_int("num_computed", num_computed)
        if not check_seq(seq).num_computed <= num_computed <= self.num_slots(seq):
            raise ValueError(f"num_computed={num_computed!r} must be an int in [{seq.num_computed}, "
                             f"{self.num_slots(seq)}] for sequence {seq.seq_id!r} (computed so far, reserved slots)")
        seq.num_computed = num_computed
        if self.enable_prefix_caching:
            self._register(seq)

    def _register(self, seq: KVSequence) -> None:
        bs, hashes = self.block_size, seq.block_hashes
        for j in range(len(hashes), seq.num_computed // bs):
            hashes.append(hash_block(seq.token_ids[j * bs:(j + 1) * bs], hashes[-1] if hashes else None))
            self.allocator.register_hash(seq.block_table[j], hashes[-1])

    # --- sharing and release --------------------------------------------------------------------------------
    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        """``child`` (holding no blocks, and the parent's tokens: a copy of them) shares every block of ``parent``
        (no copy until one of them appends into a shared partly filled block)."""
        check_seq(parent, "parent")
        if check_seq(child, "child").block_table:
            raise ValueError(f"child {child.seq_id!r} already holds {len(child.block_table)} blocks")
        if list(child.token_ids) != list(parent.token_ids):
            raise ValueError(f"child {child.seq_id!r} must hold the tokens of parent {parent.seq_id!r} (a copy of "
                             f"them): its blocks hold their K/V")
        for b in parent.block_table:
            self.allocator.incref(b)
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: KVSequence) -> None:
        """Release ``seq``'s blocks (it then holds none, and nothing computed). Tail blocks are released first, so
        when cached blocks are evicted, a prefix's later blocks go before its earlier ones (those are likelier to be
        shared)."""
        if not check_seq(seq).block_table:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks (freed already?)")
        for b in reversed(seq.block_table):
            self.allocator.free(b)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def rollback(self, seq: KVSequence, num_tokens: int) -> None:
        """Cut ``seq`` back to its first ``num_tokens`` tokens (speculative decoding's rejected ones): token ids,
        blocks past them (to the head of the free queue: taken again before a cached block is evicted), computed
        count. Their K/V stay in the pool, unreachable; tokens in the prefix cache cannot be cut (``ValueError``)."""
        hashed = len(check_seq(seq).block_hashes) * self.block_size
        if not max(1, hashed) <= check_int("num_tokens", num_tokens) <= seq.num_tokens:
            raise ValueError(f"num_tokens={num_tokens!r} must be an int in [{max(1, hashed)}, {seq.num_tokens}] for "
                             f"sequence {seq.seq_id!r} (its first {hashed} tokens are in the prefix cache)")
        keep = self.blocks_for(num_tokens)
        for b in seq.block_table[keep:]:  # nothing in them to keep: the next allocation takes them first
            self.allocator.free(b, reuse_first=True)
        del seq.block_table[keep:]
        del seq.token_ids[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens)

    def check_invariants(self, seqs: Iterable[KVSequence], reserved: Iterable[int] = ()) -> None:
        """The block tables of ``seqs`` (every sequence holding blocks) and the ``reserved`` blocks held outside any
        (a CUDA graph's scratch block) agree with the allocator's reference counts; each table covers the
        sequence's computed tokens and no more than its tokens (tests call this after every operation)."""
        self.allocator.check_invariants()
        refs = [0] * self.num_blocks
        for b in reserved:
            refs[b] += 1
        for seq in seqs:
            sid, table = seq.seq_id, seq.block_table
            assert 0 <= seq.num_computed <= seq.num_tokens, f"seq {sid!r}: num_computed {seq.num_computed}"
            assert self.blocks_for(seq.num_computed) <= len(table) <= self.blocks_for(seq.num_tokens), \
                f"seq {sid!r}: {len(table)} blocks for {seq.num_tokens} tokens, {seq.num_computed} computed"
            assert len(seq.block_hashes) <= seq.num_computed // self.block_size, f"seq {sid!r}: hashes"
            assert len(set(table)) == len(table), f"seq {sid!r} holds a block twice"
            for b in table:
                refs[b] += 1
        assert refs == self.allocator.ref_counts, "reference counts differ from the block tables"
