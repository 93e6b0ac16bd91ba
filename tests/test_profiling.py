import pytest
import torch

from labkit.profiling import CATEGORIES, STEP_PARTS, categorize, profile_run, step_part


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
