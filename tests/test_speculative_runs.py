"""Notebook 09's engine runs (labkit/experiments/speculative_runs.py): acceptance and greedy equality over many
prompts, the interleaved per-prompt timing and its spread, on a tiny model."""

import pandas as pd
import pytest
import torch

from labkit.engine import SpeculativeConfig
from labkit.experiments import speculative_runs as R
from labkit.model import ModelConfig, from_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    target = from_config(cfg, dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(0, 64, (5,), generator=g).tolist() * 3)[:12 + i % 3] for i in range(6)]
    configs = {R.PLAIN: None, "prompt_lookup": SpeculativeConfig("prompt_lookup", 3),
               "draft": SpeculativeConfig("draft", 2, draft_model=target)}
    return target, prompts, R.make_engines(target, configs, 14, 8, max_num_seqs=6)


def test_acceptance_and_greedy_equality(setup):
    _, prompts, engines = setup
    acc, same = R.acceptance(engines, prompts, 8, {"prompt_lookup": 3, "draft": 2})
    assert same and list(acc.proposer) == ["prompt_lookup", "draft"]
    d = acc.set_index("proposer").loc["draft"]  # the target as its own draft: every token accepted
    assert d.proposed == d.accepted > 0 and d["alpha implied by tokens/step"] == pytest.approx(1, abs=1e-6)
    assert acc.set_index("proposer").loc["prompt_lookup"].proposed > 0


def test_time_prompts_and_spread(setup):
    _, prompts, engines = setup
    times = R.time_prompts(engines, prompts, 8, repeats=2)
    assert len(times) == 3 * len(prompts) and (times.seconds > 0).all() and times.same_output.all()
    assert (times[times.config == R.PLAIN]["tokens/step"] == 1).all() and (times.tokens == 8).all()
    spread = R.speedup_spread(times)
    assert list(spread.config) == ["prompt_lookup", "draft"] and (spread.prompts == len(prompts)).all()
    assert (spread.p10 <= spread["median"]).all() and (spread["median"] <= spread.p90).all()
    assert (spread["min"] <= spread.q25).all() and (spread.q75 <= spread["max"]).all()
    for eng in engines.values():
        assert eng.cache.allocator.num_free == eng.cache.num_blocks
    toy = pd.DataFrame({"prompt": [0, 0, 1, 1], "config": [R.PLAIN, "x"] * 2, "seconds": [2.0, 1.0, 3.0, 1.0],
                        "tokens/step": [1, 2, 1, 3], "same_output": True})
    row = R.speedup_spread(toy).iloc[0]
    assert row["median"] == pytest.approx(2.5) and row["min"] == 2 and row["max"] == 3


def test_bad_input(setup):
    target, prompts, engines = setup
    with pytest.raises(ValueError, match="needs a 'plain' one"):
        R.time_prompts({"draft": engines["draft"]}, prompts, 4)
    with pytest.raises(ValueError, match="repeats=0 must be an int >= 1"):
        R.time_prompts(engines, prompts, 4, repeats=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        R.time_prompts(engines, [], 4)
    assert R.tokens_per_step(target, prompts[0], SpeculativeConfig("draft", 2, draft_model=target), 7) == 3
