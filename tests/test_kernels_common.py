"""Helpers shared by the kernels: argument checks, launch options, sizes."""

import pytest
import torch

from labkit.kernels.common import check_pdl, check_tensor, next_pow2, pdl_launch


def test_pdl_modes_are_checked_and_plain_where_unsupported():
    check_pdl("overlap")
    with pytest.raises(ValueError, match="pdl='later' is unknown; allowed"):
        check_pdl("later")
    with pytest.raises(ValueError, match="pdl='overlap' is unknown; allowed: \\('', 'release'\\)"):
        check_pdl("overlap", ("", "release"))
    # no programmatic dependent launch under the interpreter (or before sm_90): every mode launches plainly
    assert pdl_launch("overlap", torch.device("cpu")) == {"PDL": False}


def test_check_tensor_names_the_argument():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        check_tensor("x", [1.0])
    with pytest.raises(ValueError, match="x has dtype int64; allowed: float32"):
        check_tensor("x", torch.zeros(2, dtype=torch.int64), (torch.float32,))
    with pytest.raises(ValueError, match="w must have 2 dimensions"):
        check_tensor("w", torch.zeros(3), dim=2)


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 17, 64)] == [1, 2, 4, 32, 64]
