"""The notebook's measurement helpers on the embedded model at toy sizes: rows have the promised fields and
consistent counts; the offline comparison with HF measured whole on both sides; no speed is asserted."""

import json
import math

import pytest
import torch

from labkit.bench.serving import SLO
from labkit.bench.workload import LengthDist, make_workload
from labkit.engine import RequestMetrics
from labkit.experiments.batching import (
    check_greedy_vs_hf,
    decode_rate,
    fifo_executions,
    fifo_sweep,
    runner_step,
    serve_sweep,
    token_gaps,
)
from labkit.experiments.batching.cli import main as bench_main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_gaps():
    m = RequestMetrics(0, 0.0, 1.0, 2.5, 3, 3, [1.0, 1.5, 2.5])
    assert token_gaps([m, RequestMetrics(1, 0.0, 1.0, 1.0, 3, 1, [1.0])]) == [0.5, 1.0]


def test_fifo_executions_from_a_queued_run():
    ms = [RequestMetrics(1, 0.0, 0.5, 1.0, 4, 2, [0.5, 1.0]), RequestMetrics(0, 0.0, 1.2, 1.5, 4, 3, [1.2, 1.4, 1.5])]
    ex = fifo_executions(type("R", (), {"metrics": ms})())
    assert ex[1].token_times_s == [0.5, 1.0] and ex[1].total_s == 1.0
    assert ex[0].token_times_s == pytest.approx([0.2, 0.4, 0.5]) and ex[0].total_s == pytest.approx(0.5)


def test_fifo_sweep_replays_the_measured_services(tiny_model):
    model, _ = tiny_model
    wl = make_workload(4, 1.0, LengthDist.uniform(3, 9), LengthDist.exponential(3, high=5), torch.arange(50, 900),
                       seed=4)
    rows, capacity = fifo_sweep(model, wl, [0.25, math.inf], slo=SLO(10.0, 10.0), warmup=True)
    slow, queued = rows
    assert queued["busy_frac"] == pytest.approx(1.0) and queued["requests_s"] == pytest.approx(capacity)
    assert slow["rate_req_s"] == pytest.approx(0.25 * capacity) and slow["busy_frac"] < 1
    assert slow["ttft_p50_s"] < queued["ttft_p50_s"] and slow["output_tokens"] == queued["output_tokens"]


def test_offline_comparison_measures_every_request_on_both_sides(tiny_model):
    """HF in each mode and the engine serve the same whole workload (no extrapolation); the headline ratio is over
    the best HF mode, each mode's ratio a footnote."""
    from labkit.experiments.baseline import offline_speedups, offline_throughput

    model, _ = tiny_model
    wl = make_workload(4, 2.0, LengthDist.uniform(3, 9), LengthDist.uniform(2, 5), torch.arange(100, 3000), seed=2)
    rows = offline_throughput(model, wl, 2, dict(max_num_seqs=4, max_model_len=32), ("eager", "static"),
                              progress=False)
    assert [r["mode"] for r in rows] == ["eager", "static", "engine"]
    assert all(r["requests"] == 4 and r["seconds"] > 0 for r in rows)
    s = offline_speedups(rows)
    engine = rows[-1]["output_tok_s"]
    assert s["eager"] == pytest.approx(engine / rows[0]["output_tok_s"])
    assert s["best"] == min(s["eager"], s["static"])  # the strongest baseline gives the smallest ratio
    with pytest.raises(ValueError, match="no HF mode"):
        offline_speedups(rows[-1:])


def test_warm_up_runs_a_few_steps_of_a_long_call(tiny_model):
    """HF sizes (and compiles) for the longest batch while only a few decode steps run."""
    from labkit.experiments.baseline import warm_up

    model, _ = tiny_model
    calls = []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        warm_up(model, [(5, 6, 7), (8, 9)], 200, mode="static", steps=4)
    finally:
        del model.forward
    assert len(calls) == 4  # the prefill and three decode steps, not two hundred
    with pytest.raises(ValueError, match="mode='fast'"):
        warm_up(model, [(5,)], 4, mode="fast")


def test_greedy_check_decode_rate_and_sweep(tiny_model):
    model, tok = tiny_model
    source = torch.arange(100, 6000)
    prompts = [list(range(200, 213)), list(range(300, 305))]
    rows = check_greedy_vs_hf(model, prompts, 4, {"fifo": dict(scheduler="fifo"),
                                                   "continuous": dict(max_num_seqs=2, max_num_batched_tokens=8)})
    assert [r["all_equal"] for r in rows] == [True, True] and rows[1]["max_batch"] == 2
    r = decode_rate(model, 2, 9, 3, source)
    assert r["tok_s"] > 0 and r["replay_step_s"] is None and not r["cuda_graphs"] and r["kernels"] == "torch"
    assert r["graph_step_frac"] == 0  # no graphs on the CPU: every timed step eager
    wl = make_workload(5, 1.0, LengthDist.uniform(3, 12), LengthDist.exponential(3, high=6), source, seed=1)
    rows = serve_sweep(model, wl, {"fifo": dict(scheduler="fifo"), "static": dict(scheduler="static",
                                                                                   static_batch_size=2)},
                       [5.0, math.inf], slo=SLO(10.0, 10.0), progress=False, warmup=True)  # (CPU: forced)
    assert [(r["policy"], r["rate_req_s"]) for r in rows] == [("fifo", 5.0), ("fifo", math.inf), ("static", 5.0),
                                                               ("static", math.inf)]
    for row in rows:
        assert row["requests"] == 5 and row["output_tokens"] == sum(w.max_new_tokens for w in wl)
        assert row["slo_attained_frac"] == 1.0 and 0 < row["busy_frac"] <= 1 + 1e-9
        assert row["peak_kv_bytes"] <= row["kv_capacity_bytes"]
    assert rows[1]["mean_batch"] == 1 and rows[3]["mean_batch"] > 1


def test_bench_cli_writes_records(tmp_path):
    args = ["--num-requests", "3", "--prompt-len", "6", "--prompt-max", "20", "--output-mean", "3", "--output-max",
            "5", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--out", str(tmp_path), "--no-progress",
            "--device", "cpu"]
    assert bench_main(["serve", "--rate", "3", "inf", *args]) == 0
    rec = json.loads((tmp_path / "records" / "bench_serve.json").read_text())
    assert len(rec["data"]["rows"]) == 6 and rec["env"]["device"] == "cpu"
    assert bench_main(["decode", "--batch", "1", "2", "--context", "8", "--steps", "3", "--out", str(tmp_path),
                       "--device", "cpu"]) == 0
    rows = json.loads((tmp_path / "records" / "bench_decode.json").read_text())["data"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["mbu"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="--num-requests=0 must be >= 1"):
        bench_main(["serve", "--num-requests", "0"])
    with pytest.raises(SystemExit):
        bench_main(["serve", "--scheduler", "lifo"])


def test_runner_step_decode_and_prefill(tiny_model):
    """The step-sweep's unit of work: a decode step over a cache filled without a prefill, and one prefill; each
    call recomputes the same step (same logits), nothing is allocated past the cache."""
    model = tiny_model[0]
    vocab = model.config.vocab_size
    step, runner = runner_step(model, "decode", 3, 37)
    first = step().clone()
    assert first.shape == (3, vocab) and torch.isfinite(first).all()
    assert torch.equal(step(), first) and runner.cache.allocator.num_free <= 1  # (CUDA: the graphs' scratch)
    assert runner.cache.allocator.num_used >= 3 * runner.cache.blocks_for(38)  # 3 sequences of 37 + 1 tokens
    step, runner = runner_step(model, "prefill", 1, 21)
    out = step()
    assert out.shape == (1, vocab) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="phase"):
        runner_step(model, "verify", 1, 8)
    with pytest.raises(ValueError, match="batch_size 1 for prefill"):
        runner_step(model, "prefill", 2, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_rate_times_the_replayed_step_on_cuda(overlap):
    """With CUDA graphs the captured decode step of the batch is also timed alone (``replay_step_s``, what
    ``engine.decode_b{b}_host_frac`` divides by): it once called ``StepGraphs.replay``, which no longer exists. With
    async scheduling too, the row saying which mode it measured."""
    from labkit.model import load_model

    r = decode_rate(load_model(device="cuda")[0], 3, 16, 4, torch.arange(100, 6000), async_scheduling=overlap)
    assert r["cuda_graphs"] and 0 < r["replay_step_s"] < r["step_median_s"] * 10 and r["async_scheduling"] == overlap
    assert r["graph_step_frac"] == 1  # every timed decode step of 3 sequences replayed the graph of 4


def test_bench_decode_runs_both_scheduling_modes(tmp_path):
    """``--async-scheduling both``: each batch decoded without and with overlap in one run, the figures of the second
    suffixed ``_async`` and their ratio recorded."""
    assert bench_main(["decode", "--batch", "2", "--context", "8", "--steps", "3", "--no-hf", "--kernels", "torch",
                       "--async-scheduling", "both", "--figures", "--out", str(tmp_path), "--device", "cpu"]) == 0
    rows = json.loads((tmp_path / "records" / "bench_decode.json").read_text())["data"]["rows"]
    assert [(r["batch"], r["async_scheduling"]) for r in rows] == [(2, False), (2, True)]
    figs = json.loads((tmp_path / "figures.json").read_text())
    assert {"engine.decode_b2_mbu", "engine.decode_b2_mbu_async", "engine.decode_b2_async_speedup"} <= set(figs)
    assert figs["engine.decode_b2_async_speedup"]["value"] > 0


def test_bench_decode_profile_writes_the_attribution(tmp_path):
    """``--profile``: each batch's row carries where its step's time went (parts, gaps, floors), the profile itself
    not written; with ``--figures`` the gap share and the GEMMs' and attention's floor fractions per batch."""
    assert bench_main(["decode", "--batch", "2", "--context", "8", "--steps", "3", "--no-hf", "--kernels", "torch",
                       "--profile", "--profile-steps", "2", "--figures", "--out", str(tmp_path), "--device",
                       "cpu"]) == 0
    rows = json.loads((tmp_path / "records" / "bench_decode.json").read_text())["data"]["rows"]
    att = rows[0]["attribution"]
    assert "profile" not in rows[0] and att["batch"] == 2 and att["steps_profiled"] == 2
    assert [r["part"] for r in att["parts"]][-1] == "gaps" and att["bandwidth_bytes_per_s"] > 0
    assert sum(r["us_per_step"] for r in att["parts"]) == pytest.approx(att["step_us"])
    figs = json.loads((tmp_path / "figures.json").read_text())
    assert {"engine.decode_b2_gap_frac", "engine.decode_b2_gemm_floor_frac", "engine.decode_b2_attn_floor_frac"} \
        <= set(figs)
    with pytest.raises(SystemExit):
        bench_main(["decode", "--profile", "--profile-steps", "0"])


def test_host_frac_is_one_formula_in_both_modes(tmp_path):
    """``engine.decode_b{b}_host_frac`` and its ``_async`` twin: 1 - (the captured step replayed alone) / (the step
    end to end), whatever the mode measured."""
    from labkit.experiments.batching.decode_figures import decode_figures

    row = dict(batch=64, context=520, mbu=0.5, replay_step_s=0.006, step_median_s=0.008, graph_pool_bytes=1e6)
    sync = decode_figures([row], None, tmp_path)
    overlap = decode_figures([dict(row, step_median_s=0.0065)], None, tmp_path, "_async")
    assert sync["engine.decode_b64_host_frac"]["value"] == pytest.approx(0.25)
    assert overlap["engine.decode_b64_host_frac_async"]["value"] == pytest.approx(1 - 0.006 / 0.0065)
    assert "engine.cuda_graph_pool_mb_b64_async" not in overlap
