import pytest
import torch

from labkit.experiments.quantization.compare import accuracy_rows, breakdown_tables, plot_step_breakdown, speed_rows


def test_accuracy_rows(tiny_model):
    model, tok = tiny_model
    rows = accuracy_rows(model, tok, methods=("int8", "int4"), seq_len=64, max_windows=2, error_tokens=(1, 16),
                         progress=False)
    by = {r["method"]: r for r in rows}
    assert list(by) == ["base", "int8", "int4"] and all(r["status"] == "ok" for r in rows)
    assert by["base"]["ppl_delta_frac"] == 0 and by["base"]["weight_bytes_ratio"] == 2.0  # fp32 over bf16
    assert by["int8"]["weight_bytes_ratio"] < 0.52 and by["int4"]["weight_bytes_ratio"] < 0.30
    assert by["int4"]["bits_per_weight"] == pytest.approx(4.5)  # 4 bits + fp32 scale and zero per 128
    assert len(by["int4"]["layer_errors"]) == 56 and by["int8"]["layer_err_max"] < 2e-2
    # at least the MLP activation [1, 16, 768] in float32 is live; the torch int4 path also materialises
    # a float32 copy of each weight it multiplies (768 x 256 for the MLP)
    assert all(r["forward_peak_bytes"] >= 16 * 768 * 4 for r in rows)
    assert by["int4"]["forward_peak_bytes"] > by["base"]["forward_peak_bytes"]


def test_methods_with_the_lm_head_quantised_too(tiny_model):
    """``int4+lm_head``: the LM head joins the quantised layers (its own error is reported with theirs), the bytes
    stay those of the layers every method replaces, and the decode step reads fewer bytes than int4's."""
    model, tok = tiny_model
    rows = accuracy_rows(model, tok, methods=("int4", "int4+lm_head"), seq_len=64, max_windows=2,
                         error_tokens=(1, 16), progress=False)
    by = {r["method"]: r for r in rows}
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    assert "lm_head" in by["int4+lm_head"]["layer_errors"] and "lm_head" not in by["int4"]["layer_errors"]
    assert 0 < by["int4+lm_head"]["layer_errors"]["lm_head"] < 1e-1
    assert by["int4+lm_head"]["weight_bytes_ratio"] == by["int4"]["weight_bytes_ratio"]
    assert by["int4+lm_head"]["ppl"] != by["int4"]["ppl"]
    speed = speed_rows(model, methods=("int4", "int4+lm_head"), context_len=8, iters=2, bandwidth=1e10,
                       progress=False)
    assert speed[2]["method"] == "int4+lm_head" and speed[2]["step_bytes"] < speed[1]["step_bytes"]
    mixed = accuracy_rows(model, tok, methods=("int4+int8_head",), seq_len=64, max_windows=2,
                          error_tokens=(1, 16), progress=False)[1]  # an int8 head: its error near int8's
    assert 0 < mixed["layer_errors"]["lm_head"] < by["int4+lm_head"]["layer_errors"]["lm_head"] / 2
    for bad, match in (("int4+head", "suffixes allowed"), ("int4+nf4_head", "suffixes allowed"), ("int3", "int3")):
        with pytest.raises(ValueError, match=match):
            accuracy_rows(model, tok, methods=(bad,), progress=False)
        with pytest.raises(ValueError, match=match):
            speed_rows(model, methods=(bad,), progress=False)


def test_speed_rows(tiny_model):
    rows = speed_rows(tiny_model[0], methods=("int4",), context_len=8, iters=2, bandwidth=1e10, progress=False)
    assert [r["method"] for r in rows] == ["base", "int4"]
    assert rows[1]["step_bytes"] < 0.5 * rows[0]["step_bytes"] and 0 < rows[1]["frac_of_floor"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["weight_bytes_ratio"] < 0.30


def test_speed_rows_engine_runner(tiny_model):
    rows = speed_rows(tiny_model[0], methods=("int8", "bnb-int8"), context_len=8, iters=2, runner="engine",
                      progress=False, breakdown=4)
    assert [r["method"] for r in rows] == ["base", "int8", "bnb-int8"]
    assert [r["timing"] for r in rows[:2]] == ["engine_eager"] * 2 and rows[0]["speedup"] == 1.0
    assert rows[1]["weight_bytes_ratio"] < 0.52 and rows[1]["decode_ms"] > 0
    assert "capturable" in rows[2]["status"] or rows[2]["status"] != "ok"
    steps, kernels = breakdown_tables(rows)
    assert list(steps.step) == ["base (engine)", "int8 (engine)"] and (steps["kernel time (ms)"] > 0).all()
    assert list(kernels.columns) == list(steps.step) and 0 < len(kernels) <= 8
    cats = rows[1]["breakdown"]["category_us_per_step"]
    assert sum(cats.values()) == pytest.approx(rows[1]["breakdown"]["device_us_per_step"])
    ax = plot_step_breakdown(rows)  # a bar per profiled step: its categories stacked, then the gaps
    assert [t.get_text() for t in ax.get_yticklabels()] == list(steps.step)
    union = {c for r in rows[:2] for c in r["breakdown"]["category_us_per_step"]}
    assert len(ax.patches) == 2 * (len(union) + 1)
    with pytest.raises(ValueError, match="runner='vllm'"):
        speed_rows(tiny_model[0], methods=(), runner="vllm")
    ab = speed_rows(tiny_model[0], methods=("int4",), context_len=8, iters=2, runner="engine", progress=False,
                    engine_options={"fuse_layer_ops": False}, breakdown=4)  # an A/B row, labelled as such
    assert [r["engine_options"] for r in ab] == [{"fuse_layer_ops": False}] * 2 and ab[1]["status"] == "ok"
    assert list(breakdown_tables(ab)[0].step) == ["base (engine, fuse_layer_ops=False)",
                                                  "int4 (engine, fuse_layer_ops=False)"]
    with pytest.raises(ValueError, match="engine_options"):
        speed_rows(tiny_model[0], methods=(), engine_options={"fuse_layer_ops": False})


@pytest.mark.gpu
def test_speed_rows_cuda_graph_and_patch():
    from labkit.model import random_model

    model = random_model("llama-3-8b", device="cuda", num_layers=2)
    rows = speed_rows(model, methods=("int8", "int4", "fp8"), context_len=64, iters=5, patch=True,
                      progress=False)
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    assert {r["timing"] for r in rows if r["method"] != "base"} == {"cuda_graph"}
    assert all(r["decode_ms"] > 0 for r in rows)
    rows = speed_rows(model, methods=("int8", "int4"), context_len=64, iters=5, runner="engine", progress=False,
                      breakdown=6)
    assert [r["timing"] for r in rows] == ["engine_graph"] * 3 and all(r["status"] == "ok" for r in rows)
    steps, _ = breakdown_tables(rows)  # a replayed graph is profiled kernel by kernel
    assert (steps.kernels > 10).all() and (steps["device busy (ms)"] <= steps["step (ms)"] * 1.5).all()
    del model
    torch.cuda.empty_cache()


def test_a_failing_method_is_reported_not_dropped(capsys):
    """A model whose in-features (96) no int4 group of 128 divides: int4 fails, is reported, and int8 still runs."""
    from labkit.model import ModelConfig, random_model

    cfg = ModelConfig(name="odd", vocab_size=128, hidden_size=96, intermediate_size=192, num_layers=1, num_heads=2,
                      max_position_embeddings=64)
    model = random_model(cfg, device="cpu", dtype="fp32")
    rows = speed_rows(model, methods=("int4", "int8"), context_len=8, iters=1, progress=False)
    assert [(r["method"], r["status"][:6]) for r in rows] == [("base", "ok"), ("int4", "failed"), ("int8", "ok")]
    assert "does not divide in_features=96" in rows[1]["status"]
    assert "does not divide in_features=96" in capsys.readouterr().err
