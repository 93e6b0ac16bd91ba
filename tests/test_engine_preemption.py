"""Preemption in the engine: an over-subscribed cache finishes every request, by recompute and by swap, with outputs
equal to an unconstrained run and to HF ``generate``; swap copies bytes (nothing is recomputed); a request that can
never fit is refused up front. Without a model: whatever the sizes, the continuous scheduler finishes every
request in either mode with consistent block bookkeeping."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.data import sample_prompts
from labkit.engine import EngineConfig, LLMEngine, SamplingParams
from labkit.engine.policies import ContinuousBatchingScheduler
from labkit.engine.sequence import Request, Sequence
from labkit.kvcache import CacheFullError, PagedKVCache

pytestmark = pytest.mark.usefixtures("one_thread")


def params_for(lens_out):
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens_out]


def run(model, prompts, lens_out, **kw):
    engine = LLMEngine(model, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, **kw)
    outs = engine.generate(prompts, params_for(lens_out), progress=False)
    return [o.output_token_ids for o in outs], engine


@pytest.fixture(scope="module")
def workload(tiny_model):
    """Six prompts of 5..30 tokens and output lengths 6..20, and their unconstrained greedy outputs."""
    model, tok = tiny_model
    lens_in, lens_out = [30, 5, 17, 23, 9, 12], [20, 14, 6, 18, 11, 16]
    prompts = [p[:n] for p, n in zip(sample_prompts(tok, 6, 30, seed=21), lens_in, strict=True)]
    ref, engine = run(model, prompts, lens_out, num_blocks=64)
    assert engine.run_stats()["preemptions"] == 0
    return prompts, lens_out, ref


def test_unconstrained_run_matches_hf(tiny_model, workload):
    model, _ = tiny_model
    prompts, lens_out, ref = workload
    for p, n, r in zip(prompts[:2], lens_out[:2], ref[:2], strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert out[0, len(p):].tolist() == r


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_oversubscribed_run_preempts_and_matches(tiny_model, workload, mode):
    model, _ = tiny_model
    prompts, lens_out, ref = workload
    # 13 blocks of 4 = 52 slots; the longest request needs 49 at its end, the six together 238
    out, engine = run(model, prompts, lens_out, num_blocks=13, preemption_mode=mode)
    assert out == ref
    s = engine.run_stats()
    assert s["preemptions"] > 0 and s["peak_blocks_used"] <= 13 and s["preemption_mode"] == mode
    if mode == "swap":
        assert s["swapped_out_blocks"] > 0 and s["swapped_in_blocks"] == s["swapped_out_blocks"]
        assert s["recomputed_tokens"] == 0
    else:
        assert s["recomputed_tokens"] > 0 and s["swapped_out_blocks"] == 0
    cache = engine.cache
    assert cache.allocator.num_free == 13 and not any(s.block_table for s in engine.seqs.values())
    engine.scheduler.check_invariants()


def test_swap_space_full_falls_back_to_recompute(tiny_model, workload):
    model, _ = tiny_model
    prompts, lens_out, ref = workload
    cache_bytes = PagedKVCache.for_model(model, 1, 4).bytes_per_block
    out, engine = run(model, prompts, lens_out, num_blocks=13, preemption_mode="swap",
                      swap_space=4 * cache_bytes / (1 << 30))  # room for 4 blocks: too few for some victims
    assert engine.scheduler.swap.allocator.num_blocks == 4
    s = engine.run_stats()
    assert out == ref and s["recomputed_tokens"] > 0


def test_recompute_with_prefix_caching_reuses_freed_blocks(tiny_model, workload):
    model, _ = tiny_model
    prompts, lens_out, ref = workload
    out, engine = run(model, prompts, lens_out, num_blocks=13, enable_prefix_caching=True)
    s = engine.run_stats()
    assert out == ref and s["preemptions"] > 0 and s["prefix_hit_tokens"] > 0


def test_request_that_can_never_fit_is_refused(tiny_model, workload):
    model, _ = tiny_model
    prompts, _, _ = workload
    engine = LLMEngine(model, num_blocks=8, block_size=4)
    with pytest.raises(CacheFullError, match="request 0: prompt of 30 tokens \\+ max_tokens=4 needs 9 KV blocks"):
        engine.generate(prompts, SamplingParams(max_tokens=4), progress=False)
    assert engine.cache.allocator.num_used == 0 and not engine.has_unfinished()  # refused before anything ran
    with pytest.raises(ValueError, match="preemption_mode='drop' is unknown; allowed"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space=0 must be a finite number > 0"):
        EngineConfig(swap_space=0)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLMEngine(model, num_blocks=8, preemption_mode="swap", swap_space=1e-12)
    with pytest.raises(ValueError, match="max_tokens=0 must be an int >= 1"):
        SamplingParams(max_tokens=0)


def test_eos_stops_a_request(tiny_model, workload):
    model, _ = tiny_model
    prompts, _, ref = workload
    eos = ref[0][3]
    out = LLMEngine(model, num_blocks=64, block_size=4).generate(
        prompts[:1], SamplingParams(max_tokens=20, stop_token_ids=(eos,)), progress=False)[0]
    assert out.output_token_ids == ref[0][: ref[0].index(eos) + 1] and out.finish_reason == "stop"


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]), prefix=st.booleans(),
       sizes=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=8),
       max_num_seqs=st.integers(1, 5), mode=st.sampled_from(["recompute", "swap"]), cpu_blocks=st.integers(1, 12),
       watermark=st.sampled_from([0.0, 0.1]))
def test_scheduler_finishes_every_request(num_blocks, block_size, prefix, sizes, max_num_seqs, mode, cpu_blocks,
                                          watermark):
    """Without a model (a cache without tensors; the swap space then moves bookkeeping only): whatever the sizes,
    every request that fits alone finishes with all its tokens, the bookkeeping stays consistent, a swapped
    sequence comes back with the tokens it had, and the cache and swap space end empty."""
    cache = PagedKVCache(1, 1, 1, num_blocks, block_size, enable_prefix_caching=prefix, allocate_pools=False)
    sched = ContinuousBatchingScheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=6,
                                        preemption_mode=mode, num_cpu_blocks=cpu_blocks, watermark=watermark)
    seqs = []
    for i, (p, m) in enumerate(sizes):
        seq = Sequence(Request(i, [i % 2] * p, SamplingParams(max_tokens=m, ignore_eos=True)), seed=i)
        if cache.blocks_for(p + m - 1) > num_blocks:
            with pytest.raises(CacheFullError, match="could never run"):
                sched.add(seq)
        else:
            sched.add(seq)
            seqs.append(seq)
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert not batch.is_empty and len(sched.running) <= max_num_seqs and batch.total_tokens <= 6
        sched.check_invariants()
        assert all(cache.num_slots(s) == s.num_tokens for s in batch.seqs)  # every scheduled token has a slot
        sched.postprocess(batch, [7] * sum(batch.sample), float(steps))  # (a model step wrote the chunks' K/V)
        sched.check_invariants()
        steps += 1
        assert steps < 2000
    assert all(s.output_token_ids == [7] * s.params.max_tokens and not s.block_table for s in seqs)
    assert cache.allocator.num_free == num_blocks
    if mode == "swap":
        assert sched.swap.allocator.num_free == cpu_blocks
        assert sched.swap.blocks_in == sched.swap.blocks_out
