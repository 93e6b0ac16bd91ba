"""Every headline ratio quotes the strongest baseline measured in the same record (``labkit.headlines``): checked on
every machine of ``results/summary.json`` (figures of one record and run together), on the committed kernel record
recomputed by today's code, and in the prose: a sentence that quotes a footnote baseline quotes the headline too."""

import json

import pytest

from labkit.claims import Claim, collect
from labkit.conditions import fields
from labkit.data import REPO_ROOT
from labkit.figures import machine_figures, read_summary, summary_classes
from labkit.headlines import HEADLINES, Headline, by_figure, problems


def test_problems_flags_a_headline_above_a_weaker_baseline():
    h = Headline("t", "k.vs_strong", "the strong one", ("k.vs_weak",))
    assert problems({"k.vs_strong": 1.1, "k.vs_weak": 12.0}, (h,)) == []
    assert problems({"k.vs_strong": {"value": 1.1}}, (h,)) == []  # an alternative not measured: nothing to compare
    bad = problems({"k.vs_strong": 3.0, "k.vs_weak": {"value": 1.5}}, (h,))
    assert len(bad) == 1 and "not the strongest" in bad[0] and "the strong one" in bad[0]
    assert problems({"k.vs_strong": float("nan"), "k.vs_weak": 1.0}, (h,)) == []
    assert problems({"k.vs_strong": 1.01, "k.vs_weak": 1.0}, (h,)) == []  # within timing noise: equally strong
    assert len(problems({"k.vs_strong": 1.01, "k.vs_weak": 1.0}, (h,), noise=0.0)) == 1
    with pytest.raises(ValueError, match="its own alternative"):
        Headline("t", "a.b", "x", ("a.b",))


def test_the_list_is_well_formed():
    names = [h.figure for h in HEADLINES]
    assert len(names) == len(set(names))
    assert all(n.count(".") == 1 for h in HEADLINES for n in (h.figure, *h.alternatives))
    assert by_figure()["kernels.rmsnorm_speedup_vs_eager"].figure == "kernels.rmsnorm_speedup_vs_compile"


def test_every_committed_headline_quotes_the_strongest_baseline_of_its_record():
    summary = read_summary()
    found = []
    for machine in summary_classes(summary):
        groups: dict[tuple, dict] = {}
        for name, e in machine_figures(summary, machine).items():
            groups.setdefault((e.get("record"), e.get("run")), {})[name] = e
        for (record, run), figs in groups.items():
            found += [f"{machine} {record} ({run}): {p}" for p in problems(figs)]
    assert not found, "\n".join(found)


def test_the_committed_kernel_record_has_its_strongest_baselines_as_headlines():
    """Today's ``headline_figures`` on the committed H200 rows: torch.compile and cuDNN were measured there, and
    each is stronger than the eager expression and the flash backend it replaces as the headline."""
    from labkit.experiments.kernels import bench as kb

    rec = json.loads((REPO_ROOT / "results/h200/records/03_kernels.json").read_text())
    figs = kb.headline_figures(rec["data"]["rows"], "gpu")
    for name in ("kernels.rmsnorm_speedup_vs_compile", "kernels.flash_attn_vs_cudnn"):
        assert figs[name] == figs[name], f"{name} is not measured in the committed record"
    assert problems(figs) == []
    assert figs["kernels.rmsnorm_speedup_vs_compile"] < figs["kernels.rmsnorm_speedup_vs_eager"]
    assert figs["kernels.flash_attn_vs_cudnn"] < figs["kernels.flash_attn_vs_sdpa"]


def _quoted(text: str) -> set[str]:
    return {name for name, _, _ in fields(text)}


def test_prose_quotes_a_footnote_baseline_only_beside_its_headline():
    from labkit.experiments import capstone as cap

    texts = [(where, c.text) for where, c in collect() if isinstance(c, Claim)]
    texts += [(f"capstone {k}", v) for k, v in cap.templates().items()]
    alts = {a: h for h in HEADLINES for a in h.alternatives}
    bad = []
    for where, text in texts:
        names = _quoted(text)
        bad += [f"{where}: quotes {n} without {alts[n].figure}" for n in names if n in alts
                and alts[n].figure not in names]
    assert not bad, "\n".join(bad)
