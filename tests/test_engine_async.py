"""Async scheduling (``EngineConfig.async_scheduling``, labkit/engine/async_step.py): the same workloads with and
without overlap give the same tokens, finish reasons and aborted requests, and leave the cache as full as they found
it: irregular prompts, mixed ``max_tokens``, stop tokens found one step late, seeded sampling, preemption by recompute
and by swap, prefix caching, each scheduler, aborts mid-run, a step that raises, CUDA-graph replays (the CPU stand-in
of tests/test_engine_cuda_graph.py). With the forward replaced by a simulated device (its time passes while the host
goes on; the host waits for it only when it reads the sampled tokens), a step takes about max(host, device) with
overlap against host + device without. On CUDA (``gpu``): the same comparison with the Triton kernels and CUDA graphs,
and a launch that never makes the host wait for the device."""

import time

import pytest
import torch

from labkit.data import sample_prompts
from labkit.engine import EngineConfig, LLMEngine, SamplingParams
from labkit.engine.sampling import SampledTokens
from labkit.experiments.batching import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

LENS_IN = [5, 40, 23, 11, 31, 17, 3, 29]
MAX_TOKENS = [10, 4, 12, 1, 7, 9, 15, 6]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    """Eight prompts of 3..40 tokens, and two more sharing a 24-token prefix with the second (prefix caching)."""
    _, tok = tiny_model
    ps = sample_prompts(tok, 10, 40, seed=3)
    return [p[:n] for p, n in zip(ps, LENS_IN)] + [ps[1][:24] + ps[8][:9], ps[1][:24] + ps[9][:3]]


@pytest.fixture(scope="module")
def params(tiny_model, prompts):
    """Mixed ``max_tokens``; two stop tokens taken from the greedy outputs (so requests do stop on them, some before
    ``max_tokens``); every third request sampled (temperature, top-k, top-p), seeded by its params or by the engine."""
    model, tok = tiny_model
    greedy = LLMEngine(model, tok).generate(prompts[:3], SamplingParams(max_tokens=12, ignore_eos=True),
                                            progress=False)
    stop = (greedy[0].output_token_ids[3], greedy[2].output_token_ids[5])
    out = []
    for i in range(len(prompts)):
        sampled = i % 3 == 1
        out.append(SamplingParams(max_tokens=(MAX_TOKENS + [8, 11])[i], stop_token_ids=stop,
                                  temperature=0.8 if sampled else 0.0, top_k=20 if i % 2 else 0,
                                  top_p=0.9 if i == 4 else 1.0, seed=i if i < 5 else None))
    return out


def run(model, tok, prompts, params, engine=None, **kw):
    """Serve ``prompts`` online on ``engine`` (default: a new one of ``kw``): every request queued, ``step`` until
    done, the block bookkeeping checked after every step. Returns the engine and each request's streamed tokens, and
    asserts that the run left the cache as it found it (``assert_clean``)."""
    engine = engine or LLMEngine(model, tok, **kw)
    engine.reset()
    free = engine.cache.allocator.num_free
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    streamed: dict[int, list[int]] = {}
    reserved = () if engine.runner.scratch_block is None else (engine.runner.scratch_block,)
    while engine.has_unfinished():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out.token_id)
        engine.scheduler.check_invariants(reserved)
    assert_clean(engine, streamed, free)
    return engine, streamed


def results(engine) -> list[tuple]:
    return [(o.request_id, o.output_token_ids, o.finish_reason) for o in engine.outputs()]


def assert_clean(engine, streamed, free: int) -> None:
    """``free`` blocks free again, nothing held, every output what was streamed (no placeholder left in a result)."""
    assert engine.cache.allocator.num_free == free
    assert not engine.has_unfinished() and not any(s.block_table for s in engine.seqs.values())
    if engine.scheduler.swap is not None:
        assert engine.scheduler.swap.allocator.num_used == 0
    for o in engine.outputs():
        assert o.output_token_ids == streamed.get(o.request_id, []) and min(o.output_token_ids, default=0) >= 0


CONFIGS = {
    "continuous_chunked": dict(max_num_seqs=4, max_num_batched_tokens=16),
    # 14 blocks of 4 = 56 slots for requests of up to 43 KV tokens each: preemption
    "recompute": dict(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=32),
    "swap": dict(num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, preemption_mode="swap"),
    "prefix_cache": dict(enable_prefix_caching=True, block_size=4, max_num_seqs=2, max_num_batched_tokens=24),
    "fifo": dict(scheduler="fifo"),
    "static": dict(scheduler="static", static_batch_size=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_equals_sync(tiny_model, prompts, params, name):
    model, tok = tiny_model
    got = {}
    for overlap in (False, True):
        engine, _ = run(model, tok, prompts, params, async_scheduling=overlap, **CONFIGS[name])
        got[overlap] = results(engine), engine.run_stats()
    (sync, s0), (overlap, s1) = got[False], got[True]
    assert overlap == sync
    reasons = {r for _, _, r in sync}
    assert reasons == {"stop", "length"}  # the workload exercises both stop conditions
    assert s1["output_tokens"] == s0["output_tokens"] == sum(len(t) for _, t, _ in sync)
    assert s0["discarded_tokens"] == 0
    if name in ("recompute", "swap"):
        assert s0["preemptions"] > 0 and s1["preemptions"] > 0
    if name == "swap":
        assert s1["swapped_out_blocks"] > 0
    if name == "prefix_cache":
        assert s1["prefix_hit_tokens"] >= 24
    if name == "continuous_chunked":  # a stop found one step late: the request was already in the next step
        assert s1["discarded_tokens"] > 0


def test_async_greedy_equals_hf_generate(tiny_model, prompts):
    """Greedy, EOS ignored, an oversubscribed cache (recompute): token for token HF ``generate``'s output."""
    model, tok = tiny_model
    ps = prompts[:6]
    engine, _ = run(model, tok, ps, [SamplingParams(max_tokens=8, ignore_eos=True)] * 6, async_scheduling=True,
                    **CONFIGS["recompute"])
    assert [t for _, t, _ in results(engine)] == [hf_greedy(model, p, 8) for p in ps]
    assert engine.run_stats()["preemptions"] > 0


def test_length_limit_is_not_scheduled_again(tiny_model, prompts):
    """A request whose pending token is its last is never scheduled again: with overlap, the computed tokens equal
    those without (every prompt token once, each output token but the last once)."""
    model, tok = tiny_model
    counts = []
    for overlap in (False, True):
        engine, _ = run(model, tok, prompts[:4], [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 5, 2, 7)],
                        async_scheduling=overlap)
        st = engine.run_stats()
        counts.append((st["prefill_tokens"], st["decode_tokens"], st["discarded_tokens"]))
    assert counts[0] == counts[1] == (sum(len(p) for p in prompts[:4]), 0 + 4 + 1 + 6, 0)


def test_abort_mid_run(tiny_model, prompts, params):
    """Abort one running request (with overlap its token is in flight then) and one still queued, mid-run: the same
    aborted set both ways; the others' outputs equal a run without aborts; an aborted one's output is what it
    streamed, a prefix of its output without the abort; every block comes back."""
    model, tok = tiny_model
    reference, _ = run(model, tok, prompts, params)
    ref = {rid: toks for rid, toks, _ in results(reference)}
    got = []
    for overlap in (False, True):
        engine = LLMEngine(model, tok, max_num_seqs=3, max_num_batched_tokens=48, async_scheduling=overlap)
        engine.reset()
        free = engine.cache.allocator.num_free
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        streamed: dict[int, list[int]] = {}
        for _ in range(4):
            for out in engine.step():
                streamed.setdefault(out.request_id, []).append(out.token_id)
        running, queued = engine.seqs[ids[2]], engine.seqs[ids[9]]
        assert running in engine.scheduler.running and queued in engine.scheduler.waiting
        assert running.num_pending == overlap  # with overlap its next token is on the (simulated) device
        assert engine.abort_request(ids[2]) and engine.abort_request(ids[9])
        while engine.has_unfinished():
            for out in engine.step():
                streamed.setdefault(out.request_id, []).append(out.token_id)
        assert_clean(engine, streamed, free)
        outs = results(engine)
        aborted = {rid for rid, _, r in outs if r == "abort"}
        assert aborted == {ids[2], ids[9]}
        assert all(toks == ref[rid] for rid, toks, _ in outs if rid not in aborted)
        assert ref[ids[2]][:len(streamed[ids[2]])] == streamed[ids[2]] and ids[9] not in streamed
        got.append(aborted)
    assert got[0] == got[1]


def test_reset_with_abort_mid_run_leaves_a_clean_engine(tiny_model, prompts, params):
    model, tok = tiny_model
    engine = LLMEngine(model, tok, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=True)
    engine.reset()
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    for _ in range(3):
        engine.step()
    with pytest.raises(RuntimeError, match="requests are still unfinished"):
        engine.reset()
    engine.reset(abort=True)
    assert engine.cache.allocator.num_free == engine.scheduler.usable_blocks and not engine.has_unfinished()
    again = engine.generate(prompts[:3], params[:3], progress=False)
    ref = LLMEngine(model, tok).generate(prompts[:3], params[:3], progress=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in ref]


def test_step_that_raises_fails_one_request(tiny_model, prompts):
    """A step that raises whenever request 2 has work past its second token (with overlap: at launch, its second
    token still in flight): request 2 ends with an error and the same two tokens both ways, the others complete
    with the same tokens; a prompt with an id outside the vocabulary fails at its prefill alone."""
    model, tok = tiny_model
    greedy = [SamplingParams(max_tokens=6, ignore_eos=True)] * 6
    got = []
    for overlap in (False, True):
        engine = LLMEngine(model, tok, max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=overlap)
        real = engine.runner.execute

        def failing(seqs, num_tokens, num_decode, engine=engine, real=real, **kw):
            if engine.seqs[2] in seqs and engine.seqs[2].num_output_tokens >= 2:
                raise RuntimeError("kernel fault on request 2")
            return real(seqs, num_tokens, num_decode, **kw)

        engine.runner.execute = failing
        engine.reset()
        free = engine.cache.allocator.num_free
        for p, sp in zip(prompts[:6], greedy):
            engine.add_request(p, sp)
        engine.seqs[4].token_ids[1] = engine.vocab_size + 5  # behind the checks' back: its prefill raises
        streamed: dict[int, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                streamed.setdefault(out.request_id, []).append(out.token_id)
        assert_clean(engine, streamed, free)
        outs = engine.outputs()
        assert [o.finish_reason for o in outs] == ["length", "length", "error", "length", "error", "length"]
        assert "kernel fault on request 2" in outs[2].error and "IndexError" in outs[4].error
        assert len(outs[2].output_token_ids) == 2 and not outs[4].output_token_ids
        got.append(results(engine))
    assert got[0] == got[1]


# --- a simulated device: the overlap's timing, on the CPU ------------------------------------------------------------
class SimEvent:
    """A CUDA event of the simulated device: ``synchronize`` sleeps until the device reaches it."""

    def __init__(self, at: float):
        self.at = at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


class SimDevice:
    """One stream of a device that takes ``device_s`` per forward: a launch returns at once, its work starts when the
    previous step's ends (or now) and ends ``device_s`` later; the sampled tokens are 'ready' then (``SimEvent``).
    The logits are a deterministic function of each sequence's last input id and position (placeholders resolved:
    a wrong gather changes the tokens)."""

    def __init__(self, device_s: float, vocab: int):
        self.device_s, self.vocab, self.busy_until = device_s, vocab, 0.0

    def forward(self, inp):
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.device_s
        rows = inp.logits_indices.long()
        ids, pos = inp.input_ids[rows], inp.positions[rows]
        assert (ids >= 0).all(), "a placeholder input id reached the forward"
        logits = torch.zeros(len(rows), self.vocab)
        logits[torch.arange(len(rows)), (ids * 7 + pos * 13 + 5) % (self.vocab - 3) + 3] = 1.0
        return logits

    def start(self, tokens):  # SampledTokens.start on the simulated device
        return SampledTokens(tokens, tokens, SimEvent(self.busy_until))


def test_overlap_hides_the_shorter_of_host_and_device(tiny_model, prompts, monkeypatch):
    """Each step: ``host_s`` of extra host work while scheduling, ``device_s`` of device time. Without overlap the
    steps take host + device each; with it about max(host, device): over 20 decode steps, under 0.8x the serial
    time, and never under the device's own time. The tokens are the same."""
    model, tok = tiny_model
    host_s = device_s = 0.010
    steps, got, walls = 20, [], []
    for overlap in (False, True):
        engine = LLMEngine(model, tok, max_num_seqs=8, async_scheduling=overlap)
        dev = SimDevice(device_s, engine.vocab_size)
        engine.runner.forward = dev.forward
        engine.to_host = dev.start
        schedule = engine.scheduler.schedule

        def busy_schedule(schedule=schedule):
            time.sleep(host_s)  # the host's share of the step (scheduling, inputs, ...) made measurable
            return schedule()

        engine.scheduler.schedule = busy_schedule
        engine.reset()
        for p in prompts[:8]:
            engine.add_request(p, SamplingParams(max_tokens=steps + 6, ignore_eos=True))
        for _ in range(3):  # the prefill, and the pipeline filled
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        walls.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
        got.append(results(engine))
    assert got[0] == got[1] and all(len(t) == steps + 6 for _, t, _ in got[0])
    serial, overlapped = walls
    assert serial >= steps * (host_s + device_s)
    assert steps * device_s * 0.95 <= overlapped < 0.8 * serial, (serial, overlapped)


def test_async_on_host_graphs_equals_sync(tiny_model, prompts, monkeypatch):
    """Decode steps replayed from the CPU stand-in of CUDA graphs: the placeholders are filled in the graphs' static
    input buffer before each replay (a graph would replay whatever the buffer holds)."""
    from test_engine_cuda_graph import HostGraphs  # the stand-in for torch.cuda.CUDAGraph (same folder)

    model, tok = tiny_model
    got = []
    for overlap in (False, True):
        engine = LLMEngine(model, tok, kernels="torch", cuda_graphs=False, max_num_seqs=4, max_num_batched_tokens=64,
                           num_blocks=24, max_model_len=64, async_scheduling=overlap)
        engine.runner.graphs = HostGraphs(engine.runner, [1, 2, 4], monkeypatch)
        run(model, tok, prompts[:5], [SamplingParams(max_tokens=5, ignore_eos=True)] * 5, engine=engine)
        assert engine.stats.graph_steps > 0
        got.append(results(engine))
    assert got[0] == got[1] == [(i, hf_greedy(model, p, 5), "length") for i, p in enumerate(prompts[:5])]


def test_bad_flag_is_refused():
    with pytest.raises(ValueError, match="async_scheduling='yes' must be True or False"):
        EngineConfig(async_scheduling="yes")


# --- CUDA ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_async_equals_sync_on_cuda_with_graphs():
    """The engine's CUDA defaults (embedded model, fp32, Triton kernels, decode and mixed-step CUDA graphs), an
    oversubscribed cache, stop tokens and seeded sampling: the same tokens and finish reasons with and without
    overlap, steps replayed in both, every block back."""
    from labkit.model import load_model

    model, tok = load_model(device="cuda")
    ps = sample_prompts(tok, 12, 60, seed=5)
    ps = [p[:n] for p, n in zip(ps, (7, 60, 33, 12, 45, 3, 27, 51, 19, 38, 9, 24))]
    greedy = LLMEngine(model, tok).generate(ps[:2], SamplingParams(max_tokens=12, ignore_eos=True), progress=False)
    stop = (greedy[0].output_token_ids[4], greedy[1].output_token_ids[7])
    params = [SamplingParams(max_tokens=6 + 3 * (i % 5), stop_token_ids=stop, temperature=0.7 * (i % 3 == 2),
                             top_k=30 * (i % 2), seed=i) for i in range(len(ps))]
    got = []
    for overlap in (False, True):
        engine, _ = run(model, tok, ps, params, num_blocks=20, block_size=16, max_num_seqs=8,
                        max_num_batched_tokens=64, async_scheduling=overlap)
        st = engine.run_stats()
        assert engine.runner.graphs is not None and st["graph_steps"] > 0 and st["preemptions"] > 0
        got.append(results(engine))
    assert got[0] == got[1]


@pytest.mark.gpu
def test_async_launch_never_waits_for_the_device():
    """After a warm-up run (Triton autotuning happens there), every launch of a run with overlap (inputs to the device,
    placeholder gather, graph replay or eager forward, sampling, the copy of the tokens to the host) queues its work
    without a synchronising CUDA call: torch's sync debug mode set to 'error' around each launch raises on one."""
    from labkit.model import load_model

    model, tok = load_model(device="cuda")
    ps = sample_prompts(tok, 6, 40, seed=6)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.5 * (i % 2), top_p=0.9, seed=i)
              for i in range(len(ps))]
    engine = LLMEngine(model, tok, max_num_seqs=8, async_scheduling=True)
    engine.generate(ps, params, progress=False)
    launch, errors = engine._launch, []

    def strict(batch, sampled=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch, sampled)
        except RuntimeError as e:
            errors.append(f"{len(batch.seqs)} sequences, {batch.num_decode} decodes, {batch.total_tokens} tokens: {e}")
            raise
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine._launch = strict
    outs = engine.generate(ps, params, progress=False)
    assert not errors, errors[0]
    assert all(o.finish_reason == "length" for o in outs) and engine.stats.graph_steps > 0


@pytest.mark.gpu
def test_sampled_tokens_reach_the_host_through_pinned_memory():
    tokens = torch.arange(5, device="cuda") * 3
    st = SampledTokens.start(tokens)
    assert st.host.is_pinned() and st.event is not None and st.tolist() == [0, 3, 6, 9, 12]
