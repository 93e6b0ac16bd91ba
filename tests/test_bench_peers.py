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
