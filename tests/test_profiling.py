import pytest
import torch

from labkit.hardware import get_hardware
from labkit.model import PRESETS
from labkit.profiling import CATEGORIES, STEP_PARTS, categorize, mbu, profile_run, roofline, step_part

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


def test_categories():
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert categorize("aten::addmm") == "matmul"
    assert categorize("flash_fwd_kernel") == "attention"
    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert categorize("Memcpy DtoD (Device -> Device)") == "memory copy"
    assert categorize("void at::native::vectorized_elementwise_kernel<4, silu>") == "norm/elementwise"


def test_profile_covers_device_time(tiny_model, tmp_path):
    model, _ = tiny_model
    ids = torch.randint(3, 8000, (2, 33))
    res = profile_run(lambda: model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                             pad_token_id=0), steps=5, trace_path=str(tmp_path / "t.json"))
    assert res.covered_frac >= 0.9
    cats = res.by_category()
    assert set(CATEGORIES) <= set(cats) and cats["matmul"] > 0 and cats["attention"] > 0
    assert 0 <= res.idle_frac < 1 and res.kernels_per_step > 10
    assert (tmp_path / "t.json").stat().st_size > 0
    assert mbu(1e9, 1.0, 2e9) == 0.5
    with pytest.raises(ValueError, match="steps=0"):
        profile_run(lambda: None, steps=0)


@pytest.mark.parametrize("name,scope,part", [
    ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", "", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "", "gemm"),
    ("_paged_attn_kernel", "", "attention"), ("_paged_attn_reduce", "", "attention"),
    ("_rms_norm_kernel", "", "norm"), ("_rope_cache_kernel", "", "rope/cache write"),
    ("_silu_and_mul_kernel", "", "activation"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
     "unsigned int, long, 4> >", "", "sampling/logits"),
    ("Memcpy HtoD (Pinned -> Device)", "", "copies/other"),
    ("void at::native::index_elementwise_kernel<128, 4>", "", "copies/other"),
    ("some_unknown_kernel", "", "copies/other"),
    # on the CPU the caller says what a plain operator computes: the outermost caller that names a part wins
    ("aten::mul", "step > forward_paged > attend > rope_and_write > rotate", "rope/cache write"),
    ("aten::mul", "step > forward_paged > forward > act_and_mul", "activation"),
    ("aten::add", "step > forward_paged > add_norm", "norm"),
    ("aten::bmm", "forward_paged > attend > cached_attention > paged_decode_attention_ref > aten::einsum", "attention"),
    ("aten::mm", "forward_paged > forward > aten::linear > aten::matmul", "gemm"),
    ("aten::argmax", "step > _run > _launch > sample", "sampling/logits"),
    ("aten::copy_", "step > execute > prepare > aten::to", "copies/other"),
])
def test_step_parts(name, scope, part):
    assert part in STEP_PARTS and step_part(name, scope) == part


def test_step_parts_leave_the_categories_as_they_were():
    """``categorize`` and ``step_part`` read one pattern table; the finer parts split its elementwise category."""
    names = ["_rope_cache_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel", "aten::argmax", "aten::mul",
             "aten::cos", "aten::softmax", "Memcpy HtoD (Pinned -> Device)", "aten::index_put_"]
    assert [categorize(n) for n in names] == ["norm/elementwise"] * 7 + ["memory copy"] * 2
    assert step_part("aten::index_put_") == "copies/other" and step_part("aten::cos") == "rope/cache write"
