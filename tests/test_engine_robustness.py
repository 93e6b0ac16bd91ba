"""Failure isolation in the engine (vLLM's behaviour): every request is checked before it is admitted
(``generate`` and ``add_request`` alike; a benchmark's ``serve`` too: tests/test_bench_serving.py); a request that
still fails inside a step is finished with an error and its blocks freed while the others complete;
``abort_request`` and ``reset(abort=True)`` leave a clean engine; every EOS id stops a request."""

import math

import pytest

from labkit.data import sample_prompts
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model):
    _, tok = tiny_model
    return [p[: 3 + i % 9] for i, p in enumerate(sample_prompts(tok, 100, 12, seed=4))]


def poison(engine: LLMEngine, request_id: int) -> None:
    """Put an id outside the vocabulary into a queued request behind the checks' back: its prefill raises
    ``IndexError`` in the embedding, as an unchecked bad id did before."""
    engine.seqs[request_id].token_ids[1] = engine.vocab_size + 5


def clean(engine: LLMEngine) -> bool:
    return (not engine.has_unfinished() and engine.cache.allocator.num_used == 0
            and not any(s.block_table for s in engine.seqs.values()))


def test_one_bad_request_among_100_fails_alone(tiny_model, prompts):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, max_num_seqs=32, max_num_batched_tokens=256)
    engine.reset()
    ids = [engine.add_request(p, GREEDY, arrival_s=0.0) for p in prompts[:50]]
    with pytest.raises(ValueError, match=r"request 50: prompt\[2\] is 8192, outside the vocabulary; allowed: "
                                         r"\[0, 8192\)"):
        engine.add_request(prompts[50][:2] + [8192], GREEDY)  # refused at the door: nothing queued
    ids += [engine.add_request(p, GREEDY, arrival_s=0.0) for p in prompts[50:]]
    poison(engine, ids[37])
    while engine.has_unfinished():
        engine.step()
    outs = engine.outputs()
    assert len(outs) == 100 and clean(engine)
    bad = [o for o in outs if not o.ok]
    assert [o.request_id for o in bad] == [ids[37]] and bad[0].finish_reason == "error"
    assert "IndexError" in bad[0].error and bad[0].metrics is None
    assert all(len(o.output_token_ids) == 2 and o.finish_reason == "length" for o in outs if o.ok)
    assert engine.run_stats()["errors"] == 1
    # the survivors' tokens equal a run without the bad request
    ref = LLMEngine(model, tok, max_num_seqs=32, max_num_batched_tokens=256).generate(
        [p for i, p in enumerate(prompts) if i != 37], GREEDY, progress=False)
    assert [o.output_token_ids for o in outs if o.ok] == [o.output_token_ids for o in ref]


def test_error_mid_decode_frees_blocks_and_others_finish(tiny_model, prompts):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    real = engine.runner.execute

    def failing(seqs, num_tokens, num_decode):  # request 2 fails once it has decode work
        if engine.seqs[2] in seqs and engine.seqs[2].num_output_tokens >= 2:
            raise RuntimeError("kernel fault on request 2")
        return real(seqs, num_tokens, num_decode)

    engine.runner.execute = failing
    outs = engine.generate(prompts[:5], SamplingParams(max_tokens=6, ignore_eos=True), progress=False)
    assert [o.finish_reason for o in outs] == ["length", "length", "error", "length", "length"]
    assert outs[2].error == "RuntimeError: kernel fault on request 2" and len(outs[2].output_token_ids) == 2
    assert outs[2].metrics is not None and clean(engine)


def test_abort_and_reset_leave_a_clean_engine(tiny_model, prompts):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, max_num_seqs=2, max_num_batched_tokens=32)
    engine.reset()
    a, b, c = (engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts[:3])
    engine.step()
    assert engine.abort_request(a) and engine.abort_request(c)  # one running, one still queued
    assert not engine.abort_request(a)  # finished already
    with pytest.raises(KeyError, match="request_id=99 is unknown"):
        engine.abort_request(99)
    while engine.has_unfinished():
        engine.step()
    outs = {o.request_id: o for o in engine.outputs()}
    assert outs[a].finish_reason == "abort" and outs[c].finish_reason == "abort" and outs[b].ok and clean(engine)

    engine.reset()
    engine.add_request(prompts[3], GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="1 requests are still unfinished"):
        engine.reset()
    engine.reset(abort=True)
    assert clean(engine)
    assert len(engine.generate(prompts[:2], GREEDY, progress=False)) == 2


def test_interrupted_generate_does_not_wedge(tiny_model, prompts):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, max_num_seqs=2, max_num_batched_tokens=32)
    real, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real()

    engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts[:4], GREEDY, progress=False)
    assert clean(engine)
    del engine.step
    assert all(o.ok for o in engine.generate(prompts[:4], GREEDY, progress=False))


def test_requests_are_checked_before_admission(tiny_model, prompts):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, max_model_len=64)
    with pytest.raises(TypeError, match=r"prompts='hello' is one string; pass a list of prompts, e\.g\. \['hello'\]"):
        engine.generate("hello", progress=False)
    with pytest.raises(TypeError, match="params='greedy' must be a SamplingParams"):
        engine.generate(["hello"], "greedy", progress=False)
    with pytest.raises(TypeError, match="params='greedy' must be a SamplingParams"):
        engine.add_request([1, 2], "greedy")
    with pytest.raises(ValueError, match=r"prompt\[1\] is -5, outside the vocabulary"):
        engine.generate([[1, 2], [3, -5]], progress=False)
    with pytest.raises(TypeError, match=r"prompt\[0\] is 3.0 \(float\)"):
        engine.generate([[3.0, 4]], progress=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="request_id=-1 must be an int >= 0"):
        engine.add_request([1], request_id=-1)
    with pytest.raises(ValueError, match="arrival_s=nan"):
        engine.add_request([1], arrival_s=math.nan)
    assert clean(engine) and not engine.seqs  # nothing was queued


def test_every_eos_id_stops(tiny_model, prompts):
    """A Llama-3-Instruct-style config lists several EOS ids; the engine stops at any of them."""
    model, tok = tiny_model
    ref = LLMEngine(model, tok).generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True),
                                         progress=False)[0].output_token_ids
    second, fourth = ref[1], ref[3]
    old = model.config.eos_token_id
    try:
        model.config.eos_token_id = [fourth, second]  # the one that comes first is the list's second
        engine = LLMEngine(model, tok)
        assert engine.eos_token_ids[:2] == (fourth, second)  # then the generation config's
        out = engine.generate([prompts[0]], SamplingParams(max_tokens=8), progress=False)[0]
        stop = min(i for i, t in enumerate(ref) if t in engine.eos_token_ids)
        assert stop <= 1 and out.output_token_ids == ref[: stop + 1] and out.finish_reason == "stop"
    finally:
        model.config.eos_token_id = old
    out = LLMEngine(model, tok, eos_token_ids=(fourth,)).generate([prompts[0]], SamplingParams(max_tokens=8),
                                                                  progress=False)[0]
    assert out.output_token_ids == ref[: ref.index(fourth) + 1]
    out = LLMEngine(model, tok).generate([prompts[0]], SamplingParams(max_tokens=8, eos_token_ids=[second]),
                                         progress=False)[0]
    assert out.output_token_ids == ref[: ref.index(second) + 1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_model_len=0), "max_model_len=0 must be an int >= 1"),  # was 2048
    (dict(max_model_len=-5), "max_model_len=-5 must be an int >= 1"),
    (dict(static_batch_size=0), "static_batch_size=0 must be an int >= 1"),  # was max_num_seqs
    (dict(max_num_seqs=0), "max_num_seqs=0 must be an int >= 1"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens=2.5 must be an int"),
    (dict(block_size=0), "block_size=0 must be an int >= 1"),
    (dict(num_blocks=1), "num_blocks=1 must be an int >= 2"),
    (dict(min_admit=0), "min_admit=0"),
    (dict(seed=-1), "seed=-1 must be an int >= 0"),
    (dict(chunked_prefill="no"), "chunked_prefill='no' must be True or False"),
    (dict(cuda_graphs="yes"), "cuda_graphs='yes'; allowed: 'auto', True, False"),
    (dict(cuda_graphs=1), "cuda_graphs=1; allowed"),
    (dict(graph_batch_sizes=(1, 0)), r"graph_batch_sizes\[1\]=0 must be an int >= 1"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 must be a finite number > 0 and <= 1"),
    (dict(swap_space=float("inf")), "swap_space=inf must be a finite number > 0"),
    (dict(eos_token_ids=["</s>"]), r"eos_token_ids\[0\] is '</s>' \(str\); token ids must be ints"),
    (dict(kernels="cuda"), "kernels='cuda' is unknown"),
])
def test_engine_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_engine_config_keeps_good_values():
    cfg = EngineConfig(graph_batch_sizes=[1, 2], eos_token_ids=[128001, 128009], static_batch_size=3,
                       scheduler="static")
    assert cfg.graph_batch_sizes == (1, 2) and cfg.eos_token_ids == (128001, 128009) and cfg.seqs_per_step == 3


def test_abort_a_swapped_out_request(tiny_model, prompts):
    model, tok = tiny_model
    long = [p * 4 for p in prompts[:6]]
    engine = LLMEngine(model, tok, block_size=4, num_blocks=13, max_num_seqs=8, max_num_batched_tokens=64,
                       preemption_mode="swap")
    engine.reset()
    ids = [engine.add_request(p[:20], SamplingParams(max_tokens=20, ignore_eos=True)) for p in long]
    while not engine.scheduler.swapped and engine.has_unfinished():
        engine.step()
    victim = engine.scheduler.swapped[0].seq_id
    assert engine.abort_request(victim) and not engine.seqs[victim].block_table
    while engine.has_unfinished():
        engine.step()
    outs = {o.request_id: o for o in engine.outputs()}
    assert outs[victim].finish_reason == "abort" and all(outs[i].ok for i in ids if i != victim)
    assert clean(engine) and engine.scheduler.swap.allocator.num_free == engine.scheduler.swap.allocator.num_blocks
