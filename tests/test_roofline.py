import pytest

from labkit.hardware import get_hardware
from labkit.model import PRESETS
from labkit.roofline import mbu, mfu, roofline

H200 = get_hardware("h200")


def test_decode_bs1_reads_weights_once():
    spec = PRESETS["llama-3-8b"]
    r = roofline(spec, H200, batch=1, context=1, phase="decode", dtype="bf16")
    rows = {row.name: row for row in r.rows}
    weights = sum(rows[n].bytes for n in ("QKV/O projections", "MLP", "LM head"))
    # the weight part of the three matmul rows is exactly the decode weight bytes (norm weights aside)
    norm_weights = spec.num_layers * spec.norm_params_per_layer * 2 + spec.hidden_size * 2
    activations = weights - (spec.decode_weight_bytes("bf16") - norm_weights)
    assert 0 < activations < 1e-3 * weights  # at batch 1 the activations are a few MB against 15 GB
    assert r.bound == "memory" and 0.9 < r.intensity < 1.1
    # the floor is the bytes over the bandwidth: about 3.3 ms on the H200 datasheet
    assert r.bytes / H200.mem_bandwidth == pytest.approx(r.time_s, rel=0.05)


def test_decode_attention_bytes_are_kv_cache():
    spec = PRESETS["gpt3-175b"]
    r = roofline(spec, H200, batch=2, context=1000, phase="decode")
    att = next(row for row in r.rows if row.name == "attention")
    kv = 2 * 1000 * 4_718_592
    assert kv <= att.bytes < kv * 1.01
    assert att.flops == 2 * spec.attention_flops_per_token(1000)


def test_prefill_is_compute_bound_and_intensity_grows():
    small = roofline("llama-3-8b", H200, 1, 128, "prefill")
    large = roofline("llama-3-8b", H200, 1, 4096, "prefill")
    assert large.bound == "compute" and large.intensity > small.intensity > 50
    assert roofline("llama-3-8b", H200, 64, 2048, "decode").intensity > 30


@pytest.mark.parametrize("kwargs,match", [({"phase": "train"}, "phase='train' is unknown"),
                                          ({"batch": 0}, "batch=0"), ({"context": 0}, "context=0")])
def test_roofline_bad_inputs(kwargs, match):
    args = {"spec": "llama-3-8b", "hardware": H200, "batch": 1, "context": 16, "phase": "decode", **kwargs}
    with pytest.raises(ValueError, match=match):
        roofline(**args)


def test_utilisations_are_achieved_over_the_ceiling():
    assert mbu(1e9, 1.0, 2e9) == 0.5
    assert mfu(3e12, 2.0, 6e12) == 0.25
