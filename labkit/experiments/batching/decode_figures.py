"""The figures a ``bench decode`` run derives from its rows (``cli.py`` measures them): MBU, host share, the graph
pool and the ratio to HF static + compile per batch (``decode_figures``), the async-scheduling speed-up
(``async_decode_figures``) and each weight format's decode speed-up over bf16 (``quant_decode_figures``). Each
writes ``labkit.bench.record_figure`` entries pointing at the run's record."""

from __future__ import annotations


def quant_decode_figures(rows: list[dict], record, out_dir, suffix: str = "") -> dict:
    """``quant.{fmt}_decode_speedup_b{b}`` for each quantised format and batch of a ``bench decode --formats`` run:
    the bf16 step's time over the format's, both the engine's captured decode step replayed alone (end-to-end steps
    where no graph was captured), measured in the same run; and ``quant.{fmt}_decode_floor_ratio_b{b}``, the bytes
    the bf16 step must read over the format's (weights and KV cache: the speed-up reading them at one bandwidth
    would give; derived). ``rows`` of one scheduling mode; ``suffix`` ends the speed-ups' names ('_async' for
    rows with async scheduling; the floor ratio, the same in both modes, is recorded without one only)."""
    from labkit.bench import record_figure

    out = {}
    base = {r["batch"]: r for r in rows if r.get("weights", "bf16") == "bf16"}
    for r in rows:
        fmt, b = r.get("weights", "bf16"), r["batch"]
        if fmt == "bf16" or b not in base:
            continue
        key = "replay_step_s" if r.get("replay_step_s") and base[b].get("replay_step_s") else "step_median_s"
        speed = base[b][key] / r[key]
        e2e = base[b]["step_median_s"] / r["step_median_s"]
        kernels = ", ".join(f"{k} x{n}" for k, n in r.get("kernels_by_layer", {}).items())
        if not suffix:
            out[f"quant.{fmt}_decode_floor_ratio_b{b}"] = record_figure(
                f"quant.{fmt}_decode_floor_ratio_b{b}", base[b]["floor_bytes"] / r["floor_bytes"], "x", record,
                out_dir=out_dir, derived=True, note=f"bytes a bf16 decode step reads over a {fmt} step's (weights "
                f"and the KV cache of {b} sequences of {r['context']} tokens)")
        out[f"quant.{fmt}_decode_speedup_b{b}{suffix}"] = record_figure(
            f"quant.{fmt}_decode_speedup_b{b}{suffix}", speed, "x over bf16", record, out_dir=out_dir,
            note=f"engine decode step at batch {b}, context {r['context']}, "
                 f"{'CUDA-graph replay' if key == 'replay_step_s' else 'end to end'} (end to end {e2e:.2f}x); "
                 f"kernels: {kernels or 'labkit'}")
    return out


def decode_figures(rows: list[dict], record, out_dir, suffix: str = "") -> dict:
    """Figures of a ``bench decode`` run, per batch ``b``: ``engine.decode_b{b}_mbu`` (bytes a step must read,
    weights + KV, over step time over the datasheet bandwidth; the copy bandwidth measured in the same run where
    there is no datasheet) and ``engine.speedup_vs_hf_compiled_b{b}`` (engine tok/s over HF ``generate`` with the
    static cache and ``torch.compile``, same prompts, same process), where measured, and
    ``engine.cuda_graph_pool_mb_b{b}`` (the memory the step graphs reserved) and ``engine.decode_b{b}_host_frac``
    (the share of the step the replayed graph does not account for) where the engine captured them. ``rows`` of one
    scheduling mode; ``suffix`` ends every name ('_async' for rows with async scheduling: the same formulas; the graph
    pool, the same in both modes, is recorded without one only)."""
    from labkit.bench import record_figure

    out = {}
    overlap = " with async scheduling" if suffix else ""
    for r in rows:
        b = r["batch"]
        mbu, basis = (r["mbu_datasheet"], "datasheet") if r.get("mbu_datasheet") else (r["mbu"], "measured copy")
        out[f"engine.decode_b{b}_mbu{suffix}"] = record_figure(
            f"engine.decode_b{b}_mbu{suffix}", mbu, f"fraction of {basis} bandwidth", record, bar=">= 0.80",
            out_dir=out_dir, note=f"bench decode, batch {b}, context {r['context']}, end to end{overlap}")
        if r.get("replay_step_s"):
            out[f"engine.decode_b{b}_host_frac{suffix}"] = record_figure(
                f"engine.decode_b{b}_host_frac{suffix}", 1 - r["replay_step_s"] / r["step_median_s"],
                "fraction of the step", record, out_dir=out_dir, note=f"batch {b}{overlap}: 1 - (the captured step "
                "replayed alone) / (the engine's step end to end): host work the GPU waits for")
        if r.get("graph_pool_bytes") is not None and not suffix:
            out[f"engine.cuda_graph_pool_mb_b{b}"] = record_figure(
                f"engine.cuda_graph_pool_mb_b{b}", r["graph_pool_bytes"] / 1e6, "MB", record, out_dir=out_dir,
                note=f"device memory the engine's CUDA-graph captures reserved (graph batch sizes up to {b})")
        if r.get("hf_static+compile_tok_s"):
            out[f"engine.speedup_vs_hf_compiled_b{b}{suffix}"] = record_figure(
                f"engine.speedup_vs_hf_compiled_b{b}{suffix}", r["tok_s"] / r["hf_static+compile_tok_s"], "x", record,
                out_dir=out_dir, note=f"engine{overlap} over HF generate (static cache + torch.compile), same "
                "prompts, one run")
    return out


def async_decode_figures(rows: list[dict], record, out_dir) -> dict:
    """``engine.decode_b{b}_async_speedup`` for each batch measured in both modes (bf16 weights): the engine's
    decode step end to end without async scheduling over the step with it, the same run."""
    from labkit.bench import record_figure

    out, by_mode = {}, {}
    for r in rows:
        if r.get("weights", "bf16") == "bf16":
            by_mode[(r["batch"], r.get("async_scheduling", False))] = r
    for (b, overlap), r in sorted(by_mode.items()):
        if overlap and (b, False) in by_mode:
            out[f"engine.decode_b{b}_async_speedup"] = record_figure(
                f"engine.decode_b{b}_async_speedup", by_mode[(b, False)]["step_median_s"] / r["step_median_s"],
                "x", record, out_dir=out_dir, note=f"bench decode, batch {b}, context {r['context']}: the engine's "
                "step end to end without async scheduling over with it, one run")
    return out
