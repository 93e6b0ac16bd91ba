import json

import pytest

from labkit.workbook import (
    NOTEBOOK_DIR,
    SOURCE_DIR,
    build_notebooks,
    list_notebooks,
    notebook_from_percent,
    resolve_profile,
)

SRC = '''# %% [markdown]
# # Title
# some *text*
# %% tags=["parameters"]
profile = "auto"
# %%
x = 1
print(x)
'''


def test_percent_source_to_notebook():
    nb = notebook_from_percent(SRC)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds == ["markdown", "code", "code"]
    assert nb.cells[0].source == "# Title\nsome *text*"
    assert nb.cells[1].metadata["tags"] == ["parameters"]
    assert nb.cells[2].source == "x = 1\nprint(x)"


def test_committed_notebooks_match_sources_and_have_no_outputs():
    assert build_notebooks(check=True) == [], "run `python -m labkit build-notebooks`"
    nbs = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert len(nbs) == len(list(SOURCE_DIR.glob("[0-9][0-9]_*.py"))) >= 2
    for nb in nbs:
        cells = json.loads(nb.read_text())["cells"]
        assert all(not c.get("outputs") and c.get("execution_count") is None
                   for c in cells if c["cell_type"] == "code"), f"{nb.name} carries outputs"
        params = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(params) == 1 and 'profile = "auto"' in "".join(params[0]["source"]), nb.name


def test_profiles_and_selection():
    assert resolve_profile("ci") == "ci"
    assert resolve_profile("auto") in ("cpu", "gpu")
    with pytest.raises(ValueError, match="profile='fast' is unknown"):
        resolve_profile("fast")
    assert [p.stem[:2] for p in list_notebooks(["00"])] == ["00"]
    with pytest.raises(ValueError, match="match no notebook"):
        list_notebooks(["42"])


def test_readmes_results_table_and_unmet_bars_are_generated_from_summary():
    """README.md's results table and its list of bars not met, and results/README.md's list, are what
    ``python -m labkit readme`` writes from results/summary.json."""
    from labkit.bench import SUMMARY_PATH
    from labkit.figures import summary_table, unmet_bars
    from labkit.workbook import readme_blocks

    for path, text in readme_blocks().items():
        assert path.read_text() == text, f"{path} is out of date: run `python -m labkit readme`"
    readme = next(iter(readme_blocks()))
    assert summary_table(SUMMARY_PATH) in readme.read_text()
    for bar in unmet_bars():  # every bar not met is listed, per machine
        assert f"`{bar['figure']}`" in readme.read_text().split("<!-- bars:begin -->")[1]


def test_unmet_bars_are_listed_per_machine(tmp_path):
    import json

    from labkit.figures import unmet_bars_markdown

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": 2, "figures": {"a.x": {"unit": "x", "bar": ">= 2", "machines": {
        "h100": {"value": 1.5, "machine": "NVIDIA H100 80GB HBM3", "record": "results/h100/records/a.json", "run": "r"},
        "h200": {"value": 2.5, "machine": "NVIDIA H200", "record": "results/h200/records/a.json", "run": "s"}}}}}))
    md = unmet_bars_markdown(path, link_root="results/")
    assert "1 bars not met" in md and "- **h100** (NVIDIA H100 80GB HBM3):" in md and "h200" not in md
    assert "  - `a.x` 1.5 against >= 2 ([a.json](h100/records/a.json))" in md


def test_a_site_that_cannot_be_written_fails_the_run_with_a_message(tmp_path, capsys):
    import labkit.workbook as wb

    def unreadable(nb, out_dir, profile, timeout):  # an executed notebook the site cannot render
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / nb.name).write_text("not a notebook")
        return 0.1

    assert wb.run_workbook(profile="ci", only=["09"], out=tmp_path, execute=unreadable) == 1
    err = capsys.readouterr().err
    assert "the site (index.html) could not be written: " in err
    assert (tmp_path / "summary.md").exists()  # what the notebooks produced is still there


# Numbers the notebooks' prose may type: definitions, datasheet and paper numbers, model shapes and the notebooks' own
# configuration (phrase -> why). A measured finding is a claim or rendered from figures instead (DESIGN.md).
PROSE_NUMBERS = {
    "00_baseline": {"8.4 M parameters": "the embedded model's size (its model card)",
                    "16 GB of bf16 weights": "8B parameters x 2 bytes"},
    "01_diagnose": {"2 FLOPs per weight, 2 bytes per weight": "definition of a bf16 matmul's work and bytes"},
    "02_kv_cache": {"20-38% of KV memory holding tokens and lost 60-80%": "the vLLM paper (Kwon et al.)",
                    "wastes under 4%": "the vLLM paper", "8,192 slots for Llama-3-8B": "the model's context",
                    "cuts it 4x": "32 query heads over 8 KV heads",
                    "161 prompt and 338 output tokens": "the vLLM paper's ShareGPT means",
                    "run ten times the median": "a log-normal tail at sigma = 1 (definition of the mix)",
                    "keeps 1% of the blocks free": "vLLM's watermark, the simulation's setting",
                    "A block of 1": "definition", "2,048 for the tiny preset": "the preset's context",
                    "16 is the usual choice": "vLLM's default block size"},
    "03_kernels": {"32 sequences of": "the notebook's sizes", "moves 36 bytes per element": "FUSION_BYTES",
                   "(4 bytes)": "FUSION_BYTES", "42 bytes eager, 8 fused": "FUSION_BYTES",
                   "16384 rows x 8192 columns": "an example shape", "4 x rows x hidden x 2 bytes": "arithmetic",
                   "over five times as much": "FUSION_BYTES' ratio", "moves 537 MB": "4 x 16384 x 4096 x 2 bytes",
                   "32 query / 8 KV heads, head dim 128": "Llama-3-8B's shape", "2 FLOPs each": "definition",
                   "50 MB L2": "datasheet (H100 and H200)", "(1.0 = copy bandwidth": "definition of the axis",
                   "within 1e-2 in bf16": "DESIGN.md's tolerance", "(~1e-2 relative)": "DESIGN.md's tolerance",
                   "2x / 4x smaller weights": "bytes per weight of int8 and int4"},
    "04_quantization": {"8 or 4 bits": "definition", "threshold 6.0": "bitsandbytes' default",
                        "4096 inputs costs 1.0005 bytes": "format arithmetic",
                        "per group of 128 costs 0.5 + 4/128 = 0.531 (4.25 bits)": "format arithmetic",
                        "of those, 0.516": "format arithmetic", "6.98 B linear weights": "Llama-3-8B's shape",
                        "0.53 B LM-head weights": "Llama-3-8B's shape",
                        "within 2e-2 relative error per layer and 4-bit weights within 1e-1": "DESIGN.md's tolerances",
                        "1.05 GB in bf16, against 3.7 GB": "Llama-3-8B's shape x bytes per weight",
                        "about a fifth of what an int4 step reads": "the same arithmetic",
                        "5 exponent bits (max 65504) and 10 mantissa bits": "fp16's format",
                        "8 exponent bits (max 3.4e38)": "bf16's format", "only 7 mantissa bits": "bf16's format",
                        "2^(mantissa+1)": "arithmetic", "stops at 256": "2^8, bf16's mantissa",
                        "exceeds ~11": "ln(65504)", "reach ~256": "sqrt(65504)", "(error 1.0)": "definition",
                        "65504 ceiling": "fp16's format"},
    "05_batching": {"under three schedulers": "a count of the policies compared",
                    "batches of 3 (padded to 4), 1, 2 and 4": "the gate's configuration",
                    "(1 = FIFO is busy": "definition of the axis", "a quarter of the batch": "min_admit = batch // 4",
                    "mean 128 (clipped at 512)": "the offline recipe (configuration)",
                    "prompts of 512 tokens": "the offline recipe (configuration)"},
    "06_parallelism": {"350 GB of weights": "175B x 2 bytes", "17 all-reduces": "2 per layer x 8 layers + 1",
                       "nodes of 8 GPUs": "the cost model's setting", "(16 GPUs hold twice the KV)": "arithmetic",
                       "(2 and 4 ranks, KV heads replicated at 4)": "the notebook's layouts",
                       "within 1e-5": "the bar", "2 all-reduces per layer": "definition of Megatron TP"},
    "07_finetuning": {"(~3x the forward's FLOPs)": "the standard estimate", "(Adam: 2 moments)": "definition",
                      "16 bytes per parameter": "fp32 weights, gradients and two moments",
                      "transformers 5.24 and": "versions", "5.17)": "versions", "350 GB of weights": "175B x 2 bytes",
                      "2.8 TB": "175B x 16 bytes", "~0.52 bytes per parameter": "NF4 with double-quantised scales",
                      "from 8 to about 2 bytes per parameter": "8-bit AdamW's two moments"},
    "09_speculative": {"1.4 M parameters": "the draft model's size", "(0 for prompt lookup)": "definition",
                       "drops under 1": "definition of a slowdown"},
}


def test_notebook_prose_types_no_measured_number():
    """Every numeric finding in a notebook's markdown is a claim or rendered from figures: the markdown cells of
    notebooks/src hold no typed number but the allowed definitions (and every allowed phrase is still there)."""
    from labkit.workbook import SOURCE_DIR, markdown_numbers

    found = []
    for src in sorted(SOURCE_DIR.glob("[0-9][0-9]_*.py")):
        allowed = PROSE_NUMBERS.get(src.stem, {})
        found += [f"{src.name}:{i}: {n!r} in {text.strip()!r}" for i, n, text in markdown_numbers(src, tuple(allowed))]
        stale = [a for a in allowed if a not in src.read_text()]
        assert not stale, f"{src.name}: allowed phrases no longer in the notebook: {stale}"
    assert not found, "typed numbers in notebook prose (make them claims or render them):\n" + "\n".join(found)


def test_markdown_numbers_finds_typed_findings(tmp_path):
    from labkit.workbook import markdown_numbers

    src = tmp_path / "06_x.py"
    src.write_text("# %% [markdown]\n# # 06 · title\n# gloo takes about a hundred microseconds; 587 us here, 2.9e-07\n"
                   "# error, 1 of 56 layers, and 20-38% of it; `code 123` and notebook 03 and batch 16 are not.\n"
                   "# ```\n# python -m labkit run --only 01\n# ```\n# %%\nx = 587\n")
    got = [n for _, n, _ in markdown_numbers(src)]
    assert got == ["about a hundred", "587", "2.9e-07", "1", "56", "20-38%"]
    assert [n for _, n, _ in markdown_numbers(src, ("587 us here",))] == ["about a hundred", "2.9e-07", "1", "56",
                                                                          "20-38%"]
