"""PagedKVCache and its block manager, on ``SeqBlocks`` sequences (each owns its tokens, block table and computed
count): block tables, slots, copy on write, prefix hits, cache-full and bad input, metrics; a hypothesis test of
random allocate / append / fork / free / rollback sequences checks every sequence reads back exactly the K/V written
for it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kvcache import CacheFullError, PagedKVCache, SeqBlocks


def _value(tokens) -> float:
    """The K/V written for the last token of ``tokens``: a function of the whole prefix, as real K/V are, so a
    prefix-cache hit must return exactly it. Integers below 2**24 are exact in float32."""
    return float(hash(tuple(tokens)) % 100_003 + 1)


def _write(cache: PagedKVCache, seq: SeqBlocks) -> None:
    """Write K/V of ``seq``'s uncomputed tokens (as a model step would) and mark them computed."""
    start = seq.num_computed
    vals = [_value(seq.token_ids[: i + 1]) for i in range(start, seq.num_tokens)]
    if not vals:
        return
    x = torch.tensor(vals)[:, None, None].expand(-1, cache.num_kv_heads, cache.head_dim)
    cache.write(0, torch.tensor(cache.slots(seq, start, seq.num_tokens)), x, -x, seq=seq)
    cache.mark_computed(seq, seq.num_tokens)


def _check_contents(cache: PagedKVCache, seqs) -> None:
    for seq in seqs:
        k, v = cache.gather(seq, 0)
        want = torch.tensor([_value(seq.token_ids[: i + 1]) for i in range(seq.num_tokens)])
        assert torch.equal(k[:, 0, 0], want), f"sequence {seq.seq_id}: K differs from what was written"
        assert torch.equal(v[:, 0, 0], -want)


def _new_cache(num_blocks, block_size, prefix=False):
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=3, num_blocks=num_blocks,
                         block_size=block_size, enable_prefix_caching=prefix)
    for t in cache.k_caches + cache.v_caches:
        t.fill_(float("nan"))  # a slot read before it is written shows up as NaN
    return cache


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]), prefix=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "rollback"]), st.integers(0, 10**6)),
                    min_size=1, max_size=40))
def test_random_operations_never_corrupt_or_leak(num_blocks, block_size, prefix, ops):
    cache = _new_cache(num_blocks, block_size, prefix)
    live: list[SeqBlocks] = []
    next_id = 0
    for op, r in ops:
        free_before = cache.allocator.num_free
        if op == "new":
            # tokens from {0, 1} so prompts share prefixes and prefix hits happen
            seq = SeqBlocks([(r >> i) & 1 for i in range(1 + r % 9)], next_id)
            next_id += 1
            fits = cache.blocks_needed(seq) <= cache.allocator.num_free
            try:
                cached = cache.allocate(seq)
            except CacheFullError:
                assert not fits and not seq.block_table and cache.allocator.num_free == free_before
            else:
                assert fits and cached % block_size == 0 and cached < seq.num_tokens == len(seq.token_ids)
                assert cached == seq.num_computed
                _write(cache, seq)
                live.append(seq)
        elif op == "append" and live:
            seq = live[r % len(live)]
            n0, table = seq.num_tokens, list(seq.block_table)
            seq.token_ids += [(r >> i) & 1 for i in range(1 + r % 3)]
            fits = cache.can_append(seq)
            try:
                cache.append_slots(seq)
            except CacheFullError:
                assert not fits and seq.block_table == table and cache.allocator.num_free == free_before
                del seq.token_ids[n0:]  # the tokens that found no slot
            else:
                assert fits
                _write(cache, seq)
        elif op == "fork" and live:
            parent = live[r % len(live)]
            child = SeqBlocks(list(parent.token_ids), next_id)
            next_id += 1
            cache.fork(parent, child)
            live.append(child)
        elif op == "free" and live:
            cache.free(live.pop(r % len(live)))
        elif op == "rollback" and live:
            seq = live[r % len(live)]
            low = max(1, len(seq.block_hashes) * block_size)
            cache.rollback(seq, low + r % (seq.num_tokens - low + 1))
        cache.check_invariants(live)
        _check_contents(cache, live)
    for seq in live:
        cache.free(seq)
        assert not seq.block_table and seq.num_computed == 0
    assert cache.allocator.num_free == num_blocks
    cache.check_invariants([])


def test_slots_follow_the_block_table():
    cache = _new_cache(8, 4)
    prompt = list(range(6))
    a = SeqBlocks(prompt, "a")  # its own copy of the ids: appending to it leaves the caller's list alone
    cache.allocate(a)
    table = a.block_table
    assert len(table) == 2
    assert cache.slots(a, 0, 6) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
    a.token_ids += [7, 8, 9]
    assert cache.num_slots(a) == 8  # the last token has no slot yet
    cache.append_slots(a)
    assert cache.slots(a, 6, 9) == [table[1] * 4 + 2, table[1] * 4 + 3, a.block_table[2] * 4]
    bt = cache.block_tables([a])
    assert bt.dtype == torch.int32 and bt.tolist() == [a.block_table]
    assert cache.context_lens([a]).tolist() == [9] and prompt == list(range(6))


def test_fork_copies_a_shared_partial_block_on_first_append():
    cache = _new_cache(8, 4)
    p = SeqBlocks([1, 2, 3, 4, 5], "p")
    cache.allocate(p)
    _write(cache, p)
    c = SeqBlocks(list(p.token_ids), "c")
    cache.fork(p, c)
    shared_last = p.block_table[-1]
    assert cache.allocator.ref_counts[shared_last] == 2 and c.num_computed == 5
    used = cache.allocator.num_used
    c.token_ids.append(9)
    cache.append_slots(c)
    _write(cache, c)
    assert c.block_table[0] == p.block_table[0]  # full block still shared
    assert c.block_table[-1] != shared_last and cache.allocator.num_used == used + 1
    p.token_ids.append(8)
    cache.append_slots(p)  # now private again: no copy
    _write(cache, p)
    assert p.block_table[-1] == shared_last and cache.allocator.num_used == used + 1
    _check_contents(cache, [p, c])
    cache.check_invariants([p, c])
    with pytest.raises(ValueError, match="must hold the tokens of parent 'p'"):
        cache.fork(p, SeqBlocks([1, 2], "x"))
    with pytest.raises(ValueError, match="child 'c' already holds 2 blocks"):
        cache.fork(p, c)


def test_prefix_cache_hit_reuses_blocks_and_survives_free_until_evicted():
    cache = _new_cache(6, 2, prefix=True)
    prompt = [5, 6, 7, 8, 9]
    a, b = SeqBlocks(prompt, "a"), SeqBlocks(prompt + [1], "b")
    assert cache.allocate(a) == 0
    early = SeqBlocks(prompt, "early")
    assert cache.allocate(early) == 0  # a's K/V are not written yet: nothing to hit
    cache.free(early)
    _write(cache, a)
    assert len(a.block_hashes) == 2
    assert cache.allocate(b) == 4  # two full blocks cached
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 4 and b.block_hashes == a.block_hashes
    _write(cache, b)
    _check_contents(cache, [a, b])
    cache.free(a)
    cache.free(b)
    assert not a.block_hashes and a.num_computed == 0 and not a.block_table
    assert cache.allocator.num_free == 6 and cache.allocator.num_cached_free >= 2
    # the last prompt token is always computed: a prompt of exactly two blocks hits only the first
    c = SeqBlocks([5, 6, 7, 8], "c")
    assert cache.allocate(c) == 2
    cache.free(c)
    with pytest.raises(ValueError, match="sequence 'c' holds no blocks"):
        cache.free(c)


def test_prefix_cache_evicts_least_recently_freed_blocks():
    cache = _new_cache(6, 2, prefix=True)
    a = SeqBlocks([5, 6, 7, 8, 9], "a")
    cache.allocate(a)
    _write(cache, a)
    cache.free(a)
    assert cache.allocator.num_free == 6 and cache.allocator.num_cached_free >= 2
    big = SeqBlocks(list(range(100, 112)), "big")
    cache.allocate(big)  # takes every block: cached prefix blocks are evicted
    assert cache.allocator.num_evictions >= 2
    cache.free(big)
    assert cache.allocate(SeqBlocks([5, 6, 7, 8, 9], "d")) == 0


def test_prefix_hit_counts_cached_free_blocks_against_the_free_pool():
    cache = _new_cache(3, 2, prefix=True)
    a = SeqBlocks([1, 2, 3], "a")
    cache.allocate(a)
    _write(cache, a)
    cache.free(a)
    x = SeqBlocks([9], "x")
    cache.allocate(x)  # one block left free besides the cached one
    assert cache.blocks_needed(SeqBlocks([1, 2, 3])) == 2 == cache.allocator.num_free  # the cached block and a new one
    assert cache.blocks_needed(SeqBlocks([1, 2, 3, 4, 5, 6])) > cache.allocator.num_free
    cache.check_invariants([x])


def test_rollback_cuts_tokens_blocks_and_computed_count():
    cache = _new_cache(16, 4, prefix=True)
    s = SeqBlocks(list(range(6)), "s")
    cache.allocate(s)
    _write(cache, s)  # one full block hashed: its 4 tokens can never be cut
    s.token_ids += list(range(9))  # 15 tokens: 4 blocks
    cache.append_slots(s)
    assert cache.allocator.num_used == 4
    cache.rollback(s, 7)
    assert cache.allocator.num_used == 2 and s.token_ids == list(range(6)) + [0] and s.num_computed == 6
    cache.check_invariants([s])
    for bad in (3, 8, -1, 2.5):
        allowed = r" in \[4, 7\]" if bad != 2.5 else ""  # 2.5: not an int at all
        with pytest.raises(ValueError, match=rf"num_tokens={bad!r} must be an int{allowed}"):
            cache.rollback(s, bad)


def test_cache_full_and_never_fits():
    cache = _new_cache(4, 4)
    with pytest.raises(CacheFullError, match="of 17 tokens needs 5 blocks of 4 but the whole cache has 4: it can"):
        cache.allocate(SeqBlocks(list(range(17)), "huge"))
    a, b = SeqBlocks(list(range(12)), "a"), SeqBlocks(list(range(5)), "b")
    cache.allocate(a)
    with pytest.raises(CacheFullError, match="sequence 'b' needs 2 free blocks, 1 of 4 are free"):
        cache.allocate(b)
    assert not b.block_table
    a.token_ids += list(range(4))
    cache.append_slots(a)
    a.token_ids.append(1)
    assert not cache.can_append(a)
    with pytest.raises(CacheFullError, match="needs 1 more blocks, 0 of 4 are free"):
        cache.append_slots(a)
    assert len(a.block_table) == 4 and cache.num_slots(a) == 16
    cache.check_invariants([a])


def test_bad_arguments():
    for kw in ({"num_blocks": 0}, {"block_size": -1}, {"head_dim": 2.0}):
        args = dict(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4, block_size=2) | kw
        with pytest.raises(ValueError, match=next(iter(kw))):
            PagedKVCache(**args)
    with pytest.raises(ValueError, match="kv_dtype='int4' is not a KV-cache format; allowed"):
        PagedKVCache(1, 1, 4, 4, 2, kv_dtype="int4")
    cache = _new_cache(4, 2)
    a = SeqBlocks([1, 2], "a")
    cache.allocate(a)
    with pytest.raises(ValueError, match="sequence 'a' already holds 1 blocks; free it first"):
        cache.allocate(a)
    with pytest.raises(ValueError, match="sequence 'e' holds no token; allocate needs at least one"):
        cache.allocate(SeqBlocks([], "e"))
    with pytest.raises(TypeError, match=r"token_ids\[1\] is 2.0 \(float\); token ids must be ints"):
        SeqBlocks([1, 2.0], "f")  # refused when made
    bad = SeqBlocks([1, 2], "g")
    bad.token_ids.append(True)
    with pytest.raises(TypeError, match=r"sequence 'g': token_ids\[2\]=True is a bool"):
        cache.allocate(bad)
    assert not bad.block_table and cache.allocator.num_free == 3
    with pytest.raises(ValueError, match=r"num_computed=3 must be an int in \[0, 2\]"):
        cache.mark_computed(a, 3)
    with pytest.raises(ValueError, match=r"num_computed=-1 must be an int in \[0, 2\]"):
        cache.mark_computed(a, -1)
    with pytest.raises(ValueError, match="num_tokens=-2 must be an int >= 0"):
        cache.blocks_for(-2)
    with pytest.raises(ValueError, match=r"k and v must have shape \(2, 2, 3\)"):
        cache.write(0, torch.tensor([0, 1]), torch.randn(2, 3, 2), torch.randn(2, 3, 2))
    with pytest.raises(ValueError, match="layer=3"):
        cache.write(3, torch.tensor([0, 1]), torch.randn(2, 2, 3), torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match="outside sequence 'a'"):
        cache.slots(a, 0, 3)
    kv = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    for layer in (-1, 1.0, True):  # -1 used to pick the last layer
        with pytest.raises(ValueError, match=rf"layer={layer!r} must be an int"):
            cache.write(layer, torch.tensor([0, 1]), *kv)
    with pytest.raises(ValueError, match=r"layer=-1 must be an int in \[0, 1\)"):
        cache.read_blocks(-1, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"layer=-1"):
        cache.gather(a, -1)


def test_write_refuses_slots_outside_the_sequences_blocks():
    cache = _new_cache(4, 2)
    a, b = SeqBlocks([1, 2, 3], "a"), SeqBlocks([1], "b")
    cache.allocate(a)  # blocks 0 and 1: slots 0..3
    cache.allocate(b)  # block 2: slots 4..5
    kv = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    with pytest.raises(ValueError, match=r"slot -1; allowed: 0 \.\. 7"):  # used to overwrite the last slot
        cache.write(0, torch.tensor([0, -1]), *kv)
    with pytest.raises(ValueError, match="slot 8; allowed: 0 .. 7"):
        cache.write(0, torch.tensor([0, 8]), *kv)
    with pytest.raises(TypeError, match="dtype torch.float32; slots must be integers"):  # used to be truncated
        cache.write(0, torch.tensor([0.0, 1.5]), *kv)
    with pytest.raises(ValueError, match="slot 6, in block 3, which any sequence does not hold"):
        cache.write(0, torch.tensor([0, 6]), *kv)
    with pytest.raises(ValueError, match="slot 4, in block 2, which sequence 'a' does not hold"):
        cache.write(0, torch.tensor([3, 4]), *kv, seq=a)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        cache.write(0, [0, 1], *kv)
    cache.write(0, torch.tensor([3, 4]), *kv)  # a's last slot and b's first: fine
    assert torch.equal(cache.gather(b, 0)[0][0], kv[0][1])
    meta = PagedKVCache(1, 1, 4, 4, 2, allocate_pools=False)
    meta.allocate(SeqBlocks([1]))
    with pytest.raises(RuntimeError, match="allocate_pools=False"):
        meta.write(0, torch.tensor([0]), torch.randn(1, 1, 4), torch.randn(1, 1, 4))


def test_stats_count_reserved_held_and_shared():
    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=10, block_size=4,
                         allocate_pools=False)
    a, b = SeqBlocks(list(range(5)), "a"), SeqBlocks(list(range(8)), "b")
    cache.allocate(a)  # 2 blocks, 5 tokens
    cache.allocate(b)  # 2 blocks, 8 tokens
    c = SeqBlocks(list(b.token_ids), "c")
    cache.fork(b, c)  # shares both of b's blocks
    s = cache.stats([a, b, c])
    assert s.bytes_per_slot == 2 * 2 * 2 * 8 * 4
    assert (s.num_seqs, s.tokens_held, s.slots_reserved, s.slots_total) == (3, 13, 16, 40)
    assert s.logical_tokens == 21 and s.waste_frac == pytest.approx(3 / 16)
    assert s.utilisation == pytest.approx(13 / 40) and s.sharing_saving_frac == pytest.approx(1 - 13 / 21)
    assert s.to_dict()["bytes_reserved"] == 16 * s.bytes_per_slot
