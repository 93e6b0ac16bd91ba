"""labkit.bench.schedules: the schedules of labkit.parallel timed region by region from outside; their structure
(in-flight micro-batches, activation memory) measured on 2 gloo ranks. No speed is asserted: timings only have to be
well formed."""

import pytest

from labkit.bench.schedules import ScheduleStats
from labkit.experiments.parallelism import pp_bubble
from labkit.parallel import launch


def test_stats_arithmetic():
    st = ScheduleStats(0, 2, 2, events=[("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0)], total_s=3.0)
    assert st.busy_s == 2.0 and st.bubble == pytest.approx(1 / 3)


@pytest.mark.distributed
def test_schedule_structure_on_two_stages():
    out = launch(pp_bubble, 2, [1, 3], microbatch_size=1, seq_len=8, repeats=1, backend="gloo", timeout_s=180)
    p = 2
    for res in out:
        rows = {(r["kind"], r["m"]): r for r in res["rows"]}
        s = res["rank"]
        for m in (1, 3):
            assert rows["train_gpipe", m]["peak_inflight"] == m  # all forwards before any backward
            assert rows["train_1f1b", m]["peak_inflight"] == min(p - s, m)
            for kind in ("forward", "train_gpipe", "train_1f1b"):
                r = rows[kind, m]
                assert 0.0 <= r["bubble"] < 1.0 and r["total_s"] > 0
                assert sum(1 for e in r["events"] if e[0] == "F") == m
        # equal micro-batches save equal activations: 1F1B's peak is (p - s) of GPipe's m
        per_mb = rows["train_gpipe", 3]["peak_activation_bytes"] / 3
        assert per_mb > 0
        assert rows["train_1f1b", 3]["peak_activation_bytes"] == pytest.approx(min(p - s, 3) * per_mb)
