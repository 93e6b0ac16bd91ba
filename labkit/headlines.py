"""The headline ratios of the workbook and the baseline each one is measured against: the strongest a user would
really pick, measured in the same run (DESIGN's "strong baselines").

Each ``Headline`` names its figure, the baseline in words, and the figures of the same quantity measured against
weaker baselines in the same record (footnotes): every figure here is *baseline cost / labkit's cost* (a speed-up,
a capacity ratio) or the baseline's own waste, so a stronger baseline gives a smaller value. ``problems`` checks,
on the figures of one record, that the headline is not above any of its alternatives: a headline whose baseline is
beaten by a weaker-named one is quoting the wrong baseline. Prose quotes the headline; a footnote may quote an
alternative beside it (``tests/test_headlines.py`` checks both).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HEADLINES", "NOISE", "Headline", "by_figure", "problems"]


@dataclass(frozen=True)
class Headline:
    """``figure`` is measured against ``baseline`` (words); ``alternatives`` are the same quantity against weaker
    baselines, which ``figure`` must not exceed where they are measured in the same record."""

    technique: str
    figure: str
    baseline: str
    alternatives: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.figure in self.alternatives:
            raise ValueError(f"{self.figure} is its own alternative")


HEADLINES = (
    Headline("fused RMSNorm (notebook 03)", "kernels.rmsnorm_speedup_vs_compile",
             "torch.compile of HF's RMSNorm expression", ("kernels.rmsnorm_speedup_vs_eager",)),
    Headline("fused SwiGLU (notebook 03)", "kernels.swiglu_speedup_vs_compile",
             "torch.compile of HF's silu(gate) * up", ("kernels.swiglu_speedup_vs_eager",)),
    Headline("fused RoPE (notebook 03)", "kernels.rope_speedup_vs_compile", "torch.compile of HF's rotary expression",
             ("kernels.rope_speedup_vs_eager",)),
    Headline("flash attention, prefill (notebook 03)", "kernels.flash_attn_vs_cudnn",
             "SDPA's cuDNN backend, its default on Hopper", ("kernels.flash_attn_vs_sdpa",)),
    Headline("patched decode step (notebook 03)", "kernels.patched_step_speedup",
             "the same HF step with SDPA called with enable_gqa (no K/V copy per query group)",
             ("kernels.patched_step_speedup_vs_hf_sdpa",)),
    Headline("serving engine, offline (notebook 05)", "engine.offline_speedup_vs_hf",
             "the best HF generate mode (static cache + torch.compile on CUDA) on the same requests, measured whole",
             ("engine.offline_speedup_vs_hf_eager", "engine.offline_speedup_vs_hf_static",
              "engine.offline_speedup_vs_hf_static_compile")),
    Headline("serving engine, decode (bench decode)", "engine.speedup_vs_hf_compiled_b64",
             "HF generate with the static cache and torch.compile, same prompts, one run"),
    Headline("paged KV cache: capacity (notebook 02)", "kvcache.max_seqs_ratio_vs_workload_max",
             "contiguous slabs of the workload's longest sequence, both sides capped at max_num_seqs",
             ("kvcache.max_seqs_ratio",)),
    Headline("paged KV cache: time (notebook 02)", "kvcache.paged_speedup_vs_workload_max",
             "contiguous slabs of the workload's longest sequence, max_num_seqs capped, time from bytes read",
             ("kvcache.paged_speedup_vs_context_slab",)),
    Headline("contiguous KV cache: waste (notebook 02)", "kvcache.contiguous_waste_frac_workload_max",
             "slabs of the workload's longest sequence", ("kvcache.contiguous_waste_frac",)),
)
"""Every headline ratio, its baseline and its footnotes."""


def by_figure() -> dict[str, Headline]:
    """Each headline and each alternative figure name -> its ``Headline``."""
    out = {}
    for h in HEADLINES:
        for name in (h.figure, *h.alternatives):
            out[name] = h
    return out


NOISE = 0.02
"""How far a headline may sit above an alternative before its baseline counts as the weaker one: two baselines
within timing noise of each other are equally strong."""


def problems(figures: dict, headlines: tuple[Headline, ...] = HEADLINES, noise: float = NOISE) -> list[str]:
    """Where a headline is above an alternative measured beside it (by more than ``noise``, relative): ``figures``
    maps names to values (or to entries with ``value``) of *one record and run*. Empty when every headline quotes
    the strongest baseline measured there."""
    def value(name):
        e = figures.get(name)
        v = e.get("value") if isinstance(e, dict) else e
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None

    out = []
    for h in headlines:
        head = value(h.figure)
        if head is None:
            continue
        for alt in h.alternatives:
            a = value(alt)
            if a is not None and head > a * (1 + noise):
                out.append(f"{h.figure} = {head:.4g} is above {alt} = {a:.4g}: the baseline of {h.technique} "
                           f"({h.baseline}) is not the strongest measured in this record")
    return out
