"""research/flash_prefill_study.py stays runnable: every rung of its ladder (the product kernel, the copy with each
change switched on, the TMA descriptors, the LPT grid, warp specialisation) computes attention within the float16
bound under Triton's interpreter at an irregular shape; the probes run. (The timing needs a GPU.)"""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.flash_attention import flash_attention_ref


@pytest.fixture(scope="module")
def study(research_study):
    return research_study("flash_prefill_study")


def test_every_variant_matches_the_reference_on_the_interpreter(study):
    rows = study.cpu_check()
    names = [r["name"] for r in rows]
    assert names[:5] == ["v0 product", "v0c copy", "v1 fold scale", "v2 K rows", "v3 TMA"]
    assert {"v4 wide tune", "v5 LPT grid", "v6 warp-specialize", "v6c single loop, no WS", "probe no-exp",
            "probe mma-only"} <= set(names)
    for r in rows:
        assert "us" in r, r
        if r["kind"] == "variant":
            assert r["rel_err"] < study.TOL, (r["name"], r["rel_err"])
    flags = {r["name"]: r["flags"] for r in rows if "flags" in r}
    assert flags["v3 TMA"] == dict(flags["v2 K rows"], tma=True)  # cumulative: one change a rung
    assert flags["v6 warp-specialize"]["ws"] and flags["v6 warp-specialize"]["single_loop"]
    assert flags["v6c single loop, no WS"] == dict(flags["v6 warp-specialize"], ws=False)


@pytest.mark.parametrize("flags", [dict(), dict(fold_scale=True, k_rows=True, tma=True, lpt=True),
                                   dict(fold_scale=True, k_rows=True, tma=True, single_loop=True, ws=True)])
def test_queries_at_the_end_of_a_longer_context(study, flags):
    """Bottom-right causal (S < T) and a partial last query tile: the split loop with and without descriptors,
    the single loop that v6 specialises."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=g).half() for s in ((1, 4, 37, 32), (1, 2, 70, 32), (1, 2, 70, 32)))
    out, _ = study.study_attention(q, k, v, study.Flags(**flags), study.CPU_TILE)
    ref = flash_attention_ref(q.double(), k.double(), v.double(), causal=True)
    assert relative_error(out, ref) < study.TOL


def test_study_refuses_what_its_kernel_does_not_tile(study):
    q = torch.randn(1, 2, 8, 48).half()
    with pytest.raises(ValueError, match="power-of-two head dim"):
        study.study_attention(q, q[:, :1], q[:, :1], study.Flags(), study.CPU_TILE)
    q = torch.randn(1, 2, 8, 32).half()
    with pytest.raises(ValueError, match="ws=True needs single_loop=True"):
        study.study_attention(q, q, q, study.Flags(tma=True, ws=True), study.CPU_TILE)


def test_wide_tiles_fit_shared_memory(study):
    """v4's space is the brief's minus the tiles whose Q and pipelined K/V do not fit sm_90's shared memory."""
    kept = [t for t in study.WIDE if study.fits_smem(t, 128)]
    assert (128, 128, 8, 4) not in kept and (128, 64, 8, 4) in kept and (128, 128, 8, 3) in kept
    assert all(t[2] == 4 for t in study.WS_TILES)
