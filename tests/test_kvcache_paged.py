"""PagedKVCache: block tables, slots, copy on write, prefix hits, cache-full and bad input, metrics; a
hypothesis test of random allocate / append / fork / free sequences checks every sequence reads back exactly
the K/V written for it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kvcache import CacheFullError, PagedKVCache


def _value(tokens) -> float:
    """The K/V written for the last token of ``tokens``: a function of the whole prefix, as real K/V are, so a
    prefix-cache hit must return exactly it. Integers below 2**24 are exact in float32."""
    return float(hash(tuple(tokens)) % 100_003 + 1)


def _write(cache: PagedKVCache, sid, start: int) -> None:
    seq = cache.seqs[sid]
    vals = [_value(seq.token_ids[: i + 1]) for i in range(start, seq.num_tokens)]
    if not vals:
        return
    x = torch.tensor(vals)[:, None, None].expand(-1, cache.num_kv_heads, cache.head_dim)
    cache.write(0, torch.tensor(cache.slots(sid, start, seq.num_tokens)), x, -x)
    cache.mark_computed(sid, seq.num_tokens)


def _check_contents(cache: PagedKVCache) -> None:
    for sid, seq in cache.seqs.items():
        k, v = cache.gather(sid, 0)
        want = torch.tensor([_value(seq.token_ids[: i + 1]) for i in range(seq.num_tokens)])
        assert torch.equal(k[:, 0, 0], want), f"sequence {sid}: K differs from what was written"
        assert torch.equal(v[:, 0, 0], -want)


def _new_cache(num_blocks, block_size, prefix=False):
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=3, num_blocks=num_blocks,
                         block_size=block_size, enable_prefix_caching=prefix)
    for t in cache.k_caches + cache.v_caches:
        t.fill_(float("nan"))  # a slot read before it is written shows up as NaN
    return cache


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]), prefix=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 10**6)),
                    min_size=1, max_size=40))
def test_random_operations_never_corrupt_or_leak(num_blocks, block_size, prefix, ops):
    cache = _new_cache(num_blocks, block_size, prefix)
    next_id = 0
    for op, r in ops:
        live = sorted(cache.seqs)
        free_before = cache.allocator.num_free
        if op == "new":
            # tokens from {0, 1} so prompts share prefixes and prefix hits happen
            tokens = [(r >> i) & 1 for i in range(1 + r % 9)]
            fits = cache.can_allocate(tokens)
            try:
                cached = cache.allocate(next_id, tokens)
            except CacheFullError:
                assert not fits and next_id not in cache.seqs and cache.allocator.num_free == free_before
            else:
                assert fits and cached % block_size == 0 and cached < len(tokens)
                _write(cache, next_id, cached)
                next_id += 1
        elif op == "append" and live:
            sid = live[r % len(live)]
            n0 = cache.seqs[sid].num_tokens
            tokens = [(r >> i) & 1 for i in range(1 + r % 3)]
            fits = cache.can_append(sid, len(tokens))
            try:
                cache.append_slots(sid, tokens)
            except CacheFullError:
                assert not fits and cache.seqs[sid].num_tokens == n0
                assert cache.allocator.num_free == free_before
            else:
                assert fits
                _write(cache, sid, n0)
        elif op == "fork" and live:
            cache.fork(live[r % len(live)], next_id)
            next_id += 1
        elif op == "free" and live:
            cache.free(live[r % len(live)])
        cache.check_invariants()
        _check_contents(cache)
    for sid in list(cache.seqs):
        cache.free(sid)
    assert cache.allocator.num_free == num_blocks
    cache.check_invariants()


def test_slots_follow_the_block_table():
    cache = _new_cache(8, 4)
    cache.allocate("a", list(range(6)))
    table = cache.seqs["a"].block_table
    assert len(table) == 2
    assert cache.slots("a", 0, 6) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
    slots = cache.append_slots("a", [7, 8, 9])
    assert slots == [table[1] * 4 + 2, table[1] * 4 + 3, cache.seqs["a"].block_table[2] * 4]
    bt = cache.block_tables(["a"])
    assert bt.dtype == torch.int32 and bt.tolist() == [cache.seqs["a"].block_table]
    assert cache.context_lens(["a"]).tolist() == [9]


def test_fork_copies_a_shared_partial_block_on_first_append():
    cache = _new_cache(8, 4)
    cache.allocate("p", [1, 2, 3, 4, 5])
    _write(cache, "p", 0)
    cache.fork("p", "c")
    shared_last = cache.seqs["p"].block_table[-1]
    assert cache.allocator.ref_counts[shared_last] == 2
    used = cache.allocator.num_used
    cache.append_slots("c", [9])
    _write(cache, "c", 5)
    assert cache.seqs["c"].block_table[0] == cache.seqs["p"].block_table[0]  # full block still shared
    assert cache.seqs["c"].block_table[-1] != shared_last and cache.allocator.num_used == used + 1
    cache.append_slots("p", [8])  # now private again: no copy
    _write(cache, "p", 5)
    assert cache.seqs["p"].block_table[-1] == shared_last and cache.allocator.num_used == used + 1
    _check_contents(cache)
    cache.check_invariants()


def test_prefix_cache_hit_reuses_blocks_and_survives_free_until_evicted():
    cache = _new_cache(6, 2, prefix=True)
    prompt = [5, 6, 7, 8, 9]
    assert cache.allocate("a", prompt) == 0
    _write(cache, "a", 0)
    assert cache.allocate("b", prompt + [1]) == 4  # two full blocks cached
    assert cache.seqs["b"].block_table[:2] == cache.seqs["a"].block_table[:2]
    _write(cache, "b", 4)
    _check_contents(cache)
    cache.free("a")
    cache.free("b")
    assert cache.allocator.num_free == 6 and cache.allocator.num_cached_free >= 2
    # the last prompt token is always computed: a prompt of exactly two blocks hits only the first
    assert cache.allocate("c", [5, 6, 7, 8]) == 2
    cache.free("c")
    cache.allocate("big", list(range(100, 112)))  # takes every block: cached prefix blocks are evicted
    assert cache.allocator.num_evictions >= 2
    cache.free("big")
    assert cache.allocate("d", prompt) == 0


def test_prefix_hit_counts_cached_free_blocks_against_the_free_pool():
    cache = _new_cache(3, 2, prefix=True)
    cache.allocate("a", [1, 2, 3])
    _write(cache, "a", 0)
    cache.free("a")
    cache.allocate("x", [9])  # one block left free besides the cached one
    assert cache.can_allocate([1, 2, 3])  # needs the cached block back and one new one: 2 free, fits
    assert not cache.can_allocate([1, 2, 3, 4, 5, 6])
    cache.check_invariants()


def test_cache_full_and_never_fits():
    cache = _new_cache(4, 4)
    with pytest.raises(CacheFullError, match="needs 5 blocks of 4 but the whole cache has 4: it can never"):
        cache.allocate("huge", list(range(17)))
    cache.allocate("a", list(range(12)))
    with pytest.raises(CacheFullError, match="needs 2 free blocks, 1 of 4 are free"):
        cache.allocate("b", list(range(5)))
    assert "b" not in cache.seqs
    cache.append_slots("a", list(range(4)))
    with pytest.raises(CacheFullError, match="needs 1 more blocks, 0 of 4 are free"):
        cache.append_slots("a", [1])
    assert cache.seqs["a"].num_tokens == 16
    cache.check_invariants()


def test_bad_arguments():
    for kw in ({"num_blocks": 0}, {"block_size": -1}, {"head_dim": 2.0}):
        args = dict(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4, block_size=2) | kw
        with pytest.raises(ValueError, match=next(iter(kw))):
            PagedKVCache(**args)
    with pytest.raises(ValueError, match="kv_dtype='int4' is not a KV-cache format; allowed"):
        PagedKVCache(1, 1, 4, 4, 2, kv_dtype="int4")
    cache = _new_cache(4, 2)
    cache.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="already in the cache"):
        cache.allocate("a", [1])
    with pytest.raises(ValueError, match="at least one token"):
        cache.allocate("e", [])
    with pytest.raises(KeyError, match="not in the cache"):
        cache.append_slots("zz", [1])
    with pytest.raises(ValueError, match=r"k and v must have shape \(2, 2, 3\)"):
        cache.write(0, torch.tensor([0, 1]), torch.randn(2, 3, 2), torch.randn(2, 3, 2))
    with pytest.raises(ValueError, match="layer=3"):
        cache.write(3, torch.tensor([0, 1]), torch.randn(2, 2, 3), torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match="outside sequence"):
        cache.slots("a", 0, 3)
    kv = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    for layer in (-1, 1.0, True):  # -1 used to pick the last layer
        with pytest.raises(ValueError, match=rf"layer={layer!r} must be an int in \[0, 1\)"):
            cache.write(layer, torch.tensor([0, 1]), *kv)
    with pytest.raises(ValueError, match=r"layer=-1 must be an int in \[0, 1\)"):
        cache.read_blocks(-1, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"layer=-1"):
        cache.gather("a", -1)


def test_write_refuses_slots_outside_the_sequences_blocks():
    cache = _new_cache(4, 2)
    cache.allocate("a", [1, 2, 3])  # blocks 0 and 1: slots 0..3
    cache.allocate("b", [1])  # block 2: slots 4..5
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
        cache.write(0, torch.tensor([3, 4]), *kv, seq_id="a")
    with pytest.raises(ValueError, match="1-D integer tensor"):
        cache.write(0, [0, 1], *kv)
    cache.write(0, torch.tensor([3, 4]), *kv)  # a's last slot and b's first: fine
    assert torch.equal(cache.gather("b", 0)[0][0], kv[0][1])
    meta = PagedKVCache(1, 1, 4, 4, 2, allocate_pools=False)
    meta.allocate("a", [1])
    with pytest.raises(RuntimeError, match="allocate_pools=False"):
        meta.write(0, torch.tensor([0]), torch.randn(1, 1, 4), torch.randn(1, 1, 4))


def test_stats_count_reserved_held_and_shared():
    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=10, block_size=4,
                         allocate_pools=False)
    cache.allocate("a", list(range(5)))  # 2 blocks, 5 tokens
    cache.allocate("b", list(range(8)))  # 2 blocks, 8 tokens
    cache.fork("b", "c")  # shares both of b's blocks
    s = cache.stats()
    assert s.bytes_per_slot == 2 * 2 * 2 * 8 * 4
    assert (s.num_seqs, s.tokens_held, s.slots_reserved, s.slots_total) == (3, 13, 16, 40)
    assert s.logical_tokens == 21 and s.waste_frac == pytest.approx(3 / 16)
    assert s.utilisation == pytest.approx(13 / 40) and s.sharing_saving_frac == pytest.approx(1 - 13 / 21)
    assert s.to_dict()["bytes_reserved"] == 16 * s.bytes_per_slot
