"""Claims: conditions, sentences with words from the data, per-machine and per-run evaluation, the refusals, the
wording of the workbook's claims, collection from notebook sources, the report and the CLI's figures."""

import json

import pytest

from labkit import claims as C
from labkit.claims import Claim, ClaimRefused, RefusedClaim, check_claim, collect, evaluate
from labkit.claims_report import claims_table, write_figures
from labkit.conditions import wording_problems
from labkit.figures import read_summary

R05 = "results/h200/records/05.json"
RUN = "2026-12-06T00:00:00Z@abc"
FIGS = {  # one machine's figures, flat (labkit.figures.machine_figures)
    "engine.speedup": {"value": 2.5, "unit": "x", "machine": "NVIDIA H200", "record": R05, "run": RUN},
    "engine.tok_s": {"value": 180.0, "unit": "tok/s", "machine": "NVIDIA H200", "record": R05, "run": RUN},
    "quant.ppl_delta": {"value": 0.012, "unit": "frac", "machine": "NVIDIA H200", "record": R05, "run": RUN},
    "plan.layout": {"value": "TP4", "unit": "layout", "machine": "NVIDIA H200", "record": R05, "run": RUN},
    "engine.greedy_ok": {"value": True, "unit": "bool", "machine": "NVIDIA H200", "record": R05, "run": RUN},
    "engine.nan": {"value": "nan", "unit": "x", "machine": "NVIDIA H200", "record": R05, "run": RUN},
    "engine.requests": {"value": 200, "unit": "requests", "machine": "NVIDIA H200", "record": R05, "run": RUN,
                        "kind": "derived"},
    "engine.capacity": {"value": 141, "unit": "GB", "machine": "NVIDIA H200", "record": R05, "run": RUN,
                        "kind": "derived"},
}


def summary(**machines) -> dict:
    """A summary of the current format from ``class=(device, run, {figure: value})``."""
    out = {}
    for cls, (device, run, values) in machines.items():
        for name, value in values.items():
            out.setdefault(name, {"unit": "x", "kind": "measured", "machines": {}})["machines"][cls] = {
                "value": value, "machine": device, "record": f"results/{cls}/records/r.json", "run": run}
    return {"format": 2, "figures": out}


def test_claim_renders_its_numbers_from_the_figures_and_holds():
    v = evaluate(Claim("The engine is {engine.speedup:.1f}x faster ({engine.tok_s:.0f} tok/s)",
                       "engine.speedup > 2 and engine.tok_s >= 180", machine="gpu"), FIGS, "h200")
    assert v.status == "holds" and v.holds is True and v.machine == "h200"
    assert v.sentence == "The engine is 2.5x faster (180 tok/s)"
    assert "05.json" in v.source and RUN in v.source


@pytest.mark.parametrize("cond, expect", [
    ("engine.speedup > 3", False), ("engine.speedup * 2 >= 5", True), ("1 < engine.speedup < 2", False),
    ("abs(engine.speedup - 2.4) < 0.2", True), ("not engine.greedy_ok", False), ("engine.greedy_ok", True),
    ("plan.layout == 'TP4'", True), ("quant.ppl_delta <= 0.01 or engine.speedup > 2", True),
    ("min(engine.speedup, 1) == 1", True), ("engine.speedup / engine.tok_s > 0", True),
    ("engine.greedy_ok == True", True),
])
def test_conditions(cond, expect):
    assert evaluate(Claim("s", cond), FIGS).holds is expect


def test_words_picked_from_the_data():
    text = ("int8 {engine.speedup:if >= 2 then reaches else falls short of} its bytes ratio; "
            "{engine.tok_s:if > engine.speedup then more else no more} tokens")
    c = Claim(text, "engine.speedup > 1")
    assert c.text_figures() == ["engine.speedup", "engine.tok_s"]
    assert evaluate(c, FIGS).sentence == "int8 reaches its bytes ratio; more tokens"
    slow = {**FIGS, "engine.speedup": dict(FIGS["engine.speedup"], value=1.5)}
    assert evaluate(c, slow).sentence == "int8 falls short of its bytes ratio; more tokens"
    assert C.render("{a.x:if == b.y then as many else not as many}", {"a.x": 20, "b.y": 20}) == "as many"
    with pytest.raises(ValueError, match="if OP OPERAND then WORDS else WORDS"):
        Claim("{engine.speedup:if 2 reaches}", "engine.speedup > 1")
    c = Claim("{engine.speedup:if > engine.gone then more else fewer}", "engine.speedup > 1")
    assert "engine.gone" in c.figures() and evaluate(c, FIGS).status == "missing"


def test_nan_figure_never_holds():
    assert evaluate(Claim("s", "engine.nan > 0 or engine.speedup > 2"), FIGS).holds is False


def test_missing_figure_is_not_evaluated():
    v = evaluate(Claim("s", "engine.nope > 1"), FIGS, "h200")
    assert v.status == "missing" and v.holds is None and "engine.nope is not measured on h200" in v.problem
    v = evaluate(Claim("{engine.missing} s", "engine.speedup > 1"), FIGS, "h200")
    assert v.status == "missing" and "engine.missing" in v.problem


def test_figures_of_two_runs_are_not_compared():
    other = {**FIGS, "engine.tok_s": dict(FIGS["engine.tok_s"], run="2026-12-07T00:00:00Z@def")}
    v = evaluate(Claim("{engine.speedup} {engine.tok_s}", "engine.tok_s > engine.speedup"), other, "h200")
    assert v.status == "cross-run" and v.holds is None
    assert "engine.tok_s from run 2026-12-07T00:00:00Z@def" in v.problem
    assert f"engine.speedup from run {RUN}" in v.problem


def test_a_claim_is_checked_on_every_machine_it_applies_to():
    s = summary(h100=("NVIDIA H100 80GB HBM3", "r1", {"k.w8": 2.12, "k.w4": 3.1}),
                h200=("NVIDIA H200", "r2", {"k.w8": 1.84, "k.w4": 2.46}),
                cpu=("cpu", "r3", {"k.w8": 0.2}))
    gpu = Claim("int8 {k.w8:if >= 2 then reaches else falls short of} 2x", "k.w4 > k.w8 > 1", machine="gpu")
    verdicts = check_claim(gpu, s)
    assert [(v.machine, v.status) for v in verdicts] == [("h100", "holds"), ("h200", "holds")]
    assert [v.sentence for v in verdicts] == ["int8 reaches 2x", "int8 falls short of 2x"]
    below = Claim("int8 under 2x", "k.w8 < 2", machine="gpu")
    assert [v.status for v in check_claim(below, s)] == ["false", "holds"]  # false on the H100: the checker says so
    anywhere = check_claim(Claim("s", "k.w4 > k.w8", machine="any"), s)
    assert [(v.machine, v.status) for v in anywhere] == [("h100", "holds"), ("h200", "holds"), ("cpu", "missing")]
    assert [v.machine for v in check_claim(Claim("s", "k.w8 < 1", machine="cpu"), s)] == ["cpu"]


def test_a_new_gpu_gets_its_own_column():
    s = summary(h200=("NVIDIA H200", "r2", {"k.w8": 1.84}),
                **{"a100-sxm4-80gb": ("NVIDIA A100-SXM4-80GB", "r4", {"k.w8": 1.2})})
    assert [v.machine for v in check_claim(Claim("s", "k.w8 > 1", machine="gpu"), s)] == ["h200", "a100-sxm4-80gb"]


# --- refusals: each names its rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("cond, rule", [
    ("1 > 0", r"refused \(vacuous\).*reads no measured figure"),
    ("engine.speedup >= engine.speedup", r"refused \(self-compared\).*compares engine.speedup with itself"),
    ("engine.speedup * 2 > engine.speedup", r"refused \(self-compared\)"),
    ("abs(engine.speedup) >= 0", r"refused \(tautological\).*holds whatever the figures' values"),
    ("engine.speedup > 1 or engine.speedup <= 1", r"refused \(tautological\)"),
])
def test_claims_that_cannot_fail_are_refused_when_written(cond, rule):
    with pytest.raises(ClaimRefused, match=rule):
        Claim("s", cond)


def test_a_condition_of_derived_figures_only_is_refused():
    v = evaluate(Claim("{engine.requests} requests", "engine.requests >= 200"), FIGS, "h200")
    assert v.status == "refused" and "refused (derived-only)" in v.problem and "engine.requests" in v.problem
    v = evaluate(Claim("s", "engine.requests < engine.capacity"), FIGS, "h200")
    assert v.status == "refused" and "derived-only" in v.problem
    # a derived figure beside a measured one is fine: the measurement can make it false
    assert evaluate(Claim("s", "engine.tok_s < engine.requests"), FIGS, "h200").status == "holds"


@pytest.mark.parametrize("cond", ["engine.greedy_ok > 0", "engine.greedy_ok == 1", "engine.greedy_ok + 1 > 1",
                                  "engine.greedy_ok != engine.speedup"])
def test_a_boolean_compared_as_a_number_is_refused(cond):
    v = evaluate(Claim("s", cond), FIGS, "h200")
    assert v.status == "refused" and "refused (boolean-as-number): engine.greedy_ok is a boolean" in v.problem


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


# --- wording: the sentence says what the condition tests ----------------------------------------------------------
@pytest.mark.parametrize("text, cond, problem", [
    ("int8 KV attention is no faster than bf16's", "k.x < 1.1", "'no faster' needs a bound of at most 1"),
    ("int8 KV attention is within 10% of bf16's, no faster", "k.x < 1.1", None),
    ("int8 KV attention is no faster than bf16's", "k.x <= 1.0", None),
    ("Prefill is compute-bound", "d.prefill_intensity > 100", "'compute-bound' needs the intensity compared"),
    ("Prefill is compute-bound", "d.prefill_intensity > d.ridge_flop_per_byte", None),
    ("Decode is memory-bound", "d.ridge_flop_per_byte > d.decode_intensity", None),
    ("Decode is memory-bound", "d.decode_intensity > d.ridge_flop_per_byte", "'memory-bound' needs"),
    ("The kernel runs faster than cuBLAS", "k.speedup > 0.9", "'faster' needs a ratio above 1"),
    ("The kernel runs faster than cuBLAS", "k.speedup > 1", None),
    ("Speculation is slower at batch 1", "s.speedup < 1.05", "'slower' needs a ratio under 1"),
    ("It fits one GPU", "m.need < m.capacity", None),
    ("It fits one GPU", "m.need >= 10", "'fits' needs an upper bound"),
    ("The kernel reaches 90% of the copy bandwidth", "k.frac < 0.95", "'reaches' needs a lower bound"),
    ("Neither step reaches its bytes ratio", "k.w8 > 1", "needs an upper bound"),
    ("Neither step reaches its bytes ratio", "k.w8 < 2", None),
    ("It does not fit one GPU", "m.need_gb < 80", "'does not fit' needs a lower bound"),
    ("int8 needs more GPUs", "p.int8 <= 24", "'more' needs a lower bound"),
    ("int8 needs fewer GPUs", "p.int8 >= 24", "'fewer' needs an upper bound"),
    ("int8 needs {p.int8:if > p.bf16 then more else no more} GPUs", "k.speedup > 1", None),  # words from the data
])
def test_wording_heuristics(text, cond, problem):
    got = wording_problems(text, cond)
    assert (got == []) if problem is None else any(problem in g for g in got), got


def test_the_workbook_claims_say_what_their_conditions_test():
    bad = [f"{w}: {c.text!r}: {p}" for w, c in collect() for p in wording_problems(c.text, c.condition)]
    assert not bad, "\n".join(bad)


# --- notebooks ------------------------------------------------------------------------------------------------------
def test_collect_reads_literal_claims_without_running(tmp_path):
    src = tmp_path / "01_x.py"
    src.write_text("import sys\nsys.exit(3)\nshow(Claim('a {engine.speedup}', 'engine.speedup > 1', machine='gpu'),\n"
                   "     claims.Claim('b', 'quant.ppl_delta < 0.05'), Claim('c', '2 > 1'))\n")
    found = collect([src])
    assert [w for w, _ in found] == ["01_x.py:3", "01_x.py:4", "01_x.py:4"]
    assert found[0][1] == Claim("a {engine.speedup}", "engine.speedup > 1", machine="gpu")
    assert isinstance(found[2][1], RefusedClaim) and "vacuous" in found[2][1].reason
    bad = tmp_path / "02_y.py"
    bad.write_text("t = 'x'\nClaim(t, 'engine.speedup > 1')\n")
    with pytest.raises(ValueError, match="02_y.py:2.*literals"):
        collect([bad])


def test_check_all_report_and_figures(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    data = summary(h100=("NVIDIA H100 80GB HBM3", "r1", {"engine.speedup": 0.9, "engine.flag": True}),
                   h200=("NVIDIA H200", "r2", {"engine.speedup": 2.5, "engine.flag": True}))
    path.write_text(json.dumps(data))
    src = tmp_path / "03_z.py"
    src.write_text("Claim('fast {engine.speedup:.1f}x', 'engine.speedup > 2', machine='gpu')\n"
                   "Claim('ok', 'engine.flag == True')\nClaim('gone', 'engine.gone > 1')\n"
                   "Claim('as a number', 'engine.flag > 0')\nClaim('none', '1 < 2')\n")
    checks = C.check_all(path, [src])
    assert [ch.status for ch in checks] == ["false", "holds", "unchecked", "refused", "refused"]
    text = claims_table(checks)
    assert text.startswith("5 claims checked") and "1 hold, 1 false, 2 refused, 1 evaluated on no machine" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("03_z.py:1 "))
    assert "FALSE" in row and "holds" in row  # false on the H100, holds on the H200: one row, two columns
    assert "FALSE 03_z.py:1: h100: condition 'engine.speedup > 2' is false" in text
    assert "REFUSED 03_z.py:5: refused (vacuous)" in text and "boolean-as-number" in text
    write_figures(checks, path)  # its record beside the summary: tmp_path/cpu/records
    cpu = read_summary(path)["figures"]
    assert cpu["workbook.claims_checked"]["machines"]["cpu"]["value"] == 2
    assert cpu["workbook.claims_false"]["machines"]["cpu"]["value"] == 1
    assert cpu["workbook.claims_vacuous"]["machines"]["cpu"]["value"] == 2
    assert cpu["workbook.claims_vacuous"]["bar"] == "== 0"


def test_show_judges_this_runs_figures_and_raises_under_gpu(tmp_path, monkeypatch):
    shown = []
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    monkeypatch.setenv("LABKIT_RUN_ID", "this-run")
    from labkit.bench import record_figure

    record_figure("engine.speedup", 0.9, "x", tmp_path / "r.json", out_dir=tmp_path, machine="NVIDIA H200")
    claim = Claim("The engine is {engine.speedup:.1f}x faster", "engine.speedup > 1", machine="gpu")
    monkeypatch.setenv("LABKIT_PROFILE", "cpu")
    checks = C.show(claim, display=shown.append)
    assert any(v.machine == "h200" and v.status == "false" and v.source == "this run" for v in checks[0].verdicts)
    assert "The engine is 0.9x faster" in shown[-1] and "does not hold" in shown[-1]
    # a cell ending in show(...) prints nothing more than the box: the checks' repr is one line
    assert repr(checks).startswith("<1 claims: ") and "false" in repr(checks) and checks._ipython_display_() is None
    monkeypatch.setenv("LABKIT_PROFILE", "gpu")
    with pytest.raises(AssertionError, match="not holding on this run's figures"):
        C.show(claim, display=shown.append)
    C.show(Claim("{engine.other}", "engine.other > 1", machine="gpu"), display=shown.append)  # not in this run


def test_the_workbook_claims_hold():
    """The committed notebooks' claims against the committed summary: what ``python -m labkit claims`` checks. None
    is false or refused on any machine. A claim no machine could evaluate (figures of two runs, or not measured yet)
    is reported, not failed: the run that records its figures together checks it."""
    checks = C.check_all()
    assert not [ch for ch in checks if ch.status in ("false", "refused")], claims_table(checks)
    assert sum(ch.status == "holds" for ch in checks) >= 60, claims_table(checks)


def test_the_cli_exits_1_on_a_false_or_refused_claim(tmp_path, capsys):
    from labkit.__main__ import main

    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary(h200=("NVIDIA H200", "r", {"engine.speedup": 0.5}))))
    src = tmp_path / "09_x.py"
    for cond, code in (("engine.speedup < 1", 0), ("engine.speedup > 1", 1), ("1 > 0", 1)):  # holds, false, refused
        src.write_text(f"Claim('s', {cond!r}, machine='gpu')\n")
        assert main(["claims", "--summary", str(path), "--sources", str(src)]) == code, cond
        assert "claims checked" in capsys.readouterr().out


def test_the_lessons_an_h100_contradicted_now_say_what_it_measured():
    """At commit 16cb26f an H100 measured the int8 GEMV at 2.12x bf16 (03 said neither GEMV reaches its bytes
    ratio), planned FP8 weights on as many GPUs as bf16 (08 said more) and recommended FP8 weights where the
    committed 08 said bf16. The workbook's claims, checked on those numbers beside the H200's, hold on both and say
    what each measured."""
    layout = "5 x (TP4 x PP1), weights fp8, KV int8, batch <= 64"
    h100 = {"kernels.w8_gemv_speedup_vs_bf16": 2.12, "kernels.w4_gemv_speedup_vs_bf16": 2.6,
            "plan.gpus_175b_bf16": 20, "plan.gpus_175b_fp8": 20, "plan.gpus_175b_int8": 24,
            "plan.gpus_175b_int4": 32, "plan.gpt3_175b_layout": layout, "parallel.recommended_175b_layout": layout}
    s = summary(h100=("NVIDIA H100 80GB HBM3", "one-run", h100))
    s["figures"] = {**s["figures"], **{n: f for n, f in read_summary()["figures"].items() if n not in h100}}
    for n in h100:  # the H200's committed values beside the H100's (the committed H100 values give way to 16cb26f's)
        s["figures"][n]["machines"].update({m: e for m, e in read_summary()["figures"][n]["machines"].items()
                                            if m != "h100"})
    claims = [c for w, c in collect() if w.startswith(("03_kernels.py", "08_capstone.py")) and isinstance(c, Claim)]
    by_text = {c.text: check_claim(c, s) for c in claims if set(c.figures()) & set(h100)}
    assert by_text and all(v.status != "false" for vs in by_text.values() for v in vs), by_text
    gemv = next(vs for t, vs in by_text.items() if "int8 GEMV runs" in t)
    assert "the int8 GEMV reaches its 2x" in next(v.sentence for v in gemv if v.machine == "h100")
    assert "the int8 GEMV falls short of its 2x" in next(v.sentence for v in gemv if v.machine == "h200")
    formats = next(vs for t, vs in by_text.items() if "finds a plan for every weight format" in t)
    assert "FP8 no more (20)" in next(v.sentence for v in formats if v.machine == "h100")
    same = next(vs for t, vs in by_text.items() if "06 and 08" in t)
    # (a figure derived from both GPUs' records, class h100+h200, may sit beside them: 06 never ran there)
    assert [(v.machine, v.status) for v in same if v.machine in ("h100", "h200")] == [("h100", "holds"),
                                                                                      ("h200", "cross-run")]
    assert layout in same[0].sentence
