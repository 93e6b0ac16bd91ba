"""A pool of fixed-size KV blocks: a free queue, reference counts and the prefix-hash registry.

The allocator hands out block *ids*; it never touches K/V data (``PagedKVCache`` owns the tensors). One block
holds ``block_size`` tokens of every layer, so a block id is the same across layers.

Free blocks wait in a least-recently-used queue, as in vLLM's ``BlockPool``: a block returns to the *tail* of
the queue when its last reference is dropped, and ``allocate`` takes from the *head*. A freed block that holds
a full, hashed prefix block keeps its hash while it waits, so a later request with the same prefix can take it
back (a prefix-cache hit, ``take_cached``) until ``allocate`` reaches it and evicts the hash. LRU eviction
therefore costs nothing extra: the oldest freed cached block is the first to be reused.
"""

from __future__ import annotations

from collections import OrderedDict

from labkit.checks import check_int, check_positive_int


class CacheFullError(RuntimeError):
    """The KV cache has too few free blocks (or slots) for a request; the message gives both numbers."""


class BlockAllocator:
    """Block ids ``0 .. num_blocks-1`` with reference counts.

    Invariants (``check_invariants``): a block is either free (reference count 0, in the free queue exactly
    once) or in use (count >= 1, not in the queue); every hash maps to exactly one block and back.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.ref_counts = [0] * num_blocks
        # the free queue; its head is the least recently freed block
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: dict[int, bytes] = {}
        self.hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0  # cached blocks whose contents were dropped to make room

    # --- counts ---------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no reference (including cached ones waiting for a hit)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a hashed prefix block (reusable by a hit until evicted)."""
        return sum(1 for b in self.block_hash if self.ref_counts[b] == 0)

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block={block!r} is not a block id; allowed: 0 .. {self.num_blocks - 1}")

    # --- allocate / share / free ----------------------------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (all or none), evicting the hashes of any cached blocks among them."""
        check_int("n", n, 0)
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} KV blocks but only {len(self._free)} of {self.num_blocks} "
                                 f"are free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, block: int) -> None:
        """Share an in-use block with one more sequence (fork)."""
        self._check_id(block)
        if self.ref_counts[block] < 1:
            raise ValueError(f"block={block} is free; only a block in use can be shared")
        self.ref_counts[block] += 1

    def free(self, block: int, reuse_first: bool = False) -> None:
        """Drop one reference; the last one returns the block to the tail of the free queue (hash kept), or with
        ``reuse_first`` (a block holding nothing worth keeping: speculative decoding's rejected slots) and no hash
        to its head, to be taken again before any cached block is evicted."""
        self._check_id(block)
        if self.ref_counts[block] < 1:
            raise ValueError(f"block={block} is already free (double free)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if reuse_first and block not in self.block_hash:
                self._free.move_to_end(block, last=False)

    # --- prefix-hash registry -------------------------------------------------------------------------------
    def register_hash(self, block: int, block_hash: bytes) -> None:
        """Record that in-use ``block`` holds the full prefix block ``block_hash``.

        If another block already holds that hash, the first one stays the canonical copy (both hold the same
        tokens; this one simply is not findable).
        """
        self._check_id(block)
        if self.ref_counts[block] < 1:
            raise ValueError(f"block={block} is free; register a hash only on a block in use")
        if block_hash in self.hash_to_block or block in self.block_hash:
            return
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``, in use or free-but-not-yet-evicted; ``None`` on a miss."""
        return self.hash_to_block.get(block_hash)

    def take_cached(self, block: int) -> None:
        """Take a reference to a block found by ``lookup`` (a hit), pulling it off the free queue if
        needed."""
        self._check_id(block)
        if block not in self.block_hash:
            raise ValueError(f"block={block} holds no cached prefix block")
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _evict(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.hash_to_block[h]
            self.num_evictions += 1

    # --- checks ---------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (used by the tests after every
        step)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has reference count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: reference count {rc} but free={b in free}"
        assert len(self.block_hash) == len(self.hash_to_block), "hash maps differ in size"
        for b, h in self.block_hash.items():
            assert self.hash_to_block[h] == b, f"block {b}'s hash maps to block {self.hash_to_block[h]}"
