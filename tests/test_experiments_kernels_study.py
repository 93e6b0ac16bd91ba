"""Notebook 03's arithmetic and experiments at tiny sizes on the CPU."""

import torch

from labkit.experiments.kernels.study import (
    FUSION_BYTES,
    INT8_ATTN_SHAPE,
    decode_step_figures,
    decode_steps,
    int8_attention_speedup,
    kv_quant_attention,
    matmul_rates,
    norm_sweep,
    operator_costs,
    plot_bandwidth,
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
    assert rows[1]["cache MB read"] < rows[0]["cache MB read"] < rows[2]["cache MB read"]
    assert rows[0]["rel_err vs bf16"] == 0 and all(r["rel_err vs bf16"] < 2e-2 for r in rows)


def test_int8_attention_speedup_is_bf16_time_over_int8_time():
    rows = [{"attention": "bf16 cache", "us": 30.0}, {"attention": "int8 cache, dequantised in the kernel", "us": 20.0},
            {"attention": "int8 cache, dequantised first", "us": 90.0}]
    assert int8_attention_speedup(rows) == 1.5
    assert INT8_ATTN_SHAPE == {"seqs": 16, "heads": 32, "kv_heads": 8, "head_dim": 128, "context": 4096}


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
