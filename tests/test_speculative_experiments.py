"""The speedup model of notebook 09 (labkit/experiments/speculative.py) and its cost-ratio timing."""

import pytest
import torch

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


def test_run_decoder_wraps_the_engine():
    from labkit.engine import DraftModelProposer, PromptLookupProposer

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    m = from_config(cfg, dtype=torch.float32)
    prompts = [[1, 2, 3, 1, 2], [5, 6, 7]]
    plain, st0, t = S.run_decoder(m, None, prompts, 0, 6, num_blocks=16)
    assert t > 0 and st0.tokens_per_step == 1.0 and [len(o) for o in plain] == [6, 6]
    for prop in (PromptLookupProposer(), DraftModelProposer(m)):
        out, st, _ = S.run_decoder(m, prop, prompts, 3, 6, num_blocks=16)
        assert out == plain
    assert st.acceptance_rate == 1 and st.tokens_per_step > 1  # the target as its own draft
