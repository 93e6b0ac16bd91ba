"""labkit.parallel.schedules: the bubble formula and the schedules' arguments (their structure, measured from outside
on 2 gloo ranks: tests/test_bench_schedules.py)."""

import pytest

from labkit.parallel.schedules import bubble_formula, pipeline_train_step


def test_bubble_formula():
    assert bubble_formula(1, 5) == 0.0
    assert bubble_formula(2, 1) == pytest.approx(0.5)
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="must be >= 1"):
        bubble_formula(2, 0)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="allowed: \\('gpipe', '1f1b'\\)"):
        pipeline_train_step(None, None, 2, schedule="interleaved")
