"""The capstone (notebook 08) is rendered from the figures: no digit in its prose, every technique cell names
figures, derived figures come from GPU records with their machine."""

from pathlib import Path

import pytest

from labkit.experiments import capstone as cap
from labkit.models import REPO_ROOT

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
    assert cap.render("{a.b:.0%} and {c.d}", figs) == "12% and 7"
    with pytest.raises(AttributeError):
        cap.render("{a.missing}", figs)


def test_derived_figures_come_from_gpu_records():
    derived = {d["name"]: d for d in cap.derived_figures()}
    assert {"kernels.int8_kv_attn_speedup", "quant.fp8_decode_speedup", "quant.fp8_kernels_per_step"} <= set(derived)
    assert all(d["machine"] != "cpu" and d["source"].startswith("results/h200/") for d in derived.values())
    assert 0 < derived["kernels.int8_kv_bytes_ratio"]["value"] < 1
