"""Claims: parsing, evaluation against figures, machine classes, collection from notebook sources, the CLI."""

import json

import pytest

from labkit import claims as C
from labkit.claims import Claim, collect, evaluate

R05 = "results/h200/records/05.json"
FIGS = {
    "engine.speedup": {"value": 2.5, "unit": "x", "machine": "NVIDIA H200", "record": R05},
    "engine.tok_s": {"value": 180.0, "unit": "tok/s", "machine": "NVIDIA H200", "record": R05},
    "quant.ppl_delta": {"value": 0.012, "unit": "frac", "machine": "cpu", "record": "results/cpu/records/04.json"},
    "plan.layout": {"value": "TP4", "unit": "layout", "machine": "cpu", "record": "results/cpu/records/08.json"},
    "engine.greedy_ok": {"value": True, "unit": "bool", "machine": "NVIDIA H200", "record": "r.json"},
    "engine.nan": {"value": "nan", "unit": "x", "machine": "cpu", "record": "r.json"},
}


def test_claim_renders_its_numbers_from_the_figures_and_holds():
    v = evaluate(Claim("The engine is {engine.speedup:.1f}x faster ({engine.tok_s:.0f} tok/s)",
                       "engine.speedup > 2 and engine.tok_s >= 180", machine="gpu"), FIGS)
    assert v.holds is True
    assert v.sentence == "The engine is 2.5x faster (180 tok/s)"
    assert "NVIDIA H200" in v.source and "05.json" in v.source


@pytest.mark.parametrize("cond, expect", [
    ("engine.speedup > 3", False), ("engine.speedup * 2 >= 5", True), ("1 < engine.speedup < 2", False),
    ("abs(engine.speedup - 2.4) < 0.2", True), ("not engine.greedy_ok", False), ("engine.greedy_ok", True),
    ("plan.layout == 'TP4'", True), ("quant.ppl_delta <= 0.01 or engine.speedup > 2", True),
    ("min(engine.speedup, 1) == 1", True), ("engine.speedup / engine.tok_s > 0", True),
])
def test_conditions(cond, expect):
    assert evaluate(Claim("s", cond), FIGS).holds is expect


def test_nan_figure_never_holds():
    assert evaluate(Claim("s", "engine.nan > 0 or engine.nan <= 0"), FIGS).holds is False


def test_missing_figure_and_wrong_machine_are_not_evaluable():
    v = evaluate(Claim("s", "engine.nope > 1"), FIGS)
    assert v.holds is None and "engine.nope is missing" in v.problem
    v = evaluate(Claim("s", "quant.ppl_delta < 1", machine="gpu"), FIGS)
    assert v.holds is None and "measured on cpu" in v.problem and "holds on gpu" in v.problem
    v = evaluate(Claim("{engine.missing} s", "engine.speedup > 1"), FIGS)
    assert v.holds is None and "engine.missing" in v.problem


def test_claim_of_other_machine_reads_the_fallback_summary():
    run = {"engine.speedup": dict(FIGS["engine.speedup"], value=0.5, machine="cpu")}
    v = evaluate(Claim("{engine.speedup}", "engine.speedup > 2", machine="gpu"), run, FIGS, here="cpu")
    assert v.holds is True and "NVIDIA H200" in v.source
    v = evaluate(Claim("{engine.speedup}", "engine.speedup > 2"), run, FIGS, here="cpu")  # 'any': this run
    assert v.holds is False and v.source == "this run"


@pytest.mark.parametrize("cond, msg", [
    ("__import__('os')", "only"), ("engine.speedup.__class__", "not a figure"),
    ("[x for x in engine.speedup]", "not allowed"), ("engine.speedup >", "not an expression"), ("", "need"),
    ("speedup > 1", "not a figure name"), ("lambda: 1", "not allowed"),
])
def test_bad_conditions_are_refused_when_written(cond, msg):
    with pytest.raises(ValueError, match=msg):
        Claim("s", cond)


def test_bad_text_and_machine_are_refused():
    with pytest.raises(ValueError, match="machine='h200'"):
        Claim("s", "engine.speedup > 1", machine="h200")
    with pytest.raises(ValueError, match="not a figure name"):
        Claim("{speedup}", "engine.speedup > 1")
    with pytest.raises(ValueError, match="sentence"):
        Claim(" ", "engine.speedup > 1")


def test_collect_reads_literal_claims_without_running(tmp_path):
    src = tmp_path / "01_x.py"
    src.write_text("import sys\nsys.exit(3)\nshow(Claim('a {engine.speedup}', 'engine.speedup > 1', machine='gpu'),\n"
                   "     claims.Claim('b', 'quant.ppl_delta < 0.05'))\n")
    found = collect([src])
    assert [w for w, _ in found] == ["01_x.py:3", "01_x.py:4"]
    assert found[0][1] == Claim("a {engine.speedup}", "engine.speedup > 1", machine="gpu")
    bad = tmp_path / "02_y.py"
    bad.write_text("t = 'x'\nClaim(t, 'engine.speedup > 1')\n")
    with pytest.raises(ValueError, match="02_y.py:2.*literals"):
        collect([bad])


def test_check_all_and_report(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"figures": FIGS}))
    src = tmp_path / "03_z.py"
    src.write_text("Claim('fast {engine.speedup:.1f}x', 'engine.speedup > 2', machine='gpu')\n"
                   "Claim('slow', 'engine.speedup < 1')\nClaim('gone', 'engine.gone > 1')\n")
    verdicts = C.check_all(summary, [src])
    assert [v.holds for v in verdicts] == [True, False, None]
    text = C.report(verdicts)
    assert text.startswith("3 claims checked") and "1 hold, 1 false, 1 not evaluable" in text
    assert "FALSE 03_z.py:2: slow" in text and "UNCHECKED 03_z.py:3" in text


def test_the_workbook_claims_hold():
    """The committed notebooks' claims against the committed summary: what ``python -m labkit claims`` checks."""
    verdicts = C.check_all()
    assert all(v.holds is True for v in verdicts), C.report(verdicts)
