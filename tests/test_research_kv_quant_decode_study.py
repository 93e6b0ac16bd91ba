"""research/kv_quant_decode_study.py: every variant of its copy of the decode kernel that is not a probe computes
attention on the dequantised int8/fp8 cache, under the interpreter (its int8 -> float16 step without the inline
PTX), at a small irregular shape: 3 sequences of 1, 37 and 70 tokens, 4 query / 2 KV heads of 32, 16-token blocks,
float16 queries. The timings need a GPU."""

import pytest
import torch

from labkit.evaluate import relative_error


@pytest.fixture(scope="module")
def study(research_study):
    return research_study("kv_quant_decode_study")


@pytest.fixture(scope="module")
def case(study):
    c = study.Case(70, torch.device("cpu"), study.TINY_SHAPE, pools=1, lens=study.TINY_LENS)
    for fmt in ("int8", "fp8"):
        study.with_head_major(c, fmt)
    return c


def test_the_case_is_the_small_irregular_one(study, case):
    assert case.q.dtype == torch.float16 and tuple(case.q.shape) == (3, 4, 32)
    assert case.lens.tolist() == [1, 37, 70] and case.pools["int8"][0][0].shape[1:] == (16, 2, 32)
    assert case.pools["int8"][0][0].dtype == torch.int8 and case.pools["fp8"][0][0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("scales,layout,fmt,splits,block_n", [
    ("product", "token", "int8", 2, 16),
    ("prefetch", "token", "int8", 2, 16),   # several tiles a range: the carried scales move on
    ("prefetch", "token", "int8", 3, 32),   # a tile over two blocks
    ("first", "token", "int8", 2, 32),
    ("first", "head", "int8", 3, 16),       # head-major scale pools
    ("prefetch", "head", "fp8", 2, 16),
    ("product", "token", "fp8", 3, 32),
])
def test_variant_matches_the_reference_on_the_dequantised_cache(study, case, scales, layout, fmt, splits, block_n):
    out = study.copy_call(case, fmt, case.pools[fmt][0], scales, splits, {"BLOCK_N": block_n}, layout)
    assert relative_error(out, case.ref[fmt]) < study.TOL


def test_the_copy_computes_what_the_product_does(study, case):
    pool = case.pools["int8"][0]
    copy = study.copy_call(case, "int8", pool, "product", 3, {"BLOCK_N": 32})
    assert relative_error(copy, study.product_call(case, "int8", pool, num_splits=3)) < 1e-6


def test_the_probe_runs_without_scales(study, case):
    """The probe's values are wrong by design (scale 1 for every token): it only times the loads it leaves out."""
    out = study.copy_call(case, "int8", case.pools["int8"][0], "none", 2, {"BLOCK_N": 16})
    assert torch.isfinite(out).all() and relative_error(out, case.ref["int8"]) > 0.5


def test_ptx_is_off_on_the_interpreter_and_an_unknown_order_is_refused(study, case):
    k, v, ks, vs = case.pools["int8"][0][:4]
    args = (case.q, k, v, ks, vs, case.tables, case.lens)
    with pytest.raises(ValueError, match="scales="):
        study.study_attention(*args, scales="late")
    explicit = study.study_attention(*args, num_splits=2, tile={"BLOCK_N": 16}, ptx=False)
    assert torch.equal(explicit, study.study_attention(*args, num_splits=2, tile={"BLOCK_N": 16}))
