import pytest
import torch

from labkit.evaluate import relative_error
from labkit.experiments.decode_step import StaticDecodeStep, time_decode_step


def test_static_step_matches_full_forward(tiny_model):
    model, _ = tiny_model
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (3, 29), generator=g)
    new = torch.randint(3, model.config.vocab_size, (3, 1), generator=g)
    step = StaticDecodeStep(model, 3, 29, prompt_ids=prompt)
    step.input_ids = new
    got = step.step()[:, -1]
    with torch.no_grad():
        ref = model(input_ids=torch.cat([prompt, new], dim=1)).logits[:, -1]
    assert relative_error(got, ref) < 1e-5
    # replaying the same step rewrites the same slot and gives the same logits
    assert torch.equal(step.step()[:, -1], got)


def test_time_decode_step_reports_samples(tiny_model):
    model, _ = tiny_model
    t = time_decode_step(model, batch_size=2, context_len=17, iters=3)
    assert len(t.samples_s) == 3 and t.median_s > 0 and t.extra["context_len"] == 17
    assert "breakdown" not in t.extra


def test_kernel_breakdown_of_a_step(tiny_model):
    """On the CPU the profile's 'kernels' are aten operators: the matmuls of the step lead, sorted by time."""
    t = time_decode_step(tiny_model[0], batch_size=1, context_len=9, iters=2, breakdown=5)
    bd = t.extra["breakdown"]
    assert bd["kernels_per_step"] > 10 and bd["device_us_per_step"] > 0 and len(bd["top"]) == 5
    times = [r["us_per_step"] for r in bd["top"]]
    assert times == sorted(times, reverse=True) and all(r["calls_per_step"] > 0 for r in bd["top"])
    assert any("mm" in r["kernel"] or "linear" in r["kernel"] for r in bd["top"])


@pytest.mark.parametrize("kwargs,match", [({"batch_size": 0, "context_len": 8}, "batch_size"),
                                          ({"batch_size": 1, "context_len": 4096}, "context_len")])
def test_bad_arguments(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaticDecodeStep(tiny_model[0], **kwargs)
