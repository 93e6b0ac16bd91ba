"""Preemption: an over-subscribed cache finishes every request, by recompute and by swap, with outputs equal to
an unconstrained run and to HF ``generate``; swap copies bytes exactly; a request that can never fit is refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.data import sample_prompts
from labkit.kvcache import CacheFullError, PagedKVCache
from labkit.kvcache.preemption import PagedGenerator, Request, Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_tok():
    from labkit.models import load_model

    return load_model()


@pytest.fixture(scope="module")
def workload(model_tok):
    """Six prompts of 5..30 tokens and output lengths 6..20, and their unconstrained greedy outputs."""
    model, tok = model_tok
    lens_in, lens_out = [30, 5, 17, 23, 9, 12], [20, 14, 6, 18, 11, 16]
    prompts = [p[:n] for p, n in zip(sample_prompts(tok, 6, 30, seed=21), lens_in, strict=True)]
    big = PagedKVCache.for_model(model, num_blocks=64, block_size=4)
    ref = PagedGenerator(model, big).generate(prompts, lens_out)
    return prompts, lens_out, ref


def test_unconstrained_run_matches_hf(model_tok, workload):
    model, _ = model_tok
    prompts, lens_out, ref = workload
    for p, n, r in zip(prompts[:2], lens_out[:2], ref[:2], strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert out[0, len(p):].tolist() == r


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_oversubscribed_run_preempts_and_matches(model_tok, workload, mode):
    model, _ = model_tok
    prompts, lens_out, ref = workload
    # 13 blocks of 4 = 52 slots; the longest request needs 49 at its end, the six together 238
    cache = PagedKVCache.for_model(model, num_blocks=13, block_size=4)
    gen = PagedGenerator(model, cache, preemption=mode)
    assert gen.generate(prompts, lens_out) == ref
    s = gen.stats
    assert s.preemptions > 0 and s.max_blocks_used <= 13
    if mode == "swap":
        assert s.swapped_out_blocks > 0 and s.swapped_in_blocks == s.swapped_out_blocks and s.recomputed_tokens == 0
    else:
        assert s.recomputed_tokens > 0
    assert not cache.seqs and cache.allocator.num_free == 13
    cache.check_invariants()


def test_recompute_with_prefix_caching_reuses_freed_blocks(model_tok, workload):
    model, _ = model_tok
    prompts, lens_out, ref = workload
    cache = PagedKVCache.for_model(model, num_blocks=13, block_size=4, enable_prefix_caching=True)
    gen = PagedGenerator(model, cache, preemption="recompute")
    assert gen.generate(prompts, lens_out) == ref
    assert gen.stats.preemptions > 0 and gen.stats.prefix_cached_tokens > 0


def test_request_that_can_never_fit_is_refused(model_tok, workload):
    model, _ = model_tok
    prompts, _, _ = workload
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    gen = PagedGenerator(model, cache)
    with pytest.raises(CacheFullError, match="request 0: prompt of 30 tokens \\+ max_new_tokens=4 needs 9 blocks"):
        gen.generate(prompts, 4)
    assert not cache.seqs  # refused before anything ran
    with pytest.raises(ValueError, match="preemption='drop' is unknown; allowed"):
        PagedGenerator(model, cache, preemption="drop")
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        gen.generate(prompts[:1], 0)


def test_eos_stops_a_request(model_tok, workload):
    model, _ = model_tok
    prompts, lens_out, ref = workload
    eos = ref[0][3]
    out = PagedGenerator(model, PagedKVCache.for_model(model, 64, 4), eos_token_id=eos).generate(prompts[:1], 20)
    assert out[0] == ref[0][: ref[0].index(eos) + 1]


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]), prefix=st.booleans(),
       sizes=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=8),
       max_num_seqs=st.integers(1, 5))
def test_scheduler_finishes_every_request(num_blocks, block_size, prefix, sizes, max_num_seqs):
    """Without a model (a cache without tensors): whatever the sizes, every request that fits alone finishes with
    all its tokens, the block bookkeeping stays consistent, and the cache ends empty."""
    cache = PagedKVCache(1, 1, 1, num_blocks, block_size, enable_prefix_caching=prefix, allocate_pools=False)
    sched = Scheduler(cache, max_num_seqs=max_num_seqs, max_prefill_tokens=6)
    reqs = []
    for i, (p, m) in enumerate(sizes):
        req = Request(i, [i % 2] * p, m)
        if cache.blocks_for(p + m - 1) > num_blocks:
            with pytest.raises(CacheFullError, match="can never fit"):
                sched.add(req)
        else:
            sched.add(req)
            reqs.append(req)
    while sched.has_unfinished:
        batch = sched.schedule()
        assert batch and len(sched.running) <= max_num_seqs
        for r in batch:  # what a model step would do: mark the batch's tokens computed
            cache.mark_computed(r.request_id, cache.seqs[r.request_id].num_tokens)
        cache.check_invariants()
        sched.finish_step(batch, [7] * len(batch))
    assert all(r.output == [7] * r.max_new_tokens for r in reqs)
    assert not cache.seqs and cache.allocator.num_free == num_blocks
