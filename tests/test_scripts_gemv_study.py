"""scripts/gemv_study.py on the CPU: its bare-read kernel reads every word, and its experiments' candidates are
the tiles they say (the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
gemv_study = pytest.importorskip("gemv_study")


@pytest.mark.parametrize("cfg", [{"BLOCK": 512, "ITERS": 3, "num_warps": 2}, {"BLOCK": 1024, "ITERS": 1,
                                                                               "num_warps": 4}])
def test_stream_read_xors_every_word(cfg):
    """The programs' XORs combine to the whole buffer's, also where the last program's blocks run past it."""
    sets = gemv_study._weights("read", 40, 384, 2, "cpu")
    assert sets[0][0].numel() * 4 == gemv_study._nbytes("w4", 40, 384)
    launch = gemv_study._launcher("read", torch.zeros(1, 384), sets, 40, 384, cfg)
    for (words,) in sets:
        assert gemv_study.stream_read_ref(launch((words,))) == gemv_study.stream_read_ref(words)


def test_experiment_candidates(monkeypatch):
    """``tagged``: the split tile counted, tagged, unreduced and tagged with pipelined loads, then the whole-K
    tile; ``stages``: pipelined loads (PREFETCH 0) at 2-4 stages; every candidate keeps the default tile's
    PAIR_WORDS."""
    monkeypatch.setattr(gemv_study.qm, "num_sms", lambda device: 132)
    tagged = gemv_study._tagged_candidates(14336, 4096)
    assert [c.get("TAGGED", False) for c in tagged] == [False, True, False, True, False]
    assert tagged[2]["REDUCE"] is False and tagged[3]["LOOP_STAGES"] == 3 and tagged[4]["BLOCK_K"] == 4096
    stages = gemv_study._stage_candidates(4096, 14336)  # K > 4096: the split tile only
    assert stages[0].get("LOOP_STAGES") is None and {c["LOOP_STAGES"] for c in stages[1:]} == {2, 3, 4}
    assert all(c["PREFETCH"] == 0 for c in stages[1:])
    assert {c["ROW_STEPS"] for c in stages[1:]} == {2, 4, 8}  # half, once and twice the rule's 4
    whole = [c for c in gemv_study._stage_candidates(6144, 4096) if c["BLOCK_K"] == 4096]
    assert [c.get("FUSE") for c in whole[-2:]] == ["norm", "norm"] and whole[-1]["LOOP_STAGES"] == 3
    assert all(c["PAIR_WORDS"] for c in tagged + stages)
