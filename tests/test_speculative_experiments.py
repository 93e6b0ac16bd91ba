"""The speedup model of notebook 09 (labkit/experiments/speculative.py) and its cost-ratio timing."""

import pytest
import torch

from labkit.data import REPO_ROOT
from labkit.experiments import speculative as S
from labkit.model import ModelConfig, from_config


def test_expected_tokens_per_step():
    assert S.expected_tokens_per_step(0.0, 4) == 1.0
    assert S.expected_tokens_per_step(1.0, 4) == 5.0
    a, k = 0.7, 3
    assert S.expected_tokens_per_step(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    with pytest.raises(ValueError, match="alpha=1.5"):
        S.expected_tokens_per_step(1.5, 2)


def test_speedup_and_inverse():
    assert S.predicted_speedup(0.8, 4, 1.0) == pytest.approx(S.expected_tokens_per_step(0.8, 4))
    assert S.predicted_speedup(0.8, 4, 5.0) < 1  # compute-bound verify: k + 1 times a step, never pays
    assert S.predicted_speedup(0.8, 4, 1.0, 0.1) == pytest.approx(S.expected_tokens_per_step(0.8, 4) / 1.4)
    for a in (0.1, 0.5, 0.93):
        assert S.alpha_from_tokens_per_step(S.expected_tokens_per_step(a, 4), 4) == pytest.approx(a, abs=1e-9)
    assert S.wasted_flops_fraction(1.0, 4) == 0 and S.wasted_flops_fraction(0.0, 4) == pytest.approx(0.8)
    assert S.stop_paying_batch(0.6, 4, {1: 1.1, 8: 1.6, 64: 3.5}) == 64
    assert S.stop_paying_batch(0.6, 4, {1: 1.1}) is None


def test_verify_cost_ratio_runs():
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    m = from_config(cfg, dtype=torch.float32)
    before = m.plan
    r = S.verify_cost_ratio(m, 4, batch=2, context=20, iters=2, kernels="triton")
    assert r["t_1token_s"] > 0 and r["t_verify_s"] > 0 and r["ratio"] > 0
    assert r["plan"] == "triton" and r["timed"] == "eager"
    assert m.plan == before  # the measurement's plan does not outlive it


def test_speedup_by_batch_combines_costs_and_alpha():
    costs = {1: 1.0, 16: 1.1, 64: 1.6}
    t = S.speedup_by_batch(costs, 4, alphas=(0.3, 0.8), c_draft=0.05)
    assert list(t.columns[-3:]) == ["batch 1", "batch 16", "batch 64"]
    sweep = t[t.source == "sweep"]
    assert list(sweep.alpha) == [0.3, 0.8]
    for _, r in t.iterrows():
        for b, c in costs.items():
            assert r[f"batch {b}"] == pytest.approx(
                (1 - r.alpha ** 5) / ((1 - r.alpha) * (4 * r.c_draft + c)))  # Leviathan et al.'s formula
    t5 = t[t.draft.str.startswith("T5-XXL 11B / T5-small 77M, EnDe, greedy")].iloc[0]
    assert t5.alpha == 0.75 and t5.c_draft == 0.02 and "Leviathan" in t5.source
    lamda = t[t.draft.str.startswith("LaMDA 137B / LaMDA 100M")].iloc[0]
    assert lamda.c_draft == 0.05 and "not given" in lamda.source  # no published c: the sweep's
    assert (t["batch 64"] < t["batch 1"]).all()  # a dearer verify step lowers every row
    mine = S.speedup_by_batch(costs, 4, alphas=(), published=(), extra=[{"pair": "mine", "alpha": 0.5, "c_draft": 0.1}])
    assert list(mine.draft) == ["mine"] and mine.source.iloc[0] == "this run"
    with pytest.raises(ValueError, match="costs is empty"):
        S.speedup_by_batch({}, 4)
    with pytest.raises(ValueError, match="alpha=1.5"):
        S.speedup_by_batch(costs, 4, alphas=(1.5,))
    with pytest.raises(ValueError, match="costs\\[16\\]=0"):
        S.speedup_by_batch({16: 0}, 4)
    with pytest.raises(ValueError, match="k=0 must be an int >= 1"):
        S.speedup_by_batch(costs, 0)


def test_gpu_verify_costs_reads_the_committed_record():
    g = S.gpu_verify_costs()
    assert g["device"] == "NVIDIA H200" and g["k"] == 4 and g["context"] == 512
    assert sorted(g["costs"]) == [1, 4, 16, 64] and g["costs"][64] > g["costs"][1] > 0.9
    with pytest.raises(ValueError, match="holds no gpu_verify_cost"):
        S.gpu_verify_costs({"env": {"device": "cpu"}, "data": {"gpu_verify_cost": None}})


def _record(measured, tokens_per_step=1.2, t1=(0.004, 0.005, 0.008, 0.006), ratios=(1.1, 0.9, 0.95, 0.8)):
    return {"env": {"device": "GPU X"}, "data": {
        "sizes": {"ks": [1, 4], "new": 32},
        "acceptance": [{"proposer": "prompt_lookup", "k": 4, "tokens/step": tokens_per_step}],
        "verify_cost": [{"batch": b, "t_1token_s": t, "ratio": r} for b, t, r in zip((1, 4, 16, 64), t1, ratios)],
        "measured": {"prompt_lookup": measured}, "predicted": {"prompt_lookup": 1.05}}}


def test_explain_speedup_bounds_the_speedup_by_tokens_per_step():
    out = S.explain_speedup(_record(2.65))
    assert out["bound"] == pytest.approx(1.2 / 0.8) and out["timing_artefact"]
    assert out["inversion"] == {"small_batch": 16, "small_s": 0.008, "large_batch": 64, "large_s": 0.006}
    assert "timing artefact" in out["sentence"] and "1.50x" in out["sentence"] and "8.0 ms" in out["sentence"]
    fine = S.explain_speedup(_record(1.1), timed_tokens_per_step=1.3)
    assert not fine["timing_artefact"] and fine["tokens_per_step"] == 1.3 and "within" in fine["sentence"]
    h200 = S.explain_speedup(REPO_ROOT / "results/h200/records/09_speculative.json")
    assert h200["timing_artefact"] and h200["device"] == "NVIDIA H200"  # the committed record's 2.65x

