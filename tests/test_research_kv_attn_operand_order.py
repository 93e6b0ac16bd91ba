"""research/kv_attn_operand_order.py: the transposed decode kernel (the cache tile as the MMA's first operand)
computes attention on the bf16, int8 and fp8 caches, and its int8-q variant on the int8 one, under the interpreter
at the ladder's small irregular shape (3 sequences of 1, 37 and 70 tokens, 4 query / 2 KV heads of 32, 16-token
blocks, float16 queries), over one and several tiles a range. The timings need a GPU."""

import pytest
import torch

from labkit.evaluate import relative_error


@pytest.fixture(scope="module")
def study(research_study):
    return research_study("kv_attn_operand_order")


@pytest.fixture(scope="module")
def case(study):
    return study.Case(70, torch.device("cpu"), study.TINY_SHAPE, pools=1, lens=study.TINY_LENS)


@pytest.mark.parametrize("mode,fmt,splits,block_n", [
    ("swap", "bf16", 2, 16), ("swap", "int8", 3, 32), ("swap", "fp8", 2, 16),
    ("swap-i8q", "int8", 2, 16), ("swap-i8q", "int8", 1, 32),
])
def test_the_transposed_kernel_matches_the_reference(study, case, mode, fmt, splits, block_n):
    k, v, ks, vs = case.pools[fmt][0][:4]
    out = study.swap_attention(case.q, k, v, ks, vs, case.tables, case.lens, mode, splits, {"BLOCK_N": block_n})
    # int8 q adds its own rounding (1/254 of each head's largest |q|): well inside the ladder's tolerance
    assert relative_error(out, case.ref[fmt]) < (study.TOL if mode == "swap-i8q" else 1e-3)


def test_an_int8_query_needs_an_int8_cache(study, case):
    k, v = case.pools["bf16"][0][:2]
    with pytest.raises(ValueError, match="swap-i8q"):
        study.swap_attention(case.q, k, v, None, None, case.tables, case.lens, "swap-i8q")
