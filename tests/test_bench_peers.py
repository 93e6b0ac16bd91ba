"""``python -m labkit bench decode|serve`` with their HF peers (the static cache, eager and compiled)."""

import json

import pytest

from labkit.experiments.batching.cli import hf_static_decode, main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_hf_static_decode_measures_eager_and_says_compiled_needs_cuda(tiny_model):
    model, _ = tiny_model
    r = hf_static_decode(model, 2, 12, 4, model.config.vocab_size)
    assert r["hf_static_tok_s"] > 0 and r["hf_static_first_call_s"] > 0
    assert r["hf_static+compile_tok_s"] is None  # HF compiles generate on accelerators only


def test_bench_decode_and_serve_record_the_peers(tmp_path):
    assert main(["decode", "--batch", "2", "--context", "12", "--steps", "4", "--kernels", "torch", "--out",
                 str(tmp_path), "--no-progress"]) == 0
    row = json.loads((tmp_path / "records" / "bench_decode.json").read_text())["data"]["rows"][0]
    assert row["tok_s"] > 0 and row["hf_static_tok_s"] > 0 and "hf_static+compile_tok_s" in row
    assert main(["serve", "--num-requests", "4", "--prompt-len", "6", "--output-mean", "3", "--output-max", "4",
                 "--scheduler", "continuous", "--hf-requests", "3", "--hf-batch", "2", "--hf-modes", "eager",
                 "--kernels", "torch", "--out", str(tmp_path), "--no-progress"]) == 0
    hf = json.loads((tmp_path / "records" / "bench_serve.json").read_text())["data"]["hf_static_batching"]
    assert [r["requests"] for r in hf] == [3, 3] and all(r["output_tok_s"] > 0 for r in hf)


def test_bench_decode_formats_against_bf16_in_one_run(tmp_path):
    """``--formats``: the model quantised to each format (labkit's kernels here: the CPU has no kernel table), each
    decoded at each batch beside the unquantised model, and ``quant.<fmt>_decode_speedup_b<batch>`` recorded."""
    assert main(["decode", "--batch", "1", "2", "--context", "12", "--steps", "3", "--kernels", "torch", "--no-hf",
                 "--formats", "bf16", "int8", "fp8", "--figures", "--out", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "records" / "bench_decode.json").read_text())["data"]
    assert [(r["weights"], r["batch"]) for r in data["rows"]] == [(w, b) for w in ("bf16", "int8", "fp8")
                                                                  for b in (1, 2)]
    assert data["rows"][2]["kernels_by_layer"] == {"labkit Int8Linear (Triton)": 56}
    assert "labkit's own kernels" in data["dispatch"]["int8"]
    figs = json.loads((tmp_path / "figures.json").read_text())
    assert {f"quant.{w}_decode_speedup_b{b}" for w in ("int8", "fp8") for b in (1, 2)} <= set(figs)
    assert figs["quant.int8_decode_speedup_b2"]["value"] > 0 and "end to end" in figs["quant.int8_decode_speedup_b2"][
        "note"]
    assert figs["quant.int8_decode_floor_ratio_b1"]["kind"] == "derived" and \
        1 < figs["quant.int8_decode_floor_ratio_b1"]["value"] < 4  # fp32 base weights over int8 ones, KV alike
