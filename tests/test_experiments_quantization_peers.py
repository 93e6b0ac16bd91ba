"""The paths each weight format's kernels are timed on (``labkit.experiments.quantization.peers``): every format's
paths, each built and checked against the product of the weights it holds, or saying why it cannot run."""

import pytest
import torch
from torch import nn

from labkit.experiments.quantization import peers as P
from labkit.quant.peers import LABKIT_PATHS


def test_every_format_has_labkits_path_and_its_peers():
    c = P.candidates()
    assert next(iter(c)) == P.BF16
    for fmt in ("int8", "int4", "fp8"):
        names = [n for n, (f, _) in c.items() if f == fmt]
        assert names[0] == LABKIT_PATHS[fmt] and len(names) >= 3
    assert {lib for _, lib in c.values()} >= {"labkit", "torch", "gemlite", "torchao"}


@pytest.mark.parametrize("name", [n for n in P.candidates()])
def test_each_path_is_checked_or_says_why_it_cannot_run(name):
    """On an irregular shape where the path takes one, else a regular one: a path that builds here computes the
    product of the weights it holds within its format's bound; one that cannot says why (a library missing, CUDA,
    a shape its kernel refuses)."""
    fmt = P.candidates()[name][0]
    for n, k in ((232, 640), (256, 512)):
        torch.manual_seed(n)
        lin = nn.Linear(k, n, bias=False)
        lin.weight.data.normal_(0, 0.02)
        try:
            fn, w = P.build_path(name, lin)
        except Exception as e:  # recorded by measure as the row's status
            reason = P._error(e)
            continue
        x = torch.randn(5, k)
        r = P.check_path(fn, w, lin, x, fmt)
        assert r["ok"] and r["kernel_err"] <= P.TOLERANCE[fmt], r
        assert r["rel_err"] < 0.15  # what the format costs on N(0, 0.02) weights (int4: about 0.1)
        return
    assert reason and ":" in reason


def test_a_wrong_kernel_fails_its_check():
    lin = nn.Linear(64, 32, bias=False)
    fn, w = P.build_path(LABKIT_PATHS["int8"], lin)
    r = P.check_path(lambda x: fn(x).flip(-1), w, lin, torch.randn(3, 64), "int8")
    assert not r["ok"] and r["kernel_err"] > 0.5


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="unknown"):
        P.build_path("marlin", nn.Linear(8, 8))
