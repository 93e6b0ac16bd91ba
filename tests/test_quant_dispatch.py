"""The kernel by batch (``labkit.quant.dispatch``): a table measured per machine, attached to labkit's quantised
layers, read by the engine; labkit's own kernels where no table was measured."""

import json
import warnings

import pytest
import torch

from labkit.model import KernelLog
from labkit.quant import quantize
from labkit.quant.dispatch import (
    DispatchTable,
    KernelChoice,
    load_table,
    quantised_layers,
    resolve,
    table_from_rows,
    use_dispatch,
)
from labkit.quant.peers import LABKIT_PATHS

TINY = "torch._weight_int4pack_mm (tinygemm)"
INTMM = "torch._int_mm W8A8 (cuBLAS)"
TABLE = DispatchTable({"int4": ((1, LABKIT_PATHS["int4"]), (4, TINY)),
                       "int8": ((1, LABKIT_PATHS["int8"]), (16, INTMM))}, "cpu", "test")


def test_nearest_measured_batch_by_ratio_ties_to_the_larger():
    assert TABLE.path_for("int4", 1) == LABKIT_PATHS["int4"]
    assert TABLE.path_for("int4", 2) == TINY  # 2 is as near 1 as 4 (ratio 2): the larger batch's path
    assert TABLE.path_for("int4", 500) == TINY
    assert TABLE.path_for("int8", 3) == LABKIT_PATHS["int8"] and TABLE.path_for("int8", 5) == INTMM
    assert TABLE.path_for("fp8", 64) == LABKIT_PATHS["fp8"]  # no row for the format: labkit's own
    assert DispatchTable.from_dict(json.loads(json.dumps(TABLE.to_dict()))) == TABLE


def test_table_from_measured_rows_takes_the_fastest_runnable_path():
    rows = [{"preset": "p", "weights": "int4", "path": LABKIT_PATHS["int4"], "batch": 1, "us": 10, "status": "ok"},
            {"preset": "p", "weights": "int4", "path": TINY, "batch": 1, "us": 12, "status": "ok"},
            {"preset": "p", "weights": "int4", "path": LABKIT_PATHS["int4"], "batch": 64, "us": 50, "status": "ok"},
            {"preset": "p", "weights": "int4", "path": TINY, "batch": 64, "us": 20, "status": "ok"},
            # faster, but not runnable by the engine / failed its check / another shape
            {"preset": "p", "weights": "int4", "path": "torchao Int4WeightOnlyConfig tile_packed_to_4d (tinygemm)",
             "batch": 64, "us": 5, "status": "ok"},
            {"preset": "p", "weights": "int8", "path": INTMM, "batch": 64, "us": 1, "status": "wrong: ..."},
            {"preset": "q", "weights": "int8", "path": INTMM, "batch": 64, "us": 1, "status": "ok"}]
    t = table_from_rows(rows, "NVIDIA H100 80GB HBM3", preset="p")
    assert t.paths == {"int4": ((1, LABKIT_PATHS["int4"]), (64, TINY))}


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="need a batch >= 1"):
        DispatchTable({"int4": ((0, TINY),)}, "cpu")
    with pytest.raises(ValueError, match="need a batch >= 1 and one of"):
        DispatchTable({"int4": ((1, INTMM),)}, "cpu")  # an int8 path for int4 weights
    with pytest.raises(ValueError, match="unknown; allowed"):
        resolve("fastest", "cpu")
    with pytest.raises(ValueError, match="no such table"):
        resolve("/nonexistent/quant_dispatch.json", "cpu")


def test_no_table_falls_back_to_labkits_kernels(tmp_path, tiny_model):
    table, why = load_table("cpu")
    assert table is None and "labkit's own kernels" in why
    path = tmp_path / "quant_dispatch.json"
    path.write_text(json.dumps({"env": {}, "data": TABLE.to_dict()}))
    assert load_table(path=path)[0] == TABLE
    q = quantize(tiny_model[0], "int8", dispatch="measured")  # the CPU has no table: labkit's kernels
    assert all(getattr(m, "dispatch", None) is None for m in q.modules())
    q = quantize(tiny_model[0], "int4", dispatch=str(path))
    layer = q.model.layers[0].mlp.down_proj
    assert isinstance(layer.dispatch, KernelChoice) and not layer.dispatch.kernels  # built when first run
    assert "quant_dispatch.json" in q.labkit_quant["dispatch"]
    use_dispatch(q, "labkit", quiet=True)
    assert layer.dispatch is None


def test_a_layer_takes_the_tables_kernel_at_its_rows(tiny_model):
    """At 1 row labkit's kernel, at 4 or more tinygemm: the same product either way (both multiply the layer's int4
    weights), and the peer is built once, on first use."""
    q = quantize(tiny_model[0], "int4", dispatch=TABLE)
    layer = q.model.layers[0].mlp.down_proj
    x = torch.randn(6, layer.in_features)
    assert layer.dispatch.kernel_for(x[:1]) is None and layer.dispatch.kernel_for(x) is not None
    ref = x.double() @ layer.dequantize(torch.float64).T
    assert ((layer(x).double() - ref).norm() / ref.norm()) < 1e-5
    assert list(layer.dispatch.kernels) == [TINY] and layer.dispatch.takes(6) and not layer.dispatch.takes(1)


def test_a_peer_that_cannot_run_here_keeps_labkits_kernel(tiny_model):
    t = DispatchTable({"int4": ((1, LABKIT_PATHS["int4"]), (8, "gemlite A16W4 (Triton)"))}, "cpu")
    q = quantize(tiny_model[0], "int4", dispatch=t)
    layer = q.model.layers[0].self_attn.o_proj
    with pytest.warns(UserWarning, match="not available here"):
        assert layer.dispatch.path_for(8) == LABKIT_PATHS["int4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert layer.dispatch.kernel_for(torch.zeros(8, layer.in_features)) is None
    assert "CUDA only" in layer.dispatch.skipped["gemlite A16W4 (Triton)"]


def test_merged_layers_carry_the_table(tiny_model):
    from labkit.model.build import adopt_hf_model

    q = quantize(tiny_model[0], "int4", dispatch=TABLE)
    merged = adopt_hf_model(q).model.layers[0].self_attn.qkv_proj
    assert merged.dispatch is not None and merged.dispatch.layer is merged
    assert q.model.layers[0].self_attn.q_proj.dispatch.table == TABLE  # the HF layers keep theirs, unbuilt
    assert not q.model.layers[0].self_attn.q_proj.dispatch.kernels


def peer_rows(engine, log: KernelLog) -> KernelLog:
    """Hand ``log`` to every dispatched layer the engine runs (``KernelChoice.log``): it records each call's path."""
    for layer in quantised_layers(engine.runner.model).values():
        if layer.dispatch is not None:
            layer.dispatch.log = log
    return log


def test_the_engine_runs_the_peer_at_its_batches(tiny_model):
    """The engine decodes two sequences (two rows: tinygemm) and prefills (more rows: tinygemm) through the table's
    kernel, with the greedy tokens of labkit's own kernels."""
    from labkit.engine import LLMEngine, SamplingParams

    model, tok = tiny_model
    prompts = [tok(t).input_ids for t in ("The os module provides", "import json and")]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs, log = {}, KernelLog()
    for name, d in (("labkit", "labkit"), ("table", TABLE)):
        engine = LLMEngine(quantize(model, "int4", dispatch=d), tok, kernels="torch")
        peer_rows(engine, log)
        outs[name] = [o.output_token_ids for o in engine.generate(prompts, params, progress=False)]
    assert outs["table"] == outs["labkit"]
    calls = [c.rows for c in log if c.kernel == TINY]
    assert calls and 2 in calls and max(calls) > 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the fused path")
def test_fused_layers_step_aside_where_a_peer_takes_the_rows(tiny_model):
    """With labkit's int4 epilogue fusions (the Triton plan), a step whose rows a peer takes runs the unfused layer
    (its norms and SwiGLU as their own kernels, the peer's GEMMs); a one-row step keeps the fused GEMVs."""
    from test_engine_model_runner import wide_tiles  # the interpreter's tiles of the fused tests (same folder)

    from labkit.engine import LLMEngine, SamplingParams

    model, tok = tiny_model
    q = quantize(model, "int4", backend="triton", dispatch=TABLE).half()
    q.model.layers = q.model.layers[:1]  # one layer, wide tiles: the interpreter is slow
    q.config.num_hidden_layers = 1
    wide_tiles(q)
    prompts = [tok(t).input_ids[:4] for t in ("The os module provides", "import json and")]
    engine = LLMEngine(q, tok, kernels="triton")
    assert engine.runner.plan.quant_epilogues
    log = peer_rows(engine, KernelLog())
    engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), progress=False)
    assert 2 in [c.rows for c in log if c.kernel == TINY]  # the two-row decode step: the peer, the unfused layer
    log.clear()
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), progress=False)
    assert 1 not in [c.rows for c in log]  # one row: labkit's fused GEMVs (the layers' forwards never called)
