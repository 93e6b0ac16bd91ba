"""research/: every study imports against the installed labkit, and the parts that run without a GPU work -- the
GEMV study's launchers run the product kernels with their tiles as tuning data, its candidates are the tiles they
say, the SASS report parses a loop, the attention sweep runs on the interpreter. (The timing needs a GPU.)"""

from pathlib import Path

import pytest
import torch

RESEARCH = Path(__file__).resolve().parent.parent / "research"
SCRIPTS = ("gemv_study", "sass_report", "pdl_check", "rmsnorm_study", "attention_splits", "autotune_report",
           "flash_prefill_study", "kv_quant_decode_study", "kv_attn_operand_order", "async_timeline")


@pytest.fixture(scope="module")
def gemv_study(research_study):
    return research_study("gemv_study")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_study_imports_and_has_a_main(research_study, name):
    module = research_study(name)
    assert callable(module.main) and module.__doc__
    assert "sys.path" not in (RESEARCH / f"{name}.py").read_text()


def test_every_study_has_a_readme_row():
    readme = (RESEARCH / "README.md").read_text()
    assert all(f"| `{name}.py` |" in readme for name in SCRIPTS)


@pytest.mark.parametrize("cfg", [{"BLOCK": 512, "ITERS": 3, "num_warps": 2}, {"BLOCK": 1024, "ITERS": 1,
                                                                               "num_warps": 4}])
def test_stream_read_xors_every_word(gemv_study, cfg):
    """The programs' XORs combine to the whole buffer's, also where the last program's blocks run past it."""
    sets = gemv_study._weights("read", 40, 384, 2, "cpu")
    assert sets[0][0].numel() * 4 == gemv_study._nbytes("w4", 40, 384)
    launch = gemv_study._launcher("read", torch.zeros(1, 384), sets, 40, 384, cfg)
    for (words,) in sets:
        assert gemv_study.stream_read_ref(launch((words,))) == gemv_study.stream_read_ref(words)


@pytest.mark.parametrize("kind,cfg", [
    ("w4xs", {"BLOCK_N": 8, "BLOCK_K": 128, "ROW_STEPS": 2, "num_warps": 1}),
    ("w4xs", {"BLOCK_N": 8, "BLOCK_K": 128, "ROW_STEPS": 1, "num_warps": 1, "FUSE": "residual"}),
    ("w8xs", {"BLOCK_N": 8, "BLOCK_K": 256, "ROW_STEPS": 2, "num_warps": 1}),
    ("w8", {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "LOAD_STAGES": 1, "num_warps": 4}),
    ("w4", {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2, "LOAD_STAGES": 1, "PREFETCH": True, "num_warps": 4})])
def test_candidates_launch_the_product_kernels(gemv_study, kind, cfg):
    """A candidate is a product kernel with its tile as tuning data: on the interpreter it computes the product of
    the weights it is given (bfloat16 activations, as on the GPU; a residual added where it takes one)."""
    n, k = 32, 256
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    sets = gemv_study._weights(kind, n, k, 1, "cpu")
    out = gemv_study._launcher(kind, x, sets, n, k, cfg)(sets[0]).float()
    ref = torch.nn.functional.linear(x.float(), gemv_study._dequant(kind, sets[0]))
    if cfg.get("FUSE") == "residual":
        ref = ref + gemv_study._FUSED_INPUTS[("res", n)].float()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
    with pytest.raises(ValueError, match="no whole stationary tiles"):
        gemv_study.launch_xs("w4xs", x, gemv_study._weights("w4xs", 36, k, 1, "cpu")[0], 36, k,
                             {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 1})


def test_experiment_candidates(gemv_study):
    """``step``: labkit's split and whole-K tiles plain and with PDL, then at half and a quarter of the rule's row
    steps; ``fused``: each tile plain, with the norm and with the residual inside; ``splittiles``: 12-32 warps per
    SM; the default tile is the wrapper's pick (whole-K where K <= 4096 and N <= 8192)."""
    step = gemv_study._step_candidates(28672, 4096)  # the split tile at 8 row steps, then the whole-K tile
    assert [c["BLOCK_K"] for c in step[:4]] == [512] * 4 and step[1] == dict(step[0], PDL=True)
    assert [c["ROW_STEPS"] for c in step[:4]] == [8, 8, 4, 2] and step[4]["BLOCK_K"] == 4096
    assert all(c["BLOCK_K"] == 512 for c in gemv_study._step_candidates(4096, 14336))  # K > 4096: no whole-K
    assert [c.get("FUSE") for c in gemv_study._fused_candidates(4096, 14336)] == [None, "norm", "residual"]
    assert all(12 <= (4096 // c["BLOCK_K"]) * (14336 // (c["BLOCK_N"] * c["ROW_STEPS"])) * c["num_warps"] / 132 <= 32
               for c in gemv_study._split_tile_candidates(14336, 4096))
    assert gemv_study._default_tile(6144, 4096)[0]["BLOCK_K"] == 4096
    assert gemv_study._default_tile(4096, 14336)[0]["BLOCK_K"] == 512
    assert gemv_study._pdl_candidates(6144, 4096)[1]["PDL"]


def test_sass_report_counts_the_loop_with_the_most_multiplies(research_study):
    """The weight loop is the backward branch whose body holds the most multiplies, not a longer wait loop."""
    sass_report = research_study("sass_report")
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   HFMA2 R2, R3, R4, R2 ;",
        "        /*0020*/                   HFMA2 R5, R3, R4, R5 ;",
        "        /*0030*/              @P0  BRA 0x10 ;",
        "        /*0040*/                   LDG.E R6, desc[UR4][R2.64] ;",
        "        /*0050*/                   IADD3 R7, R7, 0x1, RZ ;",
        "        /*0060*/                   ISETP.NE.AND P1, PT, R7, RZ, PT ;",
        "        /*0070*/                   NOP ;",
        "        /*0080*/              @P1  BRA 0x40 ;"])
    body = sass_report._loop(sass)
    assert len(body) == 3 and sum(sass_report._opcode(t) == "HFMA2" for t in body) == 2
    assert sass_report._opcode("@P0 BRA 0x10") == "BRA"


def test_attention_sweep_runs_on_the_interpreter(research_study):
    """The kernel part's check on a CPU: the default call and one (range count, tile) row, each against the
    single-pass kernel."""
    attention_splits = research_study("attention_splits")
    rows = attention_splits.kernel_sweep(torch.device("cpu"), "tiny")
    assert [r["tile"] for r in rows] == ["default", None] and all("us" in r for r in rows)
    assert all(r["max_abs_diff_vs_one_pass"] < 1e-2 for r in rows)


def test_pdl_check_variants_run_every_engine(research_study):
    """Each variant runs the PDL engine, the plain one and the separate kernels, with options the runner takes."""
    pdl_check = research_study("pdl_check")
    assert all({"pdl", "plain", "separate"} <= set(order) for order, _ in pdl_check.VARIANTS.values())
    assert set(pdl_check.ENGINES) >= {"pdl", "plain", "separate"}
