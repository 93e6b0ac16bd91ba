"""labkit.bench.collectives: counted and skipped collectives lent to a model from outside, the sweep's bandwidth
arithmetic, the alpha-beta fit, overlap."""

import math

import pytest
import torch

from labkit.bench import collectives
from labkit.experiments import parallelism as ex
from labkit.parallel import ColumnParallelLinear, RowParallelLinear, launch
from labkit.parallel.comm import Collectives


def test_bus_factors_follow_nccl_tests():
    assert collectives.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert collectives.bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert collectives.bus_factor("send_recv", 2) == 1.0
    with pytest.raises(ValueError, match="allowed"):
        collectives.bus_factor("broadcast", 2)


def test_use_collectives_lends_the_layers_another_and_gives_theirs_back():
    model = torch.nn.Sequential(ColumnParallelLinear(torch.randn(4, 3), None, None),
                                RowParallelLinear(torch.randn(3, 4), None, None), torch.nn.ReLU())
    own = [m.comm for m in model[:2]]
    assert all(type(c) is Collectives for c in own)  # the product's default: plain torch.distributed
    with collectives.use_collectives(model, collectives.SkippedCollectives()) as lent:
        assert all(m.comm is lent for m in model[:2])
    assert [m.comm for m in model[:2]] == own
    with pytest.raises(ValueError, match="no tensor-parallel layer"):
        with collectives.use_collectives(torch.nn.Linear(2, 2), collectives.CountingCollectives()):
            pass


def test_alpha_beta_fit_recovers_the_model():
    gen = torch.Generator().manual_seed(0)
    alpha, beta = 23e-6, 7.5e9
    sizes = [float(2**k) for k in range(6, 26, 2)]
    noise = 1 + 0.01 * torch.randn(len(sizes), generator=gen)  # 1% relative noise
    times = [(alpha + n / beta) * e.item() for n, e in zip(sizes, noise, strict=True)]
    a, b = collectives.fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha, rel=0.05)
    assert b == pytest.approx(beta, rel=0.05)


def test_alpha_beta_fit_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        collectives.fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="non-positive"):
        collectives.fit_alpha_beta([1e3, 1e6, 1e9], [3e-3, 2e-3, 1e-3])


@pytest.fixture(scope="module")
def two_ranks():
    calls = [(ex.collectives_check, (), {}),
             (ex.comm_check, ([256, 4096, 65536],), {"iters": 2, "repeats": 2, "overlap_bytes": 1 << 16,
                                                       "overlap_matmul_n": 64})]
    return launch(ex.sequence, 2, calls, backend="gloo", timeout_s=120)


@pytest.mark.distributed
def test_counted_collectives_are_right(two_ranks):
    for coll, _ in two_ranks:
        assert coll["all_reduce_err"] < 1e-6 and coll["all_gather_err"] == 0.0
        assert coll["calls"] == {"all_reduce": 1, "all_gather": 1}
        assert coll["bytes"] == {"all_reduce": 3 * 5 * 4, "all_gather": 3 * 5 * 4}


@pytest.mark.distributed
def test_sweep_rows_and_overlap(two_ranks):
    _, res = two_ranks[0]
    rows = res["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, n) for op in collectives.OPS for n in (256, 4096, 65536)]
    for r in rows:
        assert r["seconds"] > 0 and math.isfinite(r["seconds"])
        assert r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"] * collectives.bus_factor(r["op"], 2))
    # every rank reports the same (max-reduced) times
    assert [r["seconds"] for r in two_ranks[1][1]["rows"]] == [r["seconds"] for r in rows]
    ov = res["overlap"]
    assert all(ov[k] > 0 for k in ("comm", "compute", "serial", "overlapped"))
    assert math.isfinite(ov["hidden_frac"])
