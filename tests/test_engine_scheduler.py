"""Schedulers without a model: a fake step 'samples' a token that is a function of (request, output index) and the
scheduler's postprocess advances the computed counts. Checked every step: the token budget, the sequence cap,
decode rows first, the block bookkeeping (``Scheduler.check_invariants``), that every scheduled token has a slot;
at the end: every request got all its tokens, in order, whatever was preempted, and every block is back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.engine.policies import ContinuousBatchingScheduler, FIFOScheduler, StaticBatchScheduler, make_scheduler
from labkit.engine.sampling import SamplingParams
from labkit.engine.sequence import Request, Sequence
from labkit.kvcache import CacheFullError, PagedKVCache


def token_of(seq_id: int, index: int) -> int:
    return 1000 + 37 * seq_id + index


def make_seqs(specs):
    """specs: (prompt_len, max_tokens) per request."""
    return [Sequence(Request(i, [10 + (i * 7 + j) % 50 for j in range(p)], SamplingParams(max_tokens=m)), seed=i)
            for i, (p, m) in enumerate(specs)]


def drive(sched, seqs, max_steps=5000):
    """Run the scheduler to completion with a fake model; returns the batches."""
    cache = sched.cache
    for s in seqs:
        sched.add(s)
    batches = []
    while sched.has_unfinished():
        b = sched.schedule()
        assert not b.is_empty, "an empty step while requests are pending: the scheduler is stuck"
        batches.append(b)
        assert len(sched.running) <= sched.max_num_seqs
        assert all(n == 1 for n in b.num_tokens[:b.num_decode]) and all(n > 1 for n in b.num_tokens[b.num_decode:])
        sched.check_invariants()
        computed = [s.num_computed for s in b.seqs]
        for s, n in zip(b.seqs, b.num_tokens):
            assert cache.num_slots(s) == s.num_tokens  # every token has a slot
            assert 1 <= n <= s.num_tokens - s.num_computed
        toks = [token_of(s.seq_id, s.num_output_tokens) for s, smp in zip(b.seqs, b.sample) if smp]
        sched.postprocess(b, toks, float(len(batches)))
        for s, n, c in zip(b.seqs, b.num_tokens, computed):
            assert s.num_computed == (0 if s.is_finished else c + n)  # advanced by the postprocess, not before
        sched.check_invariants()
        assert len(batches) < max_steps
    for s in seqs:
        assert s.is_finished and s.output_token_ids == [token_of(s.seq_id, i) for i in range(s.params.max_tokens)]
        assert not s.block_table
    assert cache.allocator.num_used == 0
    return batches


def test_fifo_runs_one_request_at_a_time():
    cache = PagedKVCache(1, 1, 4, num_blocks=20, block_size=4)
    seqs = make_seqs([(9, 3), (5, 4), (2, 1)])
    batches = drive(FIFOScheduler(cache), seqs)
    assert all(len(b.seqs) == 1 for b in batches)
    assert [b.seqs[0].seq_id for b in batches] == [0] * 3 + [1] * 4 + [2]
    assert batches[0].num_tokens == [9] and batches[1].num_tokens == [1]


def test_static_batch_runs_until_its_longest_request_ends():
    cache = PagedKVCache(1, 1, 4, num_blocks=40, block_size=4)
    seqs = make_seqs([(6, 2), (3, 7), (5, 3), (4, 2), (2, 2)])
    batches = drive(StaticBatchScheduler(cache, batch_size=3), seqs)
    members = [sorted(s.seq_id for s in b.seqs) for b in batches]
    assert members[0] == [0, 1, 2] and sorted(batches[0].num_tokens) == [3, 5, 6]
    # request 3 waits until request 1 (7 tokens) ends, though 0 and 2 finished long before
    first_of_3 = next(i for i, m in enumerate(members) if 3 in m)
    assert first_of_3 == 7 and members[first_of_3] == [3, 4]
    assert members[6] == [1]


def test_static_batch_admits_only_what_fits_at_worst_case():
    cache = PagedKVCache(1, 1, 4, num_blocks=6, block_size=4)  # 24 slots
    seqs = make_seqs([(4, 9), (4, 9), (4, 9)])  # each may need 12 slots = 3 blocks
    batches = drive(StaticBatchScheduler(cache, batch_size=3), seqs)
    assert len(batches[0].seqs) == 2


def test_continuous_decode_first_budget_and_chunked_prefill():
    cache = PagedKVCache(1, 1, 4, num_blocks=64, block_size=4)
    sched = ContinuousBatchingScheduler(cache, max_num_seqs=4, max_num_batched_tokens=8)
    seqs = make_seqs([(3, 6), (3, 6), (21, 3), (2, 2)])
    batches = drive(sched, seqs)
    assert all(b.total_tokens <= 8 for b in batches)
    # step 0: prompts 0 and 1 whole (3 + 3) and the first 2 tokens of the long prompt
    assert [(s.seq_id, n) for s, n in zip(batches[0].seqs, batches[0].num_tokens)] == [(0, 3), (1, 3), (2, 2)]
    # step 1: decode tokens of 0 and 1 come first, the long prompt goes on in a chunk of the remaining 6
    b = batches[1]
    assert b.num_decode == 2 and [s.seq_id for s in b.seqs] == [0, 1, 2] and b.num_tokens[2] == 6
    assert b.sample == [True, True, False]
    assert sched.num_preemptions == 0


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    cache = PagedKVCache(1, 1, 4, num_blocks=64, block_size=4)
    sched = ContinuousBatchingScheduler(cache, max_num_seqs=4, max_num_batched_tokens=23, chunked_prefill=False)
    batches = drive(sched, make_seqs([(3, 6), (21, 2)]))
    assert [s.seq_id for s in batches[0].seqs] == [0]  # 3 + 21 > 23: the long prompt is not cut
    assert batches[1].num_tokens == [1, 21]
    with pytest.raises(ValueError, match="chunked_prefill is off"):
        sched.add(make_seqs([(20, 5)])[0])


def test_min_admit_groups_admissions_while_others_decode():
    cache = PagedKVCache(1, 1, 4, num_blocks=64, block_size=4)
    sched = ContinuousBatchingScheduler(cache, max_num_seqs=4, max_num_batched_tokens=64, min_admit=3)
    seqs = make_seqs([(3, 2), (3, 4), (3, 9), (3, 30), (4, 3), (4, 5), (4, 3), (5, 2)])
    seen, groups = set(), []
    for b in drive(sched, seqs):
        new = [s.seq_id for s in b.seqs[b.num_decode:] if s.seq_id not in seen]
        seen.update(new)
        if new:
            groups.append((b.num_decode, new))
    # nothing running: admit at once; requests 0 and 1 end (2 slots free): no admission until 2 ends too, then
    # 3 together while request 3 decodes; the last one alone (all that wait) once a slot frees, 2 still decoding
    assert groups == [(0, [0, 1, 2, 3]), (1, [4, 5, 6]), (2, [7])]


def test_preemption_by_recompute_finishes_everything():
    cache = PagedKVCache(1, 1, 4, num_blocks=7, block_size=4)  # 28 slots for 4 requests of up to 15 each
    sched = ContinuousBatchingScheduler(cache, max_num_seqs=4, max_num_batched_tokens=32)
    seqs = make_seqs([(6, 10), (5, 10), (7, 9), (3, 12)])
    batches = drive(sched, seqs)
    assert sched.num_preemptions > 0 and sched.peak_blocks_used <= 7
    victims = [s for b in batches for s in b.preempted]
    assert victims and all(s.num_preemptions > 0 for s in victims)
    # a preempted request is prefilled again with its outputs: one chunk longer than its prompt
    v = victims[0]
    assert any(s is v and n > v.num_prompt_tokens for b in batches for s, n in zip(b.seqs, b.num_tokens))


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8),
       num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 8]), max_num_seqs=st.integers(1, 6),
       extra_budget=st.integers(0, 20), chunked=st.booleans(), policy=st.sampled_from(["fifo", "static", "continuous"]),
       min_admit=st.integers(1, 6))
def test_any_workload_finishes_correctly(specs, num_blocks, block_size, max_num_seqs, extra_budget, chunked, policy,
                                         min_admit):
    cache = PagedKVCache(1, 1, 2, num_blocks=num_blocks, block_size=block_size, allocate_pools=False)
    budget = max_num_seqs + extra_budget
    if policy == "continuous" and not chunked:
        budget = max(budget, max(p + m for p, m in specs))
    sched = make_scheduler(policy, cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           chunked_prefill=chunked, min_admit=min(min_admit, max_num_seqs))
    seqs = make_seqs(specs)
    fits = [cache.blocks_for(s.max_kv_tokens) <= num_blocks for s in seqs]
    if not all(fits):
        with pytest.raises(CacheFullError, match="could never run"):
            drive(sched, seqs)
        return
    batches = drive(sched, seqs)
    if policy == "continuous":
        assert all(b.total_tokens <= budget for b in batches)


def test_bad_arguments():
    cache = PagedKVCache(1, 1, 2, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="scheduler='lifo' is unknown"):
        make_scheduler("lifo", cache)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be >= max_num_seqs=8"):
        ContinuousBatchingScheduler(cache, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match=r"min_admit=5 must be an int in \[1, 5\)"):
        ContinuousBatchingScheduler(cache, max_num_seqs=4, max_num_batched_tokens=8, min_admit=5)
    with pytest.raises(ValueError, match="batch_size=0"):
        StaticBatchScheduler(cache, batch_size=0)
    with pytest.raises(ValueError, match="max_model_len=-5 must be an int >= 1"):
        FIFOScheduler(cache, max_model_len=-5)
    with pytest.raises(ValueError, match="max_num_seqs=True must be an int"):
        ContinuousBatchingScheduler(cache, max_num_seqs=True)
    with pytest.raises(ValueError, match="chunked_prefill='yes' must be True or False"):
        ContinuousBatchingScheduler(cache, chunked_prefill="yes")
    with pytest.raises(ValueError, match="watermark=1.5 must be a finite number >= 0 and < 1"):
        ContinuousBatchingScheduler(cache, watermark=1.5)
    with pytest.raises(TypeError, match="cache must be a PagedKVCache, got dict"):
        FIFOScheduler({})
    with pytest.raises(ValueError, match="batch_size=0"):
        make_scheduler("static", cache, static_batch_size=0)  # used to become max_num_seqs
    with pytest.raises(ValueError, match="exceeds max_model_len=10"):
        FIFOScheduler(cache, max_model_len=10).add(make_seqs([(8, 5)])[0])
