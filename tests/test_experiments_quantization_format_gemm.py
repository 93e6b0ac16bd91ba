"""The per-format GEMM measurement (``labkit.experiments.quantization.format_gemm``): its shapes, its loop over the
paths, and how a measurement is read (the dispatch table, the figures, the plot)."""

import pytest
import torch

from labkit.experiments.quantization import format_gemm as G
from labkit.experiments.quantization import peers as P
from labkit.experiments.quantization.peers import BF16, candidates
from labkit.quant.peers import LABKIT_PATHS


def test_layer_shapes_of_the_8b_and_the_175b():
    assert G.layer_shapes("llama-3-8b") == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    # GPT-3's MLP is not gated: one up projection of 4 x d_model
    assert G.layer_shapes("gpt3-175b") == [(36864, 12288), (12288, 12288), (49152, 12288), (12288, 49152)]
    assert G.layer_params("gpt3-175b") == 12 * 12288 ** 2


def test_weight_copies_on_the_cpu():
    assert G.weight_copies(10, torch.device("cpu")) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_measure_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        G.measure()


def _data():
    rows = []
    for b, (bf, own, peer, bad) in {1: (100, 50, 80, 10), 64: (120, 170, 60, 10)}.items():
        for path, fmt, us, status in ((BF16, "bf16", bf, "ok"), (LABKIT_PATHS["int4"], "int4", own, "ok"),
                                      ("torch._weight_int4pack_mm (tinygemm)", "int4", peer, "ok"),
                                      ("gemlite A16W4 (Triton)", "int4", bad, "wrong: kernel_err 1.3 > 0.1")):
            rows.append({"preset": "llama-3-8b", "weights": fmt, "path": path, "library": "x", "batch": b, "us": us,
                         "bf16_us": bf, "status": status})
    return {"device": "NVIDIA H100 80GB HBM3", "rows": rows}


def test_best_paths_and_figures(tmp_path):
    d = _data()
    best = G.best_paths(d)
    assert best["int4"] == {"best": "torch._weight_int4pack_mm (tinygemm)", "best_speedup": 2.0,
                            "labkit_speedup": 120 / 170}
    assert best["fp8"]["best"] is None  # nothing timed: no figure
    figs = G.figures(d, tmp_path / "records" / "format_gemm.json", out_dir=tmp_path, machine="NVIDIA H100 80GB HBM3")
    assert figs["quant.int4_best_gemm_speedup_b64"]["value"] == 2.0
    assert figs["quant.int4_best_path_b64"]["value"] == "torch._weight_int4pack_mm (tinygemm)"
    assert "quant.fp8_best_gemm_speedup_b64" not in figs


def test_write_records_writes_the_table_the_engine_reads(tmp_path):
    from labkit.quant.dispatch import load_table

    paths = G.write_records(_data(), out_dir=tmp_path)
    table, why = load_table(path=paths["quant_dispatch"])
    assert table.path_for("int4", 1) == LABKIT_PATHS["int4"]
    assert table.path_for("int4", 64) == "torch._weight_int4pack_mm (tinygemm)"
    assert table.machine == "NVIDIA H100 80GB HBM3" and "measured on NVIDIA H100" in why


def test_the_measurement_loop_records_every_path_with_its_status():
    """The whole loop on the CPU (float32, wall clock; the numbers mean nothing): every path of the list gets a row
    per batch, timed where it runs here, else with the reason; the records it writes hold the table."""
    names = (LABKIT_PATHS["int4"], "torch._weight_int4pack_mm (tinygemm)", "gemlite A16W4 (Triton)",
             LABKIT_PATHS["int8"], "torch._int_mm W8A8 (cuBLAS)")
    data = G.measure(presets=("tiny",), batches=(1, 20), iters=2, paths=names, device="cpu", progress=False)
    rows = {(r["path"], r["batch"]): r for r in data["rows"]}
    assert set(rows) == {(n, b) for n in (BF16, *names) for b in (1, 20)}
    assert rows[("torch._weight_int4pack_mm (tinygemm)", 20)]["status"] == "ok"
    assert rows[("torch._weight_int4pack_mm (tinygemm)", 20)]["kernel_err"] < 1e-5
    assert rows[("gemlite A16W4 (Triton)", 1)]["status"].startswith("unavailable: PeerUnavailable")
    assert all(r["us"] > 0 and r["bf16_us"] > 0 for r in data["rows"] if r["status"] == "ok")
    assert data["device"] == "cpu" and {r["preset"] for r in data["rows"]} == {"tiny"}
    spent = G.measure(presets=("tiny",), batches=(1,), iters=1, paths=names[:1], device="cpu", budget_s=0,
                      progress=False)
    assert all(r["status"].startswith("not built: the time budget") for r in spent["rows"])
    seen = []
    untimed = G.measure(presets=("tiny",), batches=(1, 2), iters=1, paths=names[:1], device="cpu", timing_s=0,
                        progress=False, checkpoint=seen.append)
    assert all(r["status"].startswith("not timed: the timing budget") for r in untimed["rows"])
    assert [len(d["rows"]) for d in seen] == [2, 4]  # after each batch, every row so far


def test_paths_are_built_cheapest_first():
    order = sorted(candidates(), key=P.build_rank)
    libs = [candidates()[n][1] for n in order]
    assert libs.index("gemlite") > libs.index("torch") and order[-1] == "torch.compile(fp8 act quant + _scaled_mm)"


def test_roofline_is_the_ratio_of_bytes_then_of_rates():
    """A few rows: the ratio of bytes per weight; many rows: the ratio of tensor-core rates (one for weight-only paths,
    which widen to 16 bits; the 8-bit rate over bf16's for W8A8)."""
    from labkit.hardware import KNOWN

    h = KNOWN["h100"]
    assert G.roofline_speedup("int8", 1, h) == pytest.approx(2.0)
    assert G.roofline_speedup("int4", 1, h) == pytest.approx(2 / (0.5 + 4 / 128))
    assert G.roofline_speedup("int4", 4096, h) == pytest.approx(1.0)
    assert G.roofline_speedup("fp8", 4096, h, w8a8=True) == pytest.approx(h.fp8_flops / h.bf16_flops)
    assert G.roofline_speedup("int4", 64, h) > G.roofline_speedup("int4", 256, h) > 1
    assert P.is_w8a8("Fp8Linear fused (Triton act quant + _scaled_mm)") and P.is_w8a8("torch._int_mm W8A8 (cuBLAS)")
    assert not P.is_w8a8("gemlite A16W8 fp8 (Triton, weight-only)") and not P.is_w8a8(LABKIT_PATHS["int4"])


def test_a_record_from_before_the_peers_reads_in_todays_names():
    import json

    from labkit.data import REPO_ROOT

    data = json.loads((REPO_ROOT / "results" / "h200" / "records" / "format_gemm.json").read_text())["data"]
    table = {r["path"]: r for r in G.speedup_table(data)}
    assert LABKIT_PATHS["fp8"] in table and "torch._scaled_mm W8A8 (cuBLAS)" not in table
    figs = {f["name"]: f for f in G.gemm_figures(data)}
    assert figs["quant.fp8_labkit_gemm_speedup_b64"]["value"] == figs["quant.fp8_best_gemm_speedup_b64"]["value"]
    assert figs["quant.int4_roofline_speedup_b64"]["derived"] and not figs["quant.int4_best_path_b64"]["derived"]
    assert figs["quant.int4_labkit_gemm_speedup_b1"]["value"] > 1 > figs["quant.int4_labkit_gemm_speedup_b256"]["value"]


def test_the_plot_has_a_panel_per_format():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.hardware import KNOWN

    fig = G.plot_speedups(_data(), hw=KNOWN["h100"], title="t")
    assert [ax.get_title() for ax in fig.axes] == ["int8 weights", "int4 weights", "fp8 weights"]
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert "torch._weight_int4pack_mm (tinygemm)" in labels and "gemlite A16W4 (Triton)" not in labels  # not timed


def test_the_gpu_runs_figures_stage_reads_what_the_records_hold(tmp_path):
    """``scripts/quant_peers.py figures`` on a folder holding a per-format GEMM record (the committed H200 one here):
    the GEMM figures under the record's machine and the 175B plan's per-format figures, planned on that record."""
    import importlib.util
    import json
    import shutil

    from labkit.data import REPO_ROOT

    spec = importlib.util.spec_from_file_location("quant_peers", REPO_ROOT / "scripts" / "quant_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "records").mkdir()
    shutil.copy(REPO_ROOT / "results" / "h200" / "records" / "format_gemm.json", tmp_path / "records")
    assert mod.main(["figures", "--out", str(tmp_path)]) == 0
    figs = json.loads((tmp_path / "figures.json").read_text())
    assert figs["quant.int4_best_path_b64"]["machine"] == "NVIDIA H200"
    assert {"plan.gpus_175b_fp8", "plan.kernel_175b_fp8", "plan.gpus_175b_fp8_labkit"} <= set(figs)
    assert (tmp_path / "records" / "quant_plan.json").exists()


def test_run_format_gemm_reuses_this_runs_record_and_reads_none_off_the_gpu(tmp_path):
    from labkit.bench import write_record

    assert G.run_format_gemm("cpu", out_dir=tmp_path) is None
    data = {"device": "NVIDIA H100 80GB HBM3", "presets": list(G.PRESETS), "rows": []}
    write_record("format_gemm", data, out_dir=tmp_path)
    for profile in ("cpu", "gpu"):  # the gpu profile reuses a record that covers its presets: nothing measured
        path, got = G.run_format_gemm(profile, out_dir=tmp_path)
        assert path == tmp_path / "records" / "format_gemm.json" and got["presets"] == data["presets"]
    with pytest.raises(ValueError, match="profile"):
        G.run_format_gemm("h100", out_dir=tmp_path)
