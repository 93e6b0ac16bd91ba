"""BlockAllocator: free queue, reference counts, LRU reuse, prefix-hash registry; property tests of
invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError


def test_allocate_free_roundtrip():
    a = BlockAllocator(5)
    blocks = a.allocate(3)
    assert len(set(blocks)) == 3 and a.num_free == 2 and a.num_used == 3
    assert all(a.ref_counts[b] == 1 for b in blocks)
    for b in blocks:
        a.free(b)
    assert a.num_free == 5
    a.check_invariants()


def test_all_or_nothing_when_full():
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(CacheFullError, match="asked for 2 KV blocks but only 1 of 4 are free"):
        a.allocate(2)
    assert a.num_free == 1
    a.check_invariants()


def test_shared_block_returns_only_after_last_reference():
    a = BlockAllocator(3)
    (b,) = a.allocate(1)
    a.incref(b)
    a.free(b)
    assert a.ref_counts[b] == 1 and a.num_free == 2
    a.free(b)
    assert a.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="only a block in use can be shared"):
        a.incref(b)


def test_freed_blocks_are_reused_least_recently_freed_first():
    a = BlockAllocator(4)
    blocks = a.allocate(4)
    for b in (blocks[2], blocks[0], blocks[3]):
        a.free(b)
    assert a.allocate(3) == [blocks[2], blocks[0], blocks[3]]


def test_hash_registry_hit_and_lru_eviction():
    a = BlockAllocator(3)
    b0, b1, b2 = a.allocate(3)
    a.register_hash(b0, b"h0")
    a.register_hash(b1, b"h1")
    a.free(b0)
    a.free(b1)  # b0 freed first: evicted first
    assert a.lookup(b"h0") == b0 and a.num_cached_free == 2
    a.take_cached(b1)  # a hit pulls a cached free block back into use
    assert a.ref_counts[b1] == 1 and a.num_free == 1
    (b,) = a.allocate(1)
    assert b == b0 and a.lookup(b"h0") is None and a.num_evictions == 1
    assert a.lookup(b"h1") == b1
    a.check_invariants()
    a.free(b2)
    with pytest.raises(ValueError, match="holds no cached prefix block"):
        a.take_cached(b2)


def test_duplicate_hash_keeps_the_first_block():
    a = BlockAllocator(2)
    b0, b1 = a.allocate(2)
    a.register_hash(b0, b"same")
    a.register_hash(b1, b"same")
    assert a.lookup(b"same") == b0 and b1 not in a.block_hash
    a.check_invariants()


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8"])
def test_bad_num_blocks(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)


def test_bad_block_ids():
    a = BlockAllocator(2)
    for bad in (-1, 2, "0"):
        with pytest.raises(ValueError, match="allowed: 0 .. 1"):
            a.free(bad)
    with pytest.raises(ValueError, match="n=-1"):
        a.allocate(-1)
    with pytest.raises(ValueError, match="is free"):
        a.register_hash(0, b"x")


ops = st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free", "hash", "hit"]), st.integers(0, 10**6)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=ops)
def test_random_operations_keep_invariants(num_blocks, ops):
    """Reference counts match the references handed out; no block is held twice; all come back at the end."""
    a = BlockAllocator(num_blocks)
    held: list[int] = []  # one entry per reference we hold
    for op, r in ops:
        if op == "alloc":
            n = r % 4
            if n > a.num_free:
                with pytest.raises(CacheFullError):
                    a.allocate(n)
            else:
                new = a.allocate(n)
                assert not set(new) & set(held), "a block in use was handed out again"
                held += new
        elif op == "incref" and held:
            b = held[r % len(held)]
            a.incref(b)
            held.append(b)
        elif op == "free" and held:
            a.free(held.pop(r % len(held)))
        elif op == "hash" and held:
            a.register_hash(held[r % len(held)], str(r % 7).encode())
        elif op == "hit":
            b = a.lookup(str(r % 7).encode())
            if b is not None:
                a.take_cached(b)
                held.append(b)
        a.check_invariants()
        assert [held.count(b) for b in range(num_blocks)] == a.ref_counts
    for b in held:
        a.free(b)
    assert a.num_free == num_blocks
    a.check_invariants()


def test_a_block_freed_to_be_reused_first_is_taken_before_a_cached_one():
    a = BlockAllocator(3)
    b0, b1, b2 = a.allocate(3)
    a.register_hash(b0, b"prefix")
    a.free(b0)  # cached, at the head of the queue: the next allocation would evict it
    a.free(b1, reuse_first=True)  # a rolled-back block: nothing to keep, taken first
    assert a.allocate(1) == [b1] and a.lookup(b"prefix") == b0
    a.free(b2, reuse_first=True)
    a.register_hash(a.allocate(1)[0], b"other")  # b2 again
    a.check_invariants()
