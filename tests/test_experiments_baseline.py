import math

import pytest
import torch

from labkit.bench.serving import SLO, summarize
from labkit.bench.workload import LengthDist, RequestSpec, at_rate, make_workload
from labkit.engine import RequestMetrics
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


def test_generate_modes_agree_and_refuse_what_cannot_run_here(tiny_model):
    from labkit.experiments.baseline import HF_MODES, hf_modes

    model, tok = tiny_model
    prompts = [tuple(tok("The list type").input_ids), tuple(tok("Exceptions are raised when a").input_ids)]
    _, eager = run_generate(model, prompts, 5)
    ex, static = run_generate(model, prompts, 5, mode="static")
    assert static.tolist() == eager.tolist() and len(ex.token_times_s) == 5
    assert hf_modes("cpu") == ("eager", "static") and hf_modes("cuda") == tuple(HF_MODES)
    with pytest.raises(ValueError, match="mode='static\\+compile' runs on CUDA only"):
        run_generate(model, prompts, 2, mode="static+compile")
    with pytest.raises(ValueError, match="mode='jit' is unknown"):
        run_generate(model, prompts, 2, mode="jit")


def test_offline_throughput_counts_each_requests_own_tokens(tiny_model):
    from labkit.experiments.baseline import offline_throughput

    model, tok = tiny_model
    src = torch.arange(3, 500)
    wl = make_workload(5, math.inf, LengthDist.uniform(4, 9), LengthDist.uniform(2, 5), src, seed=1)
    rows = offline_throughput(model, wl, 2, dict(max_num_seqs=4, max_model_len=16), ("eager",), progress=False)
    tokens = sum(r.max_new_tokens for r in wl)
    assert [r["requests"] for r in rows] == [5, 5] and "engine" in rows[-1]["server"]
    for r in rows:
        assert r["output_tok_s"] == pytest.approx(tokens / r["seconds"])


def test_sweep_load_serves_every_request_under_each_policy(tiny_model):
    from labkit.experiments.baseline import sweep_load

    model, _ = tiny_model
    wl = make_workload(6, 1.0, LengthDist.uniform(4, 8), LengthDist.uniform(2, 4), torch.arange(3, 500), seed=2)
    rows, shares = sweep_load(model, wl, [0.5, 4.0], 2, dict(max_num_seqs=4, max_model_len=16), progress=False)
    assert sorted(shares) == ["FIFO", "continuous", "static"] and all(0 < v <= 1 for v in shares.values())
    assert len(rows) == 6 and all(r["requests"] == 6 for r in rows)
    for r in rows:
        assert 0 < r["device_busy_frac"] <= r["server_util"] <= 1
        assert r["device_busy_frac"] == pytest.approx(r["server_util"] * shares[r["policy"]])
    fifo = {r["offered_load"]: r for r in rows if r["policy"] == "FIFO"}
    assert fifo[4.0]["server_util"] > fifo[0.5]["server_util"]
