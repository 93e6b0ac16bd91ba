"""Reading ``results/summary.json``: the figures the planner and the capstone quote."""

from __future__ import annotations

from pathlib import Path

TIERS = [
    ("1 measure", "profile and roofline (01)", ["diagnose.decode_bs1_idle_frac", "diagnose.decode_intensity",
                                               "diagnose.prefill_intensity", "baseline.hf_decode_bs1_mbu"]),
    ("2 scheduling and CUDA graphs", "continuous batching, graph replay (05)",
     ["engine.decode_bs1_mbu", "engine.continuous_vs_static_throughput", "engine.offline_speedup_vs_hf"]),
    ("3 KV memory", "paged cache, prefix sharing, int8/fp8 KV (02)",
     ["kvcache.paged_waste_frac", "kvcache.max_seqs_ratio", "kvcache.int8_ppl_delta_frac"]),
    ("4 fused kernels", "Triton RMSNorm, SwiGLU, RoPE, attention (03)",
     ["kernels.rmsnorm_speedup_vs_eager", "kernels.flash_attn_vs_sdpa", "kernels.paged_attn_bw_frac"]),
    ("5 weight quantisation", "int8 / int4 / GPTQ / NF4 / FP8 (04)",
     ["quant.int8_ppl_delta_frac", "quant.int4_calibrated_ppl_delta_frac", "quant.int4_weight_bytes_ratio",
      "quant.int4_decode_speedup"]),
    ("6 parallel layout", "TP in a node, PP across nodes (06)",
     ["parallel.tp_logits_rel_err", "parallel.pp_bubble_measured", "parallel.pp_bubble_formula"]),
]
"""The earlier capstone's tiers (tier, technique, figure names), kept for ``strategy_table``; notebook 08 now reads
``labkit.experiments.capstone.TECHNIQUES``."""


def load_summary(path: Path | str | None = None, prefer: tuple[str, ...] | None = None) -> dict:
    """The figures of ``results/summary.json``, one value each (name -> entry with value, unit, machine, record,
    run): the first machine class of ``prefer`` that holds it (default: this machine's class if it is a GPU, then
    the H200, the H100, other GPUs, the CPU; ``labkit.figures.committed_figures``)."""
    from labkit.bench import SUMMARY_PATH
    from labkit.figures import committed_figures

    path = Path(path or SUMMARY_PATH)
    return committed_figures(prefer, path) if path.exists() else {}


def strategy_table(figures: dict) -> list[dict]:
    """One row per tier and figure: the committed value with its machine and record, or what is still missing."""
    rows = []
    for tier, technique, names in TIERS:
        for name in names:
            e = figures.get(name)
            rows.append({"tier": tier, "technique": technique, "figure": name,
                         "value": e["value"] if e else None, "unit": e["unit"] if e else "",
                         "bar": (e or {}).get("bar", ""), "machine": e["machine"] if e else "not measured yet",
                         "record": e["record"] if e else ""})
    return rows
