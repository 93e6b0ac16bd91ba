import math

import pytest
import torch

from labkit.engine.metrics import SLO, RequestMetrics, summarize
from labkit.engine.workload import LengthDist, RequestSpec, at_rate, make_workload
from labkit.experiments.baseline import Execution, replay_fifo, run_generate, serve_static


def test_workload_is_reproducible_and_rate_only_moves_arrivals():
    src = torch.arange(10_000)
    a = make_workload(20, 2.0, LengthDist.uniform(5, 9), LengthDist.exponential(16, high=40), src, seed=3)
    b = make_workload(20, 2.0, LengthDist.uniform(5, 9), LengthDist.exponential(16, high=40), src, seed=3)
    assert a == b
    faster = at_rate(a, 8.0, seed=3)
    assert [r.prompt_ids for r in faster] == [r.prompt_ids for r in a]
    assert faster[-1].arrival_s == pytest.approx(a[-1].arrival_s / 4)
    assert all(5 <= r.prompt_len <= 9 and 1 <= r.max_new_tokens <= 40 for r in a)
    offline = make_workload(4, math.inf, LengthDist.fixed(3), LengthDist.fixed(2), 100)
    assert all(r.arrival_s == 0 for r in offline)


def test_exponential_mean():
    x = LengthDist.exponential(128).sample(20000, torch.Generator().manual_seed(0))
    assert abs(sum(x) / len(x) - 128) < 4


@pytest.mark.parametrize("call,match", [
    (lambda: LengthDist("pareto", 3.0), "kind='pareto' is unknown"),
    (lambda: LengthDist.uniform(0, 5), "low <= high"),
    (lambda: make_workload(0, 1.0, LengthDist.fixed(2), LengthDist.fixed(2), 50), "n=0"),
    (lambda: make_workload(2, -1.0, LengthDist.fixed(2), LengthDist.fixed(2), 50), "rate=-1.0"),
    (lambda: make_workload(2, 1.0, LengthDist.fixed(20), LengthDist.fixed(2), torch.arange(10)), "does not fit"),
])
def test_workload_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _req(i, arrival, out=3):
    return RequestSpec(i, arrival, (5, 6, 7), out)


def test_fifo_queue_arithmetic():
    wl = [_req(0, 0.0), _req(1, 0.5), _req(2, 10.0)]
    ex = {i: Execution(1, [0.1, 0.2, 0.3], 1.0) for i in range(3)}
    m = {r.request_id: r for r in replay_fifo(wl, ex)}
    assert m[0].finish_s == 1.0 and m[1].first_token_s == pytest.approx(1.1)  # waited for request 0
    assert m[1].ttft_s == pytest.approx(0.6) and m[2].ttft_s == pytest.approx(0.1)
    assert m[1].tpot_s == pytest.approx((2.0 - 1.1) / 2)


def test_static_batches_wait_for_the_longest():
    wl = [_req(0, 0.0, 2), _req(1, 0.0, 5), _req(2, 0.1, 1)]
    runs = []

    def run(prompts, n):
        runs.append((len(prompts), n))
        return Execution(len(prompts), [0.1 * k for k in range(1, n + 1)], 0.1 * n)

    metrics, busy = serve_static(None, wl, batch_size=2, run=run)
    assert runs == [(2, 5), (1, 1)]
    m = {r.request_id: r for r in metrics}
    assert m[0].finish_s == m[1].finish_s == pytest.approx(0.5)
    assert m[2].first_token_s == pytest.approx(0.6) and busy == pytest.approx(0.6)
    with pytest.raises(ValueError, match="batch_size=0"):
        serve_static(None, wl, batch_size=0, run=run)


def test_summary_and_goodput():
    ms = [RequestMetrics(i, 0.0, 0.1 * (i + 1), 1.0 + i, 4, 10) for i in range(4)]
    s = summarize(ms, SLO(ttft_s=0.25, tpot_s=1.0))
    assert s["output_tok_s"] == pytest.approx(40 / 4.0)
    assert s["slo_attained_frac"] == 0.5
    with pytest.raises(ValueError, match="metrics is empty"):
        summarize([])


def test_run_generate_matches_hf_greedy(tiny_model):
    model, tok = tiny_model
    prompts = [tuple(tok("The list type").input_ids), tuple(tok("Exceptions are raised when").input_ids)]
    ex, out = run_generate(model, prompts, 6)
    assert len(ex.token_times_s) == 6 and ex.total_s >= ex.token_times_s[-1]
    for p, row in zip(prompts, out):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)[0, len(p):]
        assert row.tolist() == ref.tolist()
