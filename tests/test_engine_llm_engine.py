"""LLMEngine on the embedded model: with greedy sampling every request's tokens equal HF ``generate``'s for that
prompt alone, whatever the scheduler, batch, chunking, prefix caching or preemption did; seeded sampling does not
depend on the batch; stop tokens; request timestamps; bad input (the serving benchmark:
tests/test_bench_serving.py)."""

import math

import pytest
import torch

from labkit.data import sample_prompts
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.sampling import SamplingParams
from labkit.kvcache import CacheFullError

N = 10  # tokens per request


pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(model, tok=None, **kw) -> LLMEngine:
    """An engine whose KV pools start as NaN: a slot read before it is written poisons the output."""
    engine = LLMEngine(model, tok, **kw)
    for t in engine.cache.k_caches + engine.cache.v_caches:
        t.fill_(float("nan"))
    return engine


def hf_greedy(model, prompt, n=N):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def cases(tiny_model):
    """Five prompts of 5..40 tokens, two more sharing a 24-token prefix with the second, and HF's greedy output."""
    model, tok = tiny_model
    ps = sample_prompts(tok, 7, 40, seed=3)
    prompts = [ps[0][:5], ps[1], ps[2][:23], ps[3][:11], ps[4][:31], ps[1][:24] + ps[5][:9], ps[1][:24] + ps[6][:3]]
    return prompts, [hf_greedy(model, p) for p in prompts]


GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)
CONFIGS = {
    "fifo": dict(scheduler="fifo"),
    "static": dict(scheduler="static", static_batch_size=3),
    "continuous_chunked": dict(scheduler="continuous", max_num_seqs=4, max_num_batched_tokens=16),
    "continuous_whole_prompts": dict(scheduler="continuous", chunked_prefill=False, max_num_batched_tokens=64),
    # 14 blocks of 4 = 56 slots for 7 requests of up to 49 tokens: preemption by recompute
    "continuous_preempting": dict(scheduler="continuous", num_blocks=14, block_size=4, max_num_seqs=8,
                                  max_num_batched_tokens=32),
    "continuous_swapping": dict(scheduler="continuous", num_blocks=14, block_size=4, max_num_seqs=8,
                                max_num_batched_tokens=32, preemption_mode="swap"),
    "continuous_prefix_cache": dict(scheduler="continuous", enable_prefix_caching=True, block_size=4, max_num_seqs=2,
                                    max_num_batched_tokens=24),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_hf_generate(tiny_model, cases, name):
    model, tok = tiny_model
    prompts, refs = cases
    engine = make_engine(model, tok, **CONFIGS[name])
    outs = engine.generate(prompts, GREEDY, progress=False)
    assert [o.output_token_ids for o in outs] == refs
    assert all(o.finish_reason == "length" for o in outs)
    stats = engine.run_stats()
    if name in ("continuous_preempting", "continuous_swapping"):
        assert stats["preemptions"] > 0 and any(o.num_preemptions for o in outs)
    if name == "continuous_swapping":
        assert stats["swapped_out_blocks"] > 0 and stats["recomputed_tokens"] == 0
    if name == "continuous_prefix_cache":
        assert stats["prefix_hit_tokens"] >= 24
    if name == "continuous_chunked":
        assert stats["peak_running"] <= 4 and stats["scheduled_seqs"] <= 4 * stats["steps"]
    assert engine.cache.allocator.num_used == 0 and not any(s.block_table for s in engine.seqs.values())


def test_seeded_sampling_ignores_batch_composition(tiny_model, cases):
    model, tok = tiny_model
    prompts, _ = cases
    hot = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=8, seed=123, ignore_eos=True)
    alone = make_engine(model, tok, scheduler="fifo").generate([prompts[2]], hot, progress=False)[0]
    crowd = make_engine(model, tok, max_num_seqs=4, max_num_batched_tokens=20).generate(
        prompts[:4], [GREEDY, SamplingParams(temperature=1.0, max_tokens=5, seed=9), hot, GREEDY], progress=False)
    assert crowd[2].output_token_ids == alone.output_token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = make_engine(model, tok, seed=5).generate(prompts[:2], unseeded, progress=False)
    b = make_engine(model, tok, seed=5, scheduler="fifo").generate(prompts[:2], unseeded, progress=False)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


def test_stop_tokens_and_text(tiny_model, cases):
    model, tok = tiny_model
    prompts, refs = cases
    stop = refs[3][4]
    first = refs[3].index(stop)
    params = SamplingParams(max_tokens=N, stop_token_ids=(stop,))
    out = make_engine(model, tok).generate([prompts[3]], params, progress=False)[0]
    assert out.output_token_ids == refs[3][:first + 1] and out.finish_reason == "stop"
    assert out.text == tok.decode(out.output_token_ids)


def test_bad_input(tiny_model, cases):
    model, tok = tiny_model
    prompts, _ = cases
    with pytest.raises(ValueError, match="scheduler='round_robin' is unknown"):
        EngineConfig(scheduler="round_robin")
    engine = make_engine(model, max_model_len=32)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("def f():")
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        engine.generate([prompts[1]], SamplingParams(max_tokens=8), progress=False)
    assert not engine.has_unfinished()  # nothing was queued
    with pytest.raises(ValueError, match="got 2 for 3 prompts"):
        engine.generate(prompts[:3], [GREEDY, GREEDY], progress=False)
    with pytest.raises(CacheFullError, match="could never run"):
        make_engine(model, num_blocks=4, block_size=4).add_request(prompts[1], GREEDY)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        make_engine(model, max_model_len=4096)
    text = make_engine(model, tok, max_model_len=64).generate(["x = 1"], progress=False)[0]
    assert math.isfinite(text.metrics.ttft_s) and len(text.output_token_ids) >= 1


@pytest.mark.gpu
def test_greedy_equals_hf_on_cuda_with_graphs_and_triton(cases):
    from labkit.model import load_model

    model = load_model(device="cuda")[0]
    prompts, refs = cases
    for name in ("fifo", "continuous_chunked", "continuous_preempting", "continuous_swapping"):
        engine = make_engine(model, **CONFIGS[name])
        assert engine.runner.use_triton and engine.runner.graph_batch_sizes
        outs = engine.generate(prompts, GREEDY, progress=False)
        assert [o.output_token_ids for o in outs] == refs, name
        assert engine.stats.graph_steps > 0
