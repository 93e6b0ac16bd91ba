"""Kernels per decode step and per layer, by name, from a profiler trace: what a format's step launches.

Notebook 04 uses it to explain the FP8 W8A8 step: each ``Fp8Linear`` quantises its activations with a chain of
eager torch ops (cast, abs, amax, divide, clamp, divide, clamp, cast to e4m3) before ``torch._scaled_mm``, so a
layer of seven linears launches about ten kernels per linear where the bf16 step launches one.

* ``kernel_counts``: profile a step (``labkit.profiling.profile_run``) and count every kernel by name: calls per
  step and per layer, and device time per step.
* ``count_summary``: kernels per step and per layer, and device time by category, from those rows.
* ``linear_ops``: the ops one linear layer's forward runs, in order (CUDA kernels on a GPU; top-level aten ops on
  the CPU, where each is what becomes one kernel on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from labkit.profiling import categorize, profile_run

# aten operators that only make a new view of a tensor: no kernel runs for them on a GPU
VIEW_OPS = frozenset(f"aten::{n}" for n in ("reshape", "view", "t", "transpose", "unsqueeze", "squeeze", "expand",
                                           "as_strided", "_unsafe_view", "detach", "alias", "slice", "select",
                                           "permute", "contiguous"))


def kernel_counts(step: Callable[[], object], layers: int, steps: int = 3) -> list[dict]:
    """Every kernel of ``steps`` profiled calls of ``step`` (after one warm-up call), one row per kernel name:
    ``calls_per_step``, ``calls_per_layer`` (over ``layers`` decoder layers), ``us_per_step`` and ``category``,
    sorted by device time. On the CPU the "kernels" are aten operators (their self time)."""
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r} must be a positive int (the model's decoder layers)")
    res = profile_run(lambda: [step() for _ in range(steps)], steps=steps, warmup=1)
    agg: dict[str, list[float]] = {}
    for e in res.events:
        a = agg.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += e.dur_us
    rows = [{"kernel": name[:100], "category": categorize(name), "calls_per_step": n / steps,
             "calls_per_layer": n / steps / layers, "us_per_step": us / steps} for name, (n, us) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def count_summary(rows: list[dict], layers: int) -> dict:
    """Kernels per step and per layer, device microseconds per step, and both by category, from ``kernel_counts``
    rows (or a profiled step's ``top`` list, which then covers only its top kernels)."""
    kernels = sum(r["calls_per_step"] for r in rows)
    by_cat: dict[str, dict[str, float]] = {}
    for r in rows:
        c = by_cat.setdefault(r["category"], {"kernels_per_step": 0.0, "us_per_step": 0.0})
        c["kernels_per_step"] += r["calls_per_step"]
        c["us_per_step"] += r["us_per_step"]
    return {"kernels_per_step": kernels, "kernels_per_layer": kernels / layers,
            "us_per_step": sum(r["us_per_step"] for r in rows), "by_category": by_cat}


def linear_ops(layer: nn.Module, tokens: int = 1, dtype: torch.dtype | None = None) -> list[str]:
    """The ops one forward of ``layer`` (an ``nn.Linear`` or a quantised linear) over ``tokens`` rows runs, in
    launch order: CUDA kernel names on a GPU; on the CPU the top-level aten operators that are not mere views
    (``VIEW_OPS``), each of which launches a kernel on a GPU unless it converts to the dtype it already has."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    buf = next(layer.buffers(), None)
    ref = next(layer.parameters(), buf)
    if ref is None:
        raise ValueError(f"layer={type(layer).__name__} holds no weights to take a device from")
    in_features = getattr(layer, "in_features", None)
    if not in_features:
        raise ValueError(f"layer={type(layer).__name__} has no in_features")
    dtype = dtype or (torch.bfloat16 if ref.device.type == "cuda" else torch.float32)
    x = torch.randn(tokens, in_features, device=ref.device, dtype=dtype)
    with torch.no_grad():
        layer(x)  # warm-up: lazy initialisation stays out of the list
        on_cuda = ref.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=acts) as prof:
            layer(x)
            if on_cuda:
                torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    if on_cuda:
        return [e.name for e in events if e.device_type == DeviceType.CUDA]
    return [e.name for e in events if e.name.startswith("aten::") and e.name not in VIEW_OPS
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
