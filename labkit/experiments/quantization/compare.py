"""Every method side by side: the rows of notebook 04's trade-off table.

``accuracy_rows`` quantises a trained model with each method and measures held-out perplexity, per-layer error,
bytes held and the peak memory of a forward. ``speed_rows`` times one
decode step (CUDA-graph replay over a static cache) of a large random-weight model per method: speed does not
depend on weight values, accuracy does (DESIGN.md, "two scales").
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.experiments.quantization.metrics import (
    heldout_perplexity,
    hf_decode_step_time,
    layer_errors,
    linear_weight_bytes,
    model_decode_bytes,
    peak_allocated,
)
from labkit.quant import HEAD_METHODS, METHODS, quantize, target_linears

BASELINE = "base"


HEAD_SUFFIXES = {"lm_head": True, **{f"{m}_head": m for m in HEAD_METHODS}}


def method_options(spec: str) -> tuple[str, dict]:
    """A row's method name as ``quantize`` arguments: ``"int4"`` -> ``("int4", {})``; a ``+lm_head`` suffix
    quantises the LM head too: ``"int4+lm_head"`` -> ``("int4", {"lm_head": True})``; ``+int8_head`` (a method of
    ``HEAD_METHODS``) quantises it by that method: ``"int4+int8_head"`` -> ``("int4", {"lm_head": "int8"})``."""
    method, plus, flag = spec.partition("+")
    if plus and flag not in HEAD_SUFFIXES:
        raise ValueError(f"method {spec!r}: the suffixes allowed are {['+' + f for f in HEAD_SUFFIXES]} "
                         "(e.g. 'int4+lm_head')")
    if method not in METHODS:
        raise ValueError(f"method {spec!r}: {method!r} is unknown; allowed: {list(METHODS)}, each optionally "
                         "with '+lm_head'")
    return method, ({"lm_head": HEAD_SUFFIXES[flag]} if plus else {})


def _quantized(model: nn.Module, spec: str, **opts) -> nn.Module:
    if spec == BASELINE:
        return model
    method, extra = method_options(spec)
    return quantize(model, method, **extra, **opts)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _available(method: str) -> str | None:
    """None when ``method`` can run here, else the reason it cannot."""
    if method.startswith("bnb"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return "bitsandbytes is not installed"
    return None


def _failed(method: str, e: Exception) -> dict:
    """A row for a method that raised: the error is reported in the table and printed, never dropped. The
    unquantised baseline never gets here (its failure is re-raised: there would be nothing to compare with)."""
    msg = f"failed: {type(e).__name__}: {e}"[:300]
    print(f"{method}: {msg}", file=sys.stderr)
    return {"method": method, "status": msg}


def accuracy_rows(model: nn.Module, tokenizer, methods=METHODS, seq_len: int = 256,
                  max_windows: int | None = None, calib_samples: int = 64, calib_seq_len: int = 256,
                  error_tokens: tuple[int, int] = (4, 128), seed: int = 0, progress: bool = True) -> list[dict]:
    """One row per method (and one for the unquantised ``model``, method ``"base"``): perplexity and its change,
    mean/max per-layer output error, measured weight bytes of the linear layers (and their ratio to bf16),
    bits per weight, and the peak of tensor memory during one forward over ``error_tokens`` ``(batch, seq)``
    (last-position logits only, as in generation, so the LM head's output does not hide the rest).
    Decode time is ``speed_rows``' business. A method that cannot run or raises gets a row saying why. A
    method name may end in ``+lm_head`` or ``+int8_head`` (``method_options``): the LM head quantised too (by
    the method, or by int8); its error then joins the per-layer errors, while the bytes stay those of the layers
    every method replaces."""
    dev = _device(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, error_tokens, generator=g).to(dev)
    names = list(target_linears(model))  # the layers every method replaces, sized the same way in each
    for spec in methods:
        method_options(spec)  # an unknown method fails here, before anything is measured
    rows = []
    for method in tqdm([BASELINE, *methods], desc="methods", disable=not progress):
        reason = _available(method) if method != BASELINE else None
        if reason:
            rows.append({"method": method, "status": reason})
            continue
        try:
            rows.append(_accuracy_row(model, tokenizer, method, names, ids, seq_len, max_windows, calib_samples,
                                      calib_seq_len, seed))
        except Exception as e:  # report and go on to the next method
            if method == BASELINE:
                raise
            rows.append(_failed(method, e))
        _free(dev)
    base = rows[0]["ppl"]
    for r in rows:
        if "ppl" in r:
            r["ppl_delta_frac"] = r["ppl"] / base - 1
    return rows


def _accuracy_row(model, tokenizer, method, names, ids, seq_len, max_windows, calib_samples, calib_seq_len,
                  seed) -> dict:
    row = {"method": method}
    t0 = time.perf_counter()
    opts = {"tokenizer": tokenizer, "calib_samples": calib_samples, "calib_seq_len": calib_seq_len,
            "seed": seed} if method.startswith("gptq") else {}
    qm = _quantized(model, method, **opts)
    row["quantise_s"] = time.perf_counter() - t0
    row["ppl"] = heldout_perplexity(qm, tokenizer, seq_len=seq_len, max_windows=max_windows)
    if method != BASELINE:
        errs = layer_errors(model, qm, ids)
        row.update(layer_err_mean=statistics.fmean(errs.values()), layer_err_max=max(errs.values()),
                   layer_errors=errs)
    wb = linear_weight_bytes(qm, names)
    row.update(weight_bytes=wb["held"], weight_bytes_ratio=wb["ratio"], bits_per_weight=8 * wb["held"] / wb["params"])

    def forward():
        with torch.no_grad():
            qm(input_ids=ids, use_cache=False, logits_to_keep=1)

    row["forward_peak_bytes"] = peak_allocated(forward, _device(model))["peak_bytes"]
    row["status"] = "ok"
    return row


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def speed_rows(model: nn.Module, methods=("int8", "int4", "fp8", "bnb-int8", "bnb-nf4"), batch_size: int = 1,
               context_len: int = 512, iters: int = 50, patch: bool = False, bandwidth: float | None = None,
               progress: bool = True, breakdown: int = 0, runner: str = "hf",
               engine_options: dict | None = None) -> list[dict]:
    """Decode step time of ``model`` (method ``"base"``) and of each quantised copy, at ``batch_size`` with
    ``context_len`` cached tokens, as CUDA-graph replays on CUDA; ``speedup`` is over the base timed the same
    way (``methods`` as in ``accuracy_rows``, ``+lm_head`` included). bitsandbytes layers are timed eagerly
    (LLM.int8 picks outlier columns with data-dependent shapes, which a CUDA graph cannot capture), next to an
    eager base for a like-for-like ratio.

    ``patch``: also swap RMSNorm, SiLU-and-mul and attention for labkit's Triton kernels
    (``labkit.kernels.patch``) in every model timed, so the non-matmul kernels cost the same on both sides
    of each ratio and the bytes saved by the weights show through.

    ``bandwidth`` (bytes/s, measured): adds each step's floor, the bytes it must read (``model_decode_bytes``)
    over that bandwidth, and the fraction of the floor reached.

    ``breakdown > 0``: each CUDA-graph row (and each engine row) also gets ``breakdown``, its step's top kernels
    by device time (``labkit.profiling.step_breakdown``; ``breakdown_tables`` lays them out).

    ``runner``: ``"hf"`` times the model's own forward (``labkit.experiments.decode_step``); ``"engine"`` times labkit's
    serving forward on the same weights (``labkit.engine`` ``ModelRunner``: q/k/v and gate/up merged into one
    GEMV each, RoPE and the cache write in one kernel, paged decode attention; a CUDA-graph replay on CUDA), where
    a layer costs a dozen kernels instead of HF's ~25, so the step is closer to its weight bytes. bitsandbytes
    rows are refused there (its layers are not capturable). ``engine_options`` go to its ``ModelRunner`` (for an
    A/B in one run: ``{"fuse_layer_ops": False}`` keeps int8/int4 layers' norms and residual adds in kernels of their
    own) and are kept in each row.
    """
    if runner not in ("hf", "engine"):
        raise ValueError(f"runner={runner!r}; allowed: 'hf', 'engine'")
    if engine_options and runner != "engine":
        raise ValueError(f"engine_options={engine_options!r} need runner='engine'")
    for spec in methods:
        method_options(spec)
    dev = _device(model)
    rows, base_ms = [], {}
    for method in tqdm([BASELINE, *methods], desc="decode step", disable=not progress):
        reason = _available(method) if method != BASELINE else None
        if reason:
            rows.append({"method": method, "status": reason})
            continue
        try:
            if runner == "engine":
                rows += _engine_rows(model, method, batch_size, context_len, iters, bandwidth, base_ms, breakdown,
                                     engine_options or {})
            else:
                rows += _speed_rows(model, method, batch_size, context_len, iters, patch, bandwidth, base_ms,
                                    breakdown)
        except Exception as e:  # report and go on to the next method
            if method == BASELINE:
                raise
            rows.append(_failed(method, e))
        _free(dev)
    return rows


def _step_bytes(qm, model, batch_size, context_len) -> tuple[dict, float]:
    """The quantised copy's linear weight bytes (held and over bf16) and the bytes one decode step reads."""
    return linear_weight_bytes(qm, list(target_linears(model))), model_decode_bytes(qm, batch_size, context_len)


def _row(method, timing, t, base_ms, wb: dict, step_bytes: float, bandwidth, **extra) -> dict:
    if method == BASELINE:
        base_ms[timing] = t.median_ms
    row = {"method": method, "timing": timing, **extra, "decode_ms": t.median_ms, "spread": t.spread,
           "speedup": base_ms[timing] / t.median_ms, "weight_bytes": wb["held"], "weight_bytes_ratio": wb["ratio"],
           "step_bytes": step_bytes, "status": "ok", "samples_s": t.samples_s}
    if bandwidth:
        row["floor_ms"] = step_bytes / bandwidth * 1e3
        row["frac_of_floor"] = row["floor_ms"] / t.median_ms
    return row


def _engine_rows(model, method, batch_size, context_len, iters, bandwidth, base_ms, breakdown: int = 0,
                 options: dict | None = None) -> list[dict]:
    """One row: labkit's ``ModelRunner`` decode step over a paged cache (``engine.experiments.runner_step``)."""
    from labkit.bench import time_fn
    from labkit.experiments.batching import runner_step

    if method.startswith("bnb"):
        return [{"method": method, "timing": "engine", "status": "bitsandbytes layers are not CUDA-graph "
                 "capturable; timed through HF's forward only"}]
    qm = _quantized(model, method)
    step, runner = runner_step(qm, "decode", batch_size, context_len, **(options or {}))
    timing = "engine_graph" if runner.graph_batch_sizes else "engine_eager"
    t = time_fn(step, device=_device(model), warmup=2, iters=iters)
    extra = {"engine_options": dict(options)} if options else {}
    row = _row(method, timing, t, base_ms, *_step_bytes(qm, model, batch_size, context_len), bandwidth, **extra)
    if breakdown:
        from labkit.profiling import step_breakdown

        row["breakdown"] = step_breakdown(step, breakdown)
    del step, runner
    return [row]


def _speed_rows(model, method, batch_size, context_len, iters, patch, bandwidth, base_ms,
                breakdown: int = 0) -> list[dict]:
    """Rows of one method: CUDA-graph replay (and, for the base on CUDA, also eager) or eager for bnb."""
    graph = _device(model).type == "cuda"
    qm = _quantized(model, method)
    wb, step_bytes = _step_bytes(qm, model, batch_size, context_len)
    modes = [False] if method.startswith("bnb") else [graph]
    if method == BASELINE and graph:
        modes = [True, False]
    rows = []
    for use_graph in modes:
        if patch:
            from labkit.kernels.patch import patch_model

            patch_model(qm)
        try:
            t = hf_decode_step_time(qm, batch_size, context_len, cuda_graph=use_graph, iters=iters,
                                 breakdown=breakdown if use_graph else 0)
        finally:
            if patch:
                from labkit.kernels.patch import unpatch

                unpatch(qm)
        timing = "cuda_graph" if use_graph else "eager"
        row = _row(method, timing, t, base_ms, wb, step_bytes, bandwidth, patched=patch)
        if "breakdown" in t.extra:
            row["breakdown"] = t.extra["breakdown"]
        rows.append(row)
    return rows


def _profiled(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The rows that carry a ``breakdown``, and a label for each: method and pass."""
    profiled = [r for r in rows if r.get("breakdown")]
    keys = [f"{r['method']} ({'engine' if r['timing'].startswith('engine') else 'HF'}"
            f"{', patched' if r.get('patched') else ''}"
            f"{''.join(f', {k}={v}' for k, v in r.get('engine_options', {}).items())})" for r in profiled]
    return profiled, keys


def step_parts(row: dict) -> dict[str, float]:
    """A profiled step's timed milliseconds split into kernel categories and the time between kernels, summing to
    the timed step (``decode_ms``). Kernels can overlap (programmatic dependent launch) and the profiler slows a
    step down, so summed kernel durations can exceed the step: each category gets its share of the summed kernel
    time, applied to the busy time (the union of kernel intervals), capped at the timed step; the rest of the step
    is the time between kernels."""
    b = row["breakdown"]
    cats = b.get("category_us_per_step", {})
    total = sum(cats.values()) or 1.0
    busy_ms = min(b.get("busy_us_per_step", b["device_us_per_step"]) / 1e3, row["decode_ms"])
    parts = {c: busy_ms * us / total for c, us in cats.items()}
    parts["between kernels"] = row["decode_ms"] - busy_ms
    return parts


def plot_step_breakdown(rows: list[dict], ax=None):
    """One horizontal bar per profiled step of ``speed_rows`` (``breakdown > 0``): the timed step split by
    ``step_parts`` into kernel categories and the time between kernels; each bar is exactly the step's time, in
    ms. Returns the axes."""
    import matplotlib.pyplot as plt

    profiled, keys = _profiled(rows)
    if ax is None:
        ax = plt.subplots(figsize=(9, 0.45 * len(profiled) + 1.2))[1]
    parts = [step_parts(r) for r in profiled]
    cats = list(dict.fromkeys(c for p in parts for c in p if c != "between kernels")) + ["between kernels"]
    left = [0.0] * len(profiled)
    for c in cats:
        ms = [p.get(c, 0.0) for p in parts]
        ax.barh(keys, ms, left=left, label=c)
        left = [a + b for a, b in zip(left, ms)]
    ax.set_xlabel("ms per decode step (bar = timed step; split in proportion to profiled kernel time)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=3, loc="lower right")
    return ax


def breakdown_tables(rows: list[dict]):
    """Two DataFrames from ``speed_rows`` rows that carry a ``breakdown``: one row per step (kernels, kernel time,
    device busy time and the timed step, in ms), and the top kernels' microseconds per step, a column per step.
    Kernel names are cut to 100 characters, so two instantiations of one template can share a name: they add."""
    import pandas as pd

    profiled, keys = _profiled(rows)
    steps = pd.DataFrame([{"step": k, "kernels": r["breakdown"]["kernels_per_step"],
                           "kernel time (ms)": r["breakdown"]["device_us_per_step"] / 1e3,
                           "device busy (ms)": r["breakdown"].get("busy_us_per_step", float("nan")) / 1e3,
                           "step (ms)": r["decode_ms"]} for k, r in zip(keys, profiled)])
    kernels = pd.concat({k: pd.DataFrame(r["breakdown"]["top"]).groupby("kernel").us_per_step.sum()
                         for k, r in zip(keys, profiled)}, axis=1) if profiled else pd.DataFrame()
    return steps, kernels
