"""Notebook 03's arithmetic and experiments at tiny sizes on the CPU."""

import pytest
import torch

from labkit.experiments.kernels.study import (
    FLOOR,
    FP8_ATTN_FIGURE,
    FUSION_BYTES,
    INT8_ATTN_FIGURE,
    INT8_ATTN_SHAPE,
    KV_ATTN_ROWS,
    KV_ROUNDING_BOUND,
    decode_step_figures,
    decode_steps,
    fp8_attention_speedup,
    int8_attention_speedup,
    kv_quant_attention,
    kv_quant_attention_sweep,
    matmul_rates,
    norm_sweep,
    operator_costs,
    plot_bandwidth,
    plot_kv_quant_sweep,
    sdpa_gqa,
)


def test_operator_costs_bounds():
    rows = {r["operator"]: r for r in operator_costs("llama-3-8b", bandwidth=4.27e12, peak_flops=799e12)}
    assert rows["RMSNorm"]["bound"] == "memory" and rows["attention prefill (flash)"]["bound"] == "compute"
    assert rows["attention decode (paged)"]["bound"] == "memory"
    gemv16, gemv4 = rows["linear 4096x14336, batch 1 (bf16)"], rows["linear 4096x14336, batch 1 (int4)"]
    assert abs(gemv16["predicted_us"] / gemv4["predicted_us"] - 4) < 1e-9  # bytes / bandwidth
    assert abs(gemv16["MB"] - 4096 * 14336 * 2 / 1e6) < 1e-6


def test_fusion_bytes_never_favour_eager():
    assert all(v["eager"] >= v["fused"] for v in FUSION_BYTES.values())
    assert FUSION_BYTES["rmsnorm"]["eager"] / FUSION_BYTES["rmsnorm"]["fused"] == 9


def test_matmul_rates_cpu():
    rows = matmul_rates(n=64, device="cpu", iters=1)
    assert [r["matmul"] for r in rows] == ["fp32 (CUDA cores)", "bf16 (Tensor Cores)"]
    assert all(r["TFLOP/s"] > 0 for r in rows)


def test_kv_quant_attention_rows():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = kv_quant_attention(2, 4, 2, 32, 40, device=device, dtype=torch.float16, iters=1)
    # the int8 rows keep their names and places (notebooks 02/03, the exercises, the planner read them); fp8 is last
    assert [r["attention"] for r in rows] == ["bf16 cache", "int8 cache, dequantised in the kernel",
                                              "int8 cache, dequantised first", "fp8 cache, dequantised in the kernel"]
    assert list(KV_ATTN_ROWS.values()) == [r["attention"] for r in rows]
    assert rows[1]["cache MB read"] < rows[0]["cache MB read"] < rows[2]["cache MB read"]
    elems = 2 * 2 * 40 * 2 * 32
    nbytes = [round(r["cache MB read"] * 1e6) for r in rows]
    assert nbytes[3] == nbytes[1] == elems + elems // 32 * 4  # int8 and fp8: 1 byte an element, scales counted
    assert nbytes[2] == nbytes[1] + 2 * 2 * elems and nbytes[0] == 2 * elems  # + write and re-read fp16
    assert rows[0]["rel_err vs bf16"] == 0
    assert 0 < rows[1]["rel_err vs bf16"] < KV_ROUNDING_BOUND["int8"]
    assert 0 < rows[2]["rel_err vs bf16"] < KV_ROUNDING_BOUND["int8"]
    assert 0 < rows[3]["rel_err vs bf16"] < KV_ROUNDING_BOUND["fp8"]


def test_int8_and_fp8_attention_speedups_are_bf16_time_over_theirs():
    rows = [{"attention": "bf16 cache", "us": 30.0}, {"attention": "int8 cache, dequantised in the kernel", "us": 20.0},
            {"attention": "int8 cache, dequantised first", "us": 90.0},
            {"attention": "fp8 cache, dequantised in the kernel", "us": 24.0}]
    assert int8_attention_speedup(rows) == 1.5
    assert fp8_attention_speedup(rows) == 1.25
    assert INT8_ATTN_SHAPE == {"seqs": 16, "heads": 32, "kv_heads": 8, "head_dim": 128, "context": 4096}
    assert INT8_ATTN_FIGURE == "kvcache.int8_attn_speedup_ctx4k_b16"
    assert FP8_ATTN_FIGURE == "kvcache.fp8_attn_speedup_ctx4k_b16"


@pytest.fixture(scope="module")
def sweep_rows():
    """Two contexts at tiny shapes (the interpreter's time grows with the programs launched), timed once."""
    return kv_quant_attention_sweep((40, 72), seqs=2, heads=4, kv_heads=2, head_dim=32, dtype=torch.float16,
                                    device="cpu", iters=1, copy_bandwidth=1e10, progress=False)


def test_kv_quant_attention_sweep_rows(sweep_rows):
    rows = sweep_rows
    assert [r["context"] for r in rows] == [40, 72]
    for r in rows:
        ctx = r["context"]
        elems, blocks = 2 * 2 * ctx * 2 * 32, 2 * -(-ctx // 16)
        other = 2 * 2 * 4 * 32 * 2 + blocks * 4  # q read and the output written (fp16), the block tables
        assert round(r["bf16 MB"] * 1e6) == elems * 2 + other
        assert round(r["int8 MB"] * 1e6) == round(r["fp8 MB"] * 1e6) == elems + elems // 32 * 4 + other
        assert r["copy GB/s (measured)"] == 10.0 and r["dtype"] == "float16"
        for fmt in ("bf16", "int8", "fp8"):
            assert r[f"{fmt} us"] > 0
            assert abs(r[f"{fmt} {FLOOR}"] / (r[f"{fmt} MB"] * 1e6 / 1e10 * 1e6) - 1) < 1e-9  # bytes / copy bw
            assert abs(r[f"{fmt} GB/s"] / (r[f"{fmt} MB"] / r[f"{fmt} us"] * 1e3) - 1) < 1e-9
        assert r["int8 speed-up"] == r["bf16 us"] / r["int8 us"] and r["fp8 speed-up"] == r["bf16 us"] / r["fp8 us"]
        assert 0 < r["int8 rel_err"] < KV_ROUNDING_BOUND["int8"] and 0 < r["fp8 rel_err"] < KV_ROUNDING_BOUND["fp8"]
    assert rows[1]["bf16 MB"] > rows[0]["bf16 MB"]


def test_plot_kv_quant_sweep_draws_each_format_and_its_floor(sweep_rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep_rows
    fig, ax = plt.subplots()
    assert plot_kv_quant_sweep(rows[::-1], ax=ax) is ax  # any order: drawn by context
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {f"{f}: {kind}" for f in ("fp16", "int8", "fp8 e4m3") for kind in ("measured", "bytes floor")}
    for fmt, key in (("fp16", "bf16"), ("int8", "int8"), ("fp8 e4m3", "fp8")):
        measured, floor = lines[f"{fmt}: measured"], lines[f"{fmt}: bytes floor"]
        assert list(measured.get_xdata()) == [40, 72]
        assert list(measured.get_ydata()) == [r[f"{key} us"] for r in rows]
        assert list(floor.get_ydata()) == [r[f"{key} {FLOOR}"] for r in rows]
        assert measured.get_color() == floor.get_color() and floor.get_linestyle() != "-"
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "µs" in ax.get_ylabel() and "context" in ax.get_xlabel()
    assert "batch 2, 4 query / 2 KV heads, d 32" in ax.get_title() and "(10.0 GB/s)" in ax.get_title()
    plt.close(fig)


def test_norm_sweep_rows_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    rows = norm_sweep([3, 7], 96, torch.float16, "cpu", iters=1)
    assert {r["rows"] for r in rows} == {3, 7}
    assert {"triton_fused_residual", "eager_add_then_norm"} <= {r["impl"] for r in rows}
    assert all(r["gb_s"] > 0 for r in rows)
    fused = [r for r in rows if r["impl"] == "triton_fused_residual"]
    assert all(r["bytes"] == 4 * r["rows"] * 96 * 2 + 96 * 2 for r in fused)  # read x, r; write out, residual
    ax = plot_bandwidth(rows, ceiling_gb_s=10.0)
    assert len(ax.get_lines()) >= 3  # two implementations at least and the ceiling


def test_sdpa_gqa_baseline_computes_the_same_model_and_restores_it(tiny_model):
    """The decode step's strong baseline (SDPA with enable_gqa, K/V never copied per query group) is the same model:
    equal logits and greedy tokens, and the model's own attention comes back after the block."""
    model, _ = tiny_model
    ids = torch.randint(3, 8000, (2, 17), generator=torch.Generator().manual_seed(3))
    before = model.config._attn_implementation
    with torch.no_grad():
        ref, ref_tokens = model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)
        with sdpa_gqa(model):
            assert model.config._attn_implementation == "labkit_sdpa_gqa"
            got, tokens = model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)
    assert model.config._attn_implementation == before
    assert ((got - ref).norm() / ref.norm()) < 1e-5 and torch.equal(tokens, ref_tokens)
    # a left-padded batch: every decode step carries a mask, the path that packs each KV head's query group
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        with sdpa_gqa(model):
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, ref_tokens)


def test_sdpa_gqa_packed_decode_equals_repeated_heads():
    from labkit.experiments.kernels.study import sdpa_gqa_attention_forward

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 8, 1, 16, generator=g), torch.randn(3, 2, 11, 16, generator=g), \
        torch.randn(3, 2, 11, 16, generator=g)
    mask = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    mask[1, ..., :4] = False
    module = torch.nn.Module().eval()
    out, _ = sdpa_gqa_attention_forward(module, q, k, v, mask, scaling=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           attn_mask=mask, scale=0.25).transpose(1, 2)
    assert out.shape == (3, 1, 8, 16) and torch.allclose(out, ref, atol=1e-6)


def test_decode_steps_time_the_three_steps_and_name_the_headline(tiny_model):
    model, _ = tiny_model
    rows = decode_steps(model, [1, 2], 8, iters=1)
    assert [r["batch"] for r in rows] == [1, 2]
    r = rows[-1]
    assert r["speed-up"] == r["sdpa_gqa ms"] / r["patched ms"]
    assert r["speed-up vs hf sdpa"] == r["hf sdpa ms"] / r["patched ms"]
    figs = decode_step_figures(rows)
    assert figs == {"kernels.patched_step_speedup": r["speed-up"],
                    "kernels.patched_step_speedup_vs_hf_sdpa": r["speed-up vs hf sdpa"]}
    assert decode_step_figures([]) == {}
