"""Where a decode step's time goes, part by part, each part against the bytes it must move (``bench decode
--profile``, notebook 05).

A profile of a few engine decode steps (``decode_rate(..., profile_steps=n)``: the engine's own steps, replayed from
its CUDA graph where it captured one) is cut into the parts of ``labkit.profiling.STEP_PARTS`` (GEMMs, attention,
norms, RoPE and the cache write, the activation, sampling and logits, copies and the rest; ``step_part`` names each
kernel) plus the **gaps**: the step's time that no kernel accounts for (the device idle inside the step: host work,
launches, input copies waited on). Each part has a floor: the bytes it must move (``decode_part_bytes``) over the
bandwidth the bench's MBU divides by (the copy bandwidth measured in the same run); ``floor_frac`` is floor / time,
the part's own bandwidth utilisation.

* ``decode_part_bytes``: the bytes of each part of one decode step, from the model's config and dtypes
* ``attribute_step``: a ``ProfileResult`` of ``steps`` decode steps -> the attribution (a JSON-ready dict)
* ``decode_attribution``: the attribution of a ``decode_rate`` row profiled on the device it ran on; on CUDA, where
  the profiler saw no kernel inside the graph replays, the same step profiled eagerly (the record says which)
* ``attribution_rows`` / ``format_attribution`` / ``plot_attribution``: the table, printed, and one plot
* ``attribution_figures``: ``engine.decode_b{b}_gap_frac``, ``_gemm_floor_frac`` and ``_attn_floor_frac``

What names cannot tell: on the GPU a kernel's name is all the profiler gives inside a graph replay, so torch's generic
kernels land by name (the logits' cast to float32 and the copy of the graph's output are copy kernels: copies/other;
the torch expressions of the ops, ``kernels='torch'``, are mostly generic elementwise kernels: copies/other too). The
default GPU plan runs each op as its own Triton kernel, whose name says the part. On the CPU every operator's callers
name it (``profile_run(scopes=True)``).

Which step time: on CUDA the engine's step end to end timed without the profiler (``step_median_s``: kernel
durations are the device's own and do not change under the profiler, host work does); on the CPU the profiled
wall time per step (the operators' self times include the profiler's overhead, so they are compared with the step
under the same profiler).
"""

from __future__ import annotations

from labkit.checks import check_number, check_positive_int
from labkit.model import dtype_bytes, dtype_name, get_config
from labkit.profiling import STEP_PARTS, ProfileResult, step_part

GAPS = "gaps"
"""The row of the step's time that no kernel accounts for."""


def decode_part_bytes(spec, batch: int, context: float, dtype="bf16", kv_dtype=None) -> dict[str, float]:
    """Bytes each part of one decode step of ``batch`` sequences must move, each sequence reading ``context``
    cached tokens: weights in ``dtype``, the KV cache in ``kv_dtype`` (default ``dtype``), activations in ``dtype``
    (16-bit at least, as ``labkit.roofline.roofline``). Per token ``T = batch``, ``L`` layers, hidden ``h``,
    q/kv widths ``q``/``k``, MLP width ``I``, vocabulary ``V``:

    * gemm: every matmul weight once (``decode_weight_bytes`` less the norms' weights: with them, the weights and
      the KV cache sum to the bench's MBU floor) + each projection's input and output per token (q/k/v: ``h`` in,
      ``q + 2k`` out; o: ``q`` in, ``h`` out; gate/up: ``h`` in, ``(m-1) I`` out; down: ``I`` in, ``h`` out;
      the LM head: ``h`` in, ``V`` out)
    * attention: the KV cache of every sequence (``batch * kv_bytes(context)``) + q read and the output written
    * norm: the 2L + 1 RMSNorms, each reading the hidden state and the residual and writing both (the residual
      add fused in: ``4 h`` per token), + the norms' weights
    * rope/cache write: q, k and v read, q and k written rotated, k and v written to the cache (``kv_dtype``),
      cos and sin (``rotary_dim`` values per token); without RoPE (learned positions) the cache write alone
    * activation: ``act(gate) * up``: ``2 I`` read, ``I`` written (``I`` and ``I`` without a gate)
    * sampling/logits: the logits read once (``batch * V``)
    * copies/other: the embedding rows read and written (``T * h``)
    """
    spec = get_config(spec, "spec")
    check_positive_int("batch", batch)
    check_number("context", context, 1)
    w = dtype_bytes(dtype)
    a = w if w >= 2 else dtype_bytes("bf16")
    kvb = dtype_bytes(kv_dtype or dtype)
    T, L, h, q, k, inter, V = (batch, spec.num_layers, spec.hidden_size, spec.q_size, spec.kv_size,
                               spec.intermediate_size, spec.vocab_size)
    norm_weights = (L * spec.norm_params_per_layer + h * (1 + spec.norm_bias) + L * spec.qk_norm * 2 * spec.head_dim)
    gated = spec.mlp_matrices - 1  # output widths of gate/up in units of I
    proj_io = (h + q + 2 * k) + (q + h) + (h + gated * inter) + (inter + h)
    rope = (q + 2 * k) * a + (q + k) * a + 2 * k * kvb + spec.rotary_dim * a
    return {
        "gemm": spec.decode_weight_bytes(dtype) - norm_weights * w + T * L * proj_io * a + T * (h + V) * a,
        "attention": batch * spec.kv_bytes(context, kv_dtype or dtype) + T * L * 2 * q * a,
        "norm": (2 * L + 1) * T * 4 * h * a + norm_weights * w,
        "rope/cache write": T * L * (2 * k * (a + kvb) if spec.learned_positions else rope),
        "activation": T * L * (3 if spec.gated_mlp else 2) * inter * a,
        "sampling/logits": batch * V * a,
        "copies/other": T * h * (w + a),
    }


def attribute_step(profile: ProfileResult, spec, batch: int, context: float, bandwidth: float, dtype="bf16",
                   kv_dtype=None, step_s: float | None = None, kernels_from: str = "") -> dict:
    """The attribution of ``profile`` (``steps`` decode steps of ``batch`` sequences at ``context`` cached tokens):
    per part of ``STEP_PARTS`` its microseconds a step, share of the step, floor (``decode_part_bytes`` over
    ``bandwidth`` bytes/s) and floor / time, then the gaps (``step_s`` less every kernel's time; ``step_s``
    default: the profiled wall time per step). ``kernels_from`` says what was profiled (kept in the result).
    A kernel sum over the step (overlapping streams, or a ``step_s`` timed apart from the profile) leaves no gap,
    and ``kernels_over_step_us`` says by how much."""
    if not isinstance(profile, ProfileResult):
        raise ValueError(f"profile={type(profile).__name__} must be a labkit.profiling.ProfileResult (profile_run)")
    if not profile.events:
        raise ValueError("profile holds no kernel or operator events: nothing ran inside the profiled region")
    check_positive_int("batch", batch)
    check_number("bandwidth", bandwidth, 0, low_open=True)
    if step_s is not None:
        check_number("step_s", step_s, 0, low_open=True)
    floors = decode_part_bytes(spec, batch, context, dtype, kv_dtype)
    n = profile.steps
    step_us = (step_s if step_s is not None else profile.wall_s / n) * 1e6
    us, calls, names = {p: 0.0 for p in STEP_PARTS}, {p: 0 for p in STEP_PARTS}, {p: {} for p in STEP_PARTS}
    for e in profile.events:
        p = step_part(e.name, e.scope)
        us[p] += e.dur_us / n
        calls[p] += 1
        names[p][e.name] = names[p].get(e.name, 0.0) + e.dur_us / n
    kernel_us = sum(us.values())
    gaps_us = max(0.0, step_us - kernel_us)
    parts = []
    for p in STEP_PARTS:
        floor_us = floors[p] / bandwidth * 1e6
        top = sorted(names[p].items(), key=lambda kv: -kv[1])[:3]
        parts.append({"part": p, "us_per_step": us[p], "share": us[p] / step_us, "kernels_per_step": calls[p] / n,
                      "floor_bytes": floors[p], "floor_us": floor_us,
                      "floor_frac": floor_us / us[p] if us[p] > 0 else None,
                      "top": [{"kernel": k[:90], "us_per_step": v} for k, v in top]})
    parts.append({"part": GAPS, "us_per_step": gaps_us, "share": gaps_us / step_us, "kernels_per_step": 0.0,
                  "floor_bytes": 0.0, "floor_us": 0.0, "floor_frac": None, "top": []})
    floor_us = sum(r["floor_us"] for r in parts)
    return {"batch": batch, "context": context, "dtype": dtype_name(dtype), "kv_dtype": dtype_name(kv_dtype or dtype),
            "device": profile.device, "steps_profiled": n, "kernels_from": kernels_from,
            "step_us": step_us, "step_basis": "given step_s" if step_s is not None else "profiled wall per step",
            "kernel_us": kernel_us, "kernels_per_step": profile.kernels_per_step, "gaps_us": gaps_us,
            "gap_frac": gaps_us / step_us, "kernels_over_step_us": max(0.0, kernel_us - step_us),
            "bandwidth_bytes_per_s": bandwidth, "floor_us": floor_us, "floor_frac": floor_us / step_us,
            "parts": parts}


def decode_attribution(model, row: dict, profile: ProfileResult, bandwidth: float, source, seed: int = 0,
                       **engine_kwargs) -> dict:
    """The attribution of a ``decode_rate`` row and the profile it took (``profile_steps``), on its device.

    On CUDA the step time is the row's ``step_median_s`` (the engine's step end to end, unprofiled); where the
    engine replayed CUDA graphs but the profiler saw no GEMM (no kernel inside the replays: older CUPTI), the same
    step (batch, context, engine options) is profiled eagerly and its kernels stand in for the graph's, which are the
    same kernels (``kernels_from`` says so). On the CPU the step time is the profiled wall time per step."""
    from labkit.experiments.batching.measure import profile_engine_decode

    dtype = next(model.parameters()).dtype
    spec, batch, context = get_config(model), row["batch"], row.get("profile_context", row["context"])
    on_cuda = profile.on_cuda
    what = "the engine's decode steps" + (", replayed from its CUDA graph" if row.get("cuda_graphs") else ", eager") \
        + (", async scheduling" if row.get("async_scheduling") else "")
    if on_cuda and row.get("cuda_graphs") and not any(step_part(e.name, e.scope) == "gemm" for e in profile.events):
        engine_kwargs = {k: v for k, v in engine_kwargs.items() if k not in ("cuda_graphs", "graph_batch_sizes",
                                                                                "graph_token_sizes")}
        profile = profile_engine_decode(model, batch, row["context"], profile.steps, source, cuda_graphs=False,
                                        seed=seed, **engine_kwargs)
        what = ("the same decode step run eagerly: the profile of the graph replays showed no kernel inside them; "
                "the step time is the replayed engine step's")
    return attribute_step(profile, spec, batch, context, bandwidth, dtype, step_s=row["step_median_s"] if on_cuda
                          else None, kernels_from=what)


def attribution_rows(att: dict) -> list[dict]:
    """One row per part and the gaps: µs a step, share of the step, floor µs, floor / actual, kernels a step."""
    return [{"part": r["part"], "us/step": r["us_per_step"], "share": r["share"], "floor us": r["floor_us"],
             "floor/actual": r["floor_frac"], "kernels/step": r["kernels_per_step"]} for r in att["parts"]]


def format_attribution(att: dict) -> str:
    """The table as text, with a header line saying what was profiled and the step time it divides."""
    head = (f"batch {att['batch']}, context {att['context']}: step {att['step_us']:.1f} us ({att['step_basis']}), "
            f"kernels {att['kernel_us']:.1f} us ({att['kernels_per_step']:.0f} a step), floor {att['floor_us']:.1f} "
            f"us at {att['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s; {att['kernels_from']}")
    lines = [head, f"  {'part':<18}{'us/step':>10}{'share':>8}{'floor us':>10}{'floor/act':>10}{'kern/step':>10}"]
    for r in attribution_rows(att):
        frac = "" if r["floor/actual"] is None else f"{r['floor/actual']:.2f}"
        lines.append(f"  {r['part']:<18}{r['us/step']:>10.1f}{r['share']:>8.1%}{r['floor us']:>10.1f}{frac:>10}"
                     f"{r['kernels/step']:>10.1f}")
    return "\n".join(lines)


def plot_attribution(att: dict, ax=None):
    """One panel: each part's time a step beside its floor (horizontal bars), the gaps last."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3.8))[1]
    rows = att["parts"][::-1]
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r["us_per_step"] for r in rows], height=0.4, color="tab:blue",
            label="measured")
    ax.barh([y - 0.2 for y in ys], [r["floor_us"] for r in rows], height=0.4, color="tab:gray", label="byte floor")
    for y, r in zip(ys, rows):
        if r["floor_frac"] is not None:
            ax.text(r["us_per_step"], y + 0.2, f" floor/actual {r['floor_frac']:.2f}", va="center", fontsize=8)
    ax.set_yticks(list(ys), [r["part"] for r in rows])
    ax.set_xlim(0, 1.3 * max(max(r["us_per_step"], r["floor_us"]) for r in rows))
    ax.set_xlabel("microseconds per step")
    ax.set_title(f"decode step, batch {att['batch']}: {att['step_us']:.0f} us, gaps {att['gap_frac']:.0%}")
    ax.legend(fontsize=8, loc="lower right")
    return ax


def attribution_figures(att: dict, record, out_dir=None, suffix: str = "") -> dict:
    """``engine.decode_b{b}_gap_frac`` (the step's share no kernel accounts for), ``engine.decode_b{b}_gemm_floor_frac``
    and ``engine.decode_b{b}_attn_floor_frac`` (floor / measured time of the GEMMs and of attention) of one
    attribution; ``suffix`` ends every name."""
    from labkit.bench import record_figure

    b, parts = att["batch"], {r["part"]: r for r in att["parts"]}
    where = f"batch {b}, context {att['context']}, {att['kernels_from']}"
    out = {f"engine.decode_b{b}_gap_frac{suffix}": record_figure(
        f"engine.decode_b{b}_gap_frac{suffix}", att["gap_frac"], "fraction of the step", record, out_dir=out_dir,
        note=f"bench decode --profile, {where}: 1 - (kernel time a step) / (step time, {att['step_basis']})")}
    for part, short in (("gemm", "gemm"), ("attention", "attn")):
        if parts[part]["floor_frac"] is not None:
            out[f"engine.decode_b{b}_{short}_floor_frac{suffix}"] = record_figure(
                f"engine.decode_b{b}_{short}_floor_frac{suffix}", parts[part]["floor_frac"],
                "fraction of measured copy bandwidth", record, out_dir=out_dir,
                note=f"bench decode --profile, {where}: the {part} kernels' byte floor (bytes they must move over the "
                     f"copy bandwidth) / their time a step")
    return out
