"""labkit.experiments.parallelism.report: joining per-rank pipeline rows, alpha-beta fits per op, plots (on
synthetic rows)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.experiments.parallelism import bubble_table, comm_fits, plot_comm, plot_schedule_timeline  # noqa: E402


def _rank(rank, bubble, busy, total, act):
    row = {"kind": "forward", "m": 2, "bubble": bubble, "busy_s": busy, "total_s": total, "peak_inflight": 1,
           "peak_activation_bytes": act, "events": [("F", 0, 0.0, 0.001), ("F", 1, 0.001, 0.002)]}
    return {"rank": rank, "rows": [row]}


def test_bubble_table_joins_stages():
    rows = bubble_table([_rank(0, 0.2, 0.8, 1.0, 10), _rank(1, 0.4, 0.6, 1.1, 30)])
    assert rows == [{"kind": "forward", "stages": 2, "m": 2, "bubble_measured": pytest.approx(0.3),
                     "bubble_per_stage": [0.2, 0.4], "bubble_formula": pytest.approx(1 / 3), "total_s": 1.1,
                     "busy_per_stage_s": [0.8, 0.6], "peak_inflight_per_stage": [1, 1],
                     "peak_activation_bytes": 30}]
    bad = _rank(1, 0.4, 0.6, 1.1, 30)
    bad["rows"][0]["m"] = 4
    with pytest.raises(ValueError, match="not aligned"):
        bubble_table([_rank(0, 0.2, 0.8, 1.0, 10), bad])


def test_comm_fits_and_plots():
    rows = [{"op": "all_reduce", "bytes": b, "seconds": 50e-6 + b / 2e9} for b in (64, 4096, 2**20, 2**22)]
    rows += [{"op": "send_recv", "bytes": b, "seconds": s} for b, s in ((64, 2e-3), (4096, 1e-3))]  # no fit
    fits = comm_fits(rows)
    assert fits["all_reduce"]["alpha_us"] == pytest.approx(50, rel=1e-6)
    assert fits["all_reduce"]["beta_gb_s"] == pytest.approx(2, rel=1e-6)
    assert "error" in fits["send_recv"]
    fig, (a, b) = plt.subplots(1, 2)
    plot_comm(rows, fits, a)
    plot_schedule_timeline([_rank(0, 0.2, 0.8, 1.0, 10), _rank(1, 0.4, 0.6, 1.1, 30)], "forward", 2, b)
    assert len(a.get_lines()) == 3 and len(b.patches) == 4
    plt.close(fig)


def test_case_175b_text_is_rendered_from_the_planners_cost_model():
    from labkit.experiments.parallelism.report import case_175b_text
    from labkit.plan import MULTI_GPU_CAVEAT, SCENARIO_175B, recommend, worked_example_175b

    rec = recommend(SCENARIO_175B)
    text = case_175b_text(batch=32, context=2048, rec=rec)
    tp8 = next(r for r in worked_example_175b("h200", 32, 2048) if r["layout"] == "TP8 x PP1")
    assert f"holds {tp8['weights_gb']:.0f} GB of weights per GPU" in text
    assert f"a {tp8['step_s'] * 1e3:.0f} ms step on the H200" in text and MULTI_GPU_CAVEAT in text
    assert "On 80 GB H100s that does not fit" in text and "H200s it fits" in text
    assert "193 all-reduces" in text  # 2 per layer x 96 layers + the embedding's
    assert f"{rec.best.decode_step_ms:.0f} ms, not the {tp8['step_s'] * 1e3:.0f} ms above" in text
    small = case_175b_text(batch=8, context=128)  # a small KV cache fits both cards: no advice to shrink it
    assert "would have to shrink" not in small and "planner's pick" not in small
