"""The serving benchmark (``labkit.bench.serving``): a workload's arrivals replayed against ``LLMEngine.step`` on a
virtual or real clock lent to the engine, per-request metrics from the engine's timestamps, step times measured from
outside; every request checked before anything runs; the SLO metrics."""

import pytest
import torch

from labkit.bench.serving import SLO, percentile, serve, summarize
from labkit.bench.workload import LengthDist, RequestSpec, make_workload
from labkit.data import sample_prompts
from labkit.engine import LLMEngine, RequestMetrics

pytestmark = pytest.mark.usefixtures("one_thread")


def test_serve_poisson_workload_metrics(tiny_model):
    model, _ = tiny_model
    source = torch.arange(100, 5000)
    wl = make_workload(8, 40.0, LengthDist.uniform(4, 20), LengthDist.exponential(5, low=1, high=9), source, seed=2)
    streamed = []
    engine = LLMEngine(model, scheduler="fifo")
    fifo = serve(engine, wl, on_token=streamed.append, progress=False)
    assert engine.clock is not None and not hasattr(engine.clock, "wait_until")  # the run's clock was only lent
    by_id = {m.request_id: m for m in fifo.metrics}
    assert len(streamed) == sum(r.max_new_tokens for r in wl) == sum(m.output_tokens for m in fifo.metrics)
    order = sorted(wl, key=lambda r: r.arrival_s)
    for a, b in zip(order, order[1:]):  # one at a time, in arrival order
        assert by_id[b.request_id].first_token_s > by_id[a.request_id].finish_s
    for r in wl:
        m = by_id[r.request_id]
        assert m.arrival_s == r.arrival_s and 0 < m.ttft_s <= m.e2e_s and m.output_tokens == r.max_new_tokens
        assert m.token_times_s == sorted(m.token_times_s)
    s = fifo.stats
    assert s["clock"] == "virtual" and 0 < s["busy_frac"] <= 1 + 1e-9 and s["busy_s"] == pytest.approx(sum(s["step_s"]))
    assert len(s["step_s"]) == s["steps"]
    cont = serve(LLMEngine(model, max_num_seqs=8, max_num_batched_tokens=32), wl, clock="real", progress=False)
    assert cont.stats["clock"] == "real" and [o.output_token_ids for o in cont.outputs] == \
        [o.output_token_ids for o in fifo.outputs]


def test_serve_with_async_scheduling(tiny_model):
    """With ``async_scheduling`` (no device sync after a step: it would undo the overlap) the same tokens come out,
    each request's times in order."""
    model, _ = tiny_model
    wl = make_workload(8, 40.0, LengthDist.uniform(4, 20), LengthDist.exponential(5, low=1, high=9),
                       torch.arange(100, 5000), seed=3)
    res = [serve(LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=overlap), wl,
                 progress=False) for overlap in (False, True)]
    assert [o.output_token_ids for o in res[1].outputs] == [o.output_token_ids for o in res[0].outputs]
    for m in res[1].metrics:
        assert 0 < m.ttft_s <= m.e2e_s and m.token_times_s == sorted(m.token_times_s)


def test_serve_checks_the_whole_workload_before_running(tiny_model):
    model, tok = tiny_model
    prompts = [p[: 3 + i] for i, p in enumerate(sample_prompts(tok, 6, 12, seed=4))]
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=64)
    wl = [RequestSpec(i, 0.01 * i, tuple(p), 3) for i, p in enumerate(prompts)]
    bad = [*wl[:3], RequestSpec(3, 0.03, (1, 9000, 2), 3), *wl[4:]]
    streamed = []
    with pytest.raises(ValueError, match=r"request 3: prompt\[1\] is 9000"):
        serve(engine, bad, on_token=streamed.append, progress=False)
    assert not streamed and not engine.has_unfinished() and engine.cache.allocator.num_used == 0  # nothing ran
    with pytest.raises(ValueError, match="request ids repeat"):
        serve(engine, [*wl, wl[0]], progress=False)
    with pytest.raises(TypeError, match="params='greedy'"):
        serve(engine, wl, params="greedy", progress=False)
    with pytest.raises(ValueError, match="clock='wall' is unknown"):
        serve(engine, wl, clock="wall", progress=False)
    res = serve(engine, wl, progress=False)
    assert len(res.outputs) == 6 and all(o.ok for o in res.outputs)


def test_slo_metrics():
    ms = [RequestMetrics(i, 0.0, 0.1 * (i + 1), 0.1 * (i + 1) + 0.05 * 4, 10, 5) for i in range(4)]
    s = summarize(ms, SLO(ttft_s=0.25, tpot_s=0.06))
    assert s["requests"] == 4 and s["slo_attained_frac"] == 0.5 and s["tpot_p50_s"] == pytest.approx(0.05)
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([], 99) != percentile([], 99)  # NaN
    with pytest.raises(ValueError, match="metrics is empty"):
        summarize([])
