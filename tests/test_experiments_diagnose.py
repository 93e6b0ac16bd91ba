import pytest
import torch

from labkit.experiments.diagnose import HFDecode, classify, profile_decode, regimes
from labkit.hardware import KNOWN
from labkit.model import get_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_decode_steps_match_generate_and_exclude_the_prefill(tiny_model):
    model, _ = tiny_model
    prompts = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    dec = HFDecode(model, prompts, 5)
    with pytest.raises(RuntimeError, match="prefill"):
        dec()
    dec.prefill()
    first = dec.next.clone()
    steps = [first]
    for _ in range(5):
        dec.steps = 1
        steps.append(dec().clone())
    got = torch.cat(steps, 1)
    ref = model.generate(prompts, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[:, 11:]
    assert got.tolist() == ref.tolist()
    res = profile_decode(model, 2, 40, 3)
    # a prefill of 2 x 40 tokens would run matmuls with 80 rows; decode steps have 2
    assert res.steps == 3 and res.wall_s > 0 and res.busy_s > 0


@pytest.mark.parametrize("prompts,steps,match", [
    (torch.zeros(4, dtype=torch.long), 2, "int64 \\[batch, context\\]"),
    (torch.zeros(2, 3), 2, "int64"),
    (torch.zeros(2, 3, dtype=torch.long), 0, "steps=0"),
])
def test_decode_bad_inputs(tiny_model, prompts, steps, match):
    with pytest.raises(ValueError, match=match):
        HFDecode(tiny_model[0], prompts, steps)


@pytest.mark.parametrize("rb,rc,t,floor,intensity,expect", [
    (1.0, 1.05, 10.0, 0.1, 1.0, "overhead-bound"),  # flat, 100x its floor
    (1.02, 1.0, 1.1, 1.0, 1.0, "bandwidth-bound"),  # flat, at its floor: weights read once whatever the batch
    (1.95, 2.0, 2.0, 1.0, 1.0, "bandwidth-bound"),  # follows the work under the ridge: KV reads
    (1.9, 1.0, 2.0, 1.0, 500.0, "compute-bound"),  # follows the work above the ridge
    (1.45, 1.0, 1.2, 1.0, 1.0, "mixed"),
    (1.45, 1.0, 50.0, 1.0, 1.0, "overhead-bound"),
])
def test_classify(rb, rc, t, floor, intensity, expect):
    assert classify(rb, rc, t, floor, intensity, ridge=100.0) == expect


def test_regimes_rows(tiny_model):
    model, _ = tiny_model
    rows, prof = regimes(model, get_config(model), KNOWN["cpu"], 2, 32, 2, dtype="fp32")
    assert set(prof) == {"base", "2x batch", "2x context"}
    cats = {r["category"]: r for r in rows}
    assert "matmul" in cats and cats["idle (host)"]["regime"] == "overhead-bound"
    for r in rows:
        assert r["regime"] in ("overhead-bound", "bandwidth-bound", "compute-bound", "mixed")
        assert r["ratio 2x batch"] == pytest.approx(r["2x batch ms/step"] / r["base ms/step"])
