"""The capstone (notebook 08) is rendered from the figures: no digit in its prose, every technique cell names
figures, derived figures come from GPU records with their machine."""

from pathlib import Path

import pytest

from labkit.data import REPO_ROOT
from labkit.experiments import capstone as cap
from labkit.plan import load_summary

SOURCE = REPO_ROOT / "notebooks" / "src" / "08_capstone.py"


def test_capstone_markdown_has_no_typed_number():
    assert cap.markdown_digits(SOURCE) == []


def test_markdown_digits_finds_a_typed_number(tmp_path: Path):
    src = tmp_path / "nb.py"
    src.write_text("# %% [markdown]\n# # 08 · title\n# decode runs at 72% of the floor\n# %%\nx = 3\n")
    assert cap.markdown_digits(src) == ["# decode runs at 72% of the floor"]


def test_technique_rows_are_data_with_the_four_columns():
    names = [r["technique"] for r in cap.TECHNIQUES]
    assert len(names) == len(set(names)) >= 12
    for r in cap.TECHNIQUES:
        assert all(isinstance(r[c], list) for c in cap.COLUMNS) and r["use"] and r["avoid"]


def test_technique_table_counts_empty_cells_and_links_records():
    figures = {"kvcache.prefix_saving_frac": {"value": 0.4, "unit": "fraction", "machine": "NVIDIA H200",
                                              "record": "results/h200/records/02_kv_cache.json"}}
    rows = [r for r in cap.TECHNIQUES if r["technique"] == "prefix caching"]
    table, empty, why = cap.technique_table(figures, rows)
    assert empty == 3 and len(why) == 3 and "prefix caching / accuracy" in why[0]
    assert table[0]["memory"] == "kvcache.prefix_saving_frac = 0.4 fraction"
    assert table[0]["memory_records"] == ["results/h200/records/02_kv_cache.json (NVIDIA H200)"]
    _, all_empty, _ = cap.technique_table({}, rows)
    assert all_empty == 4


def test_render_fills_figures_and_refuses_missing_ones():
    figs = {"a.b": {"value": 0.123}, "c.d": {"value": 7}}
    assert cap.fill_template("{a.b:.0%} and {c.d}", figs) == "12% and 7"
    with pytest.raises(AttributeError):
        cap.fill_template("{a.missing}", figs)


def test_derived_figures_come_from_gpu_records():
    derived = {d["name"]: d for d in cap.derived_figures()}
    assert {"kernels.int8_kv_attn_speedup", "quant.fp8_decode_speedup", "quant.fp8_kernels_per_step",
            "kernels.rmsnorm_speedup_vs_compile", "kernels.flash_attn_vs_cudnn", "quant.bf16_accum_rel_err",
            "quant.fp16_overflow_cases"} <= set(derived)
    assert all(d["machine"] != "cpu" and d["source"].startswith("results/h200/") for d in derived.values())
    assert 0 < derived["kernels.int8_kv_bytes_ratio"]["value"] < 1
    assert derived["quant.overflow_cases"].get("derived") and not derived["quant.fp16_overflow_cases"].get("derived")


def test_derived_figures_leave_out_what_a_notebook_has_measured_since():
    from labkit.figures import read_summary

    summary = read_summary()
    summary["figures"]["kernels.rmsnorm_speedup_vs_compile"] = {"unit": "x", "kind": "measured", "machines": {
        "h200": {"value": 1.1, "machine": "NVIDIA H200", "record": "results/h200/records/03_kernels.json"}}}
    names = {d["name"] for d in cap.derived_figures(summary)}
    assert "kernels.rmsnorm_speedup_vs_compile" not in names and "kernels.int8_kv_attn_speedup" in names


def _answer_inputs():
    """The committed figures, the derived ones, and the plan and arithmetic figures notebook 08 records (for a plan
    built by hand: the planner itself is tested in test_plan*.py)."""
    from labkit.plan import SCENARIO_175B, model_arithmetic
    from labkit.plan.serve import Plan

    figures = dict(load_summary())
    extra = {d["name"]: {"value": d["value"], "machine": d["machine"], "record": "results/h200/records/08.json"}
             for d in cap.derived_figures()}
    best = Plan(4, 1, 5, "bf16", "int8", 32, True, 119.0, 37.6, 100.0, 68.7, 900.0, 20.0, 20.4, True,
                ["not validated on multi-GPU"])
    for name, value, _, _ in cap.layout_figures(best, SCENARIO_175B):
        extra[name] = {"value": value, "machine": "NVIDIA H200", "record": "r"}
    for suffix, (value, _, _) in model_arithmetic().items():
        extra[f"plan.gpt3_175b_{suffix}"] = {"value": value, "machine": "cpu", "record": "r"}
    full, qlora = figures["finetune.gpt3_full_ft_peak_gb"], figures["finetune.gpt3_qlora_peak_gb"]
    extra["finetune.gpt3_qlora_vs_full_frac"] = {"value": qlora["value"] / full["value"], "machine": "cpu",
                                                 "record": "r"}
    figures.update(extra)
    return cap.by_class(extra=extra), figures


def test_the_answer_is_short_in_order_and_labels_every_proxy_number():
    classes, figures = _answer_inputs()
    text, evidence = cap.answer(classes, figures)
    assert cap.word_count(text) <= 300  # capstone.answer_words
    assert cap.proxy_labelled(text, evidence)  # capstone.proxy_labelled
    parts = [text.index(w) for w in ("GPT-3 175B", "Diagnosis", "Plan, cheapest first", "Communication", "Layout",
                                     "Verify")]
    assert parts == sorted(parts)
    assert "4.5 MiB of KV per token, 9 GiB per 2048-token sequence" in text and "349 GB of bf16 weights" in text
    assert "TP8 on 80 GB H100s and TP4 on 141 GB H200s" in text
    assert "5 replicas of TP4" in text and "not validated on multi-GPU" in text and "(TP4 x PP1)" not in text
    labels = {e["group"]: e["label"] for e in evidence}
    memory = next(e for e in evidence if e["group"] == "memory")
    # 02's headline waste (a slab sized to the workload's longest request) of the machine the label names, not the
    # whole-context slab's
    workload = classes[memory["class"]]["kvcache.contiguous_waste_frac_workload_max"]["value"]
    whole = classes[memory["class"]].get("kvcache.contiguous_waste_frac", {}).get("value")
    assert f"slabs {workload:.0%}" in text and (whole is None or f"slabs {whole:.0%}" not in text)
    assert labels["scheduling"] == "8B proxy, H100" and labels["memory"].endswith(memory["class"].upper())
    assert all(e["label"] in text for e in evidence)
    unlabelled = text.replace(labels["compute"], "")
    assert not cap.proxy_labelled(unlabelled, evidence)


def test_follow_ups_use_175b_figures():
    classes, figures = _answer_inputs()
    ft = cap.render_paragraph(cap.HINTS["Follow-up one: fine-tuning instead of inference"], classes, figures)[0]
    assert "103 GB, 3.7% of it" in ft and "2,796 GB" in ft
    prec = cap.render_paragraph(cap.HINTS["Follow-up three: FP32, BF16, INT8"], classes, figures)[0]
    assert "fp16 overflows in 3 and bf16 in 0" in prec and "(8B proxy, H200)" in prec
    with pytest.raises(KeyError, match="no such group"):
        cap.render_paragraph("{label.nothing}", classes, figures)
    with pytest.raises(ValueError, match="no plan meets"):
        cap.layout_figures(None, None)


def test_proxy_labels_name_a_size_and_a_machine():
    assert cap.proxy_label("h200") == "8B proxy, H200" and cap.proxy_label("cpu") == "8M proxy, CPU"
    assert cap.proxy_label("h100+h200") == "8B proxy, H100+H200"
    assert cap.proxy_label("h100", "memory_model") == "8M proxy, H100"  # 07 trains the embedded model on a GPU


def test_each_formats_plan_names_its_kernel_and_its_count_on_labkits_kernels():
    """The planner's per-format figures on the committed records: a GPU count, the kernel the plan's step reads its
    weights with, and the count with labkit's own kernels only (never fewer: the planner takes the fastest measured,
    labkit's among them); the capstone's kernel paragraph renders from them and the committed GEMM record."""
    from labkit.experiments import capstone as cap
    from labkit.plan import SCENARIO_175B, recommend

    rec = recommend(SCENARIO_175B)
    figs = {n: v for n, v, _, _ in cap.plan_figures(rec)}
    assert figs["plan.gpus_175b_bf16"] == rec.gpus("bf16") and "plan.gpus_175b_bf16_labkit" not in figs
    for w in ("fp8", "int8", "int4"):
        assert figs[f"plan.gpus_175b_{w}"] is None or figs[f"plan.gpus_175b_{w}"] <= figs[f"plan.gpus_175b_{w}_labkit"]
        assert isinstance(figs[f"plan.kernel_175b_{w}"], str)
    assert all(k.path in cap.kernels.TEACHING for k in cap.labkit_only(rec.cal).kernels)
    flat = {d["name"]: d for d in cap.derived_figures()}
    flat.update({n: {"value": v, "machine": rec.cal.machine} for n, v in figs.items()})
    flat["plan.gpus_175b_bf16"] = {"value": figs["plan.gpus_175b_bf16"], "machine": rec.cal.machine}
    classes = cap.by_class(extra={n: dict(e, machine=e["machine"]) for n, e in flat.items()})
    text, evidence = cap.render_paragraph(cap.KERNELS, classes, flat)
    assert "8B proxy, H200" in text and figs["plan.kernel_175b_fp8"] in text and "{" not in text
