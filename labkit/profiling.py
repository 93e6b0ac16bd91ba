"""Diagnosis, measured: device time by category from ``torch.profiler``, and a decode step's time by part.

``profile_run`` says what happened: device time by category, the time the device sat idle between kernels (launch
and Python overhead), kernels per step, and the Chrome/Perfetto trace (``labkit.roofline`` says what the hardware
allows). ``step_part`` and ``step_breakdown`` attribute a decode step's time to its parts.

On the CPU there is no separate device: the profiler's aten operators stand in for kernels (self time, so nested
operators are not counted twice) and "idle" is the host time spent outside any operator (Python, framework).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CATEGORIES = ("matmul", "attention", "norm/elementwise", "memory copy", "communication")
STEP_PARTS = ("gemm", "attention", "norm", "rope/cache write", "activation", "sampling/logits", "copies/other")
"""The parts of a decode step ``step_part`` names: finer than ``CATEGORIES`` inside the elementwise kernels."""
_ELEMENTWISE = (r"elementwise|vectorized|reduce|norm|rsqrt|pow|mean|silu|gelu|softmax|mul|add|sub|div|"
                r"neg|exp|tanh|sigmoid|rotary|rope|embedding|index|gather|scatter|where|masked|cumsum|"
                r"argmax|max|topk|sort|sampl|triton|aten::(cos|sin|arange|unsqueeze|view|reshape|transpose|"
                r"expand|select|slice|t|permute|detach|alias|lift|resize_|_unsafe_view|as_strided|"
                r"ones|ones_like|zeros_like|empty_like|isin|any|all|eq|ne|lt|gt|le|ge|bitwise|logical|"
                r"clamp|min|sum|abs|_local_scalar_dense|item|is_nonzero|scalar_tensor|"
                r"_assert_async|new_ones|new_zeros|split|chunk|narrow|squeeze|flatten|repeat|"
                r"result_type|numpy_t|matmul)")
_PATTERNS = [  # (category, step part, pattern), tried in order: the first match names both
    ("communication", "copies/other", r"nccl|all_?reduce|all_?gather|reduce_scatter|broadcast|send|recv|gloo|c10d"),
    ("attention", "attention", r"flash|fmha|attention|attn|sdpa|cudnn.*mha"),
    ("matmul", "gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|wgmma|\bmm\b|aten::(mm|addmm|bmm|matmul|linear|"
                       r"_int_mm|_scaled_mm)|splitk|matmul|dot"),
    ("memory copy", "copies/other", r"memcpy|memset|aten::(copy_|to|_to_copy|clone|contiguous|cat|index_select|"
                                    r"index_copy_|index_put_|slice_scatter|stack|fill_|zero_|empty|full)|"
                                    r"catarraybatched|copy_kernel"),
    # the elementwise kernels, by what they compute where the name says it (the rest: copies/other)
    ("norm/elementwise", "norm", r"norm|rsqrt|pow|mean"),
    ("norm/elementwise", "rope/cache write", r"rotary|rope|rotate|aten::(cos|sin)$"),
    ("norm/elementwise", "activation", r"silu|gelu|tanh|sigmoid|act_and_mul"),
    ("norm/elementwise", "sampling/logits", r"softmax|argmax|topk|sort|cumsum|sampl"),
    ("norm/elementwise", "copies/other", _ELEMENTWISE),
]
_COMPILED = [(c, part, re.compile(p, re.IGNORECASE)) for c, part, p in _PATTERNS]


def categorize(name: str) -> str:
    """The category of a kernel or operator name, or ``other`` when no pattern claims it."""
    for cat, _, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


def step_part(name: str, scope: str = "") -> str:
    """The part of a decode step (``STEP_PARTS``) a kernel or operator belongs to: from ``scope`` (its callers,
    outermost first, separated by ' > ': operators and labkit functions, as ``profile_run(scopes=True)`` records them
    on the CPU), the outermost one whose name says a part other than copies/other; else from ``name`` itself. On the
    CPU the torch expressions of RoPE or SwiGLU are plain ``aten::mul``/``aten::cat``, known only by their caller
    (``rope_and_write``, ``act_and_mul``); on the GPU the Triton kernels' names say it."""
    for caller in (scope.split(" > ") if scope else []):
        part = _part(caller)
        if part not in ("copies/other", None):
            return part
    return _part(name) or "copies/other"


def _part(name: str) -> str | None:
    for _, part, pat in _COMPILED:
        if pat.search(name):
            return part
    return None


@dataclass
class KernelEvent:
    """One kernel (CUDA) or operator (CPU, its self time); ``scope``: its callers, outermost first, ' > ' between
    them (operators and labkit functions; recorded on the CPU by ``profile_run(scopes=True)``, else empty)."""

    name: str
    start_us: float
    dur_us: float
    category: str
    scope: str = ""


@dataclass
class ProfileResult:
    """Device time by category, idle time and kernel counts of a profiled region."""

    device: str
    wall_s: float
    steps: int
    events: list[KernelEvent]
    trace_path: str | None = None
    on_cuda: bool = True

    @property
    def busy_s(self) -> float:
        """Union of kernel intervals (overlapping kernels counted once); on the CPU, the sum of self times."""
        if not self.on_cuda:
            return self.device_s
        spans = sorted((e.start_us, e.start_us + e.dur_us) for e in self.events)
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total / 1e6

    @property
    def idle_s(self) -> float:
        return max(0.0, self.wall_s - self.busy_s)

    @property
    def idle_frac(self) -> float:
        return self.idle_s / self.wall_s

    @property
    def device_s(self) -> float:
        return sum(e.dur_us for e in self.events) / 1e6

    def by_category(self) -> dict[str, float]:
        """Seconds of device time per category (``other`` last)."""
        out = {c: 0.0 for c in (*CATEGORIES, "other")}
        for e in self.events:
            out[e.category] += e.dur_us / 1e6
        return out

    @property
    def covered_frac(self) -> float:
        """Share of device time that the named categories (not ``other``) account for."""
        cats = self.by_category()
        return 1 - cats["other"] / self.device_s if self.device_s else 0.0

    @property
    def kernels_per_step(self) -> float:
        return len(self.events) / self.steps

    def table(self) -> list[dict]:
        rows = [{"category": c, "time (ms)": s * 1e3, "share of device time": s / self.device_s}
                for c, s in self.by_category().items()]
        rows.append({"category": "idle (launch + Python)", "time (ms)": self.idle_s * 1e3,
                     "share of device time": float("nan")})
        return rows

    def top_kernels(self, n: int = 10) -> list[dict]:
        agg: dict[str, list[float]] = {}
        for e in self.events:
            agg.setdefault(e.name, []).append(e.dur_us)
        rows = sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:n]
        return [{"kernel": k[:90], "calls": len(v), "total (ms)": sum(v) / 1e3, "category": categorize(k)}
                for k, v in rows]

    def top_kernels_per_step(self, n: int = 10) -> list[dict]:
        """``top_kernels`` as calls and microseconds per step (of ``steps``)."""
        return [{"kernel": r["kernel"], "category": r["category"], "calls_per_step": r["calls"] / self.steps,
                 "us_per_step": r["total (ms)"] * 1e3 / self.steps} for r in self.top_kernels(n)]


def _scope(event) -> str:
    """The callers of a CPU operator that ``step_part`` reads: enclosing operators and labkit functions (with
    ``with_stack``, the profiler's Python frames are parents), outermost first."""
    names, p = [], event.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            names.append(p.name)
        elif "labkit/" in p.name:  # 'labkit/model/ops.py(74): rope_and_write'
            names.append(p.name.rsplit(": ", 1)[-1])
        p = p.cpu_parent
    return " > ".join(reversed(names))


def _device_events(prof, on_cuda: bool, scopes: bool = False) -> list[KernelEvent]:
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if on_cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            dur = e.time_range.end - e.time_range.start
        else:
            if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
                continue
            dur = e.self_cpu_time_total
        if dur > 0:
            out.append(KernelEvent(e.name, float(e.time_range.start), float(dur), categorize(e.name),
                                   _scope(e) if scopes and not on_cuda else ""))
    return out


def step_breakdown(step: Callable[[], object], top: int = 15, steps: int = 3) -> dict:
    """Where one step's device time goes: kernels per step, device time per step (kernel durations summed) and by
    category, the device's busy time per step (kernel intervals' union) and the ``top`` kernels by time, from a
    profile of ``steps`` calls of ``step`` (CUDA-graph replays are profiled kernel by kernel)."""
    res = profile_run(lambda: [step() for _ in range(steps)], steps=steps, warmup=1)
    return {"kernels_per_step": res.kernels_per_step, "device_us_per_step": res.device_s * 1e6 / steps,
            "busy_us_per_step": res.busy_s * 1e6 / steps, "top": res.top_kernels_per_step(top),
            "category_us_per_step": {c: t * 1e6 / steps for c, t in res.by_category().items()}}


def profile_run(fn: Callable[[], object], steps: int = 1, trace_path: str | None = None,
                warmup: int = 1, scopes: bool = False) -> ProfileResult:
    """Profile ``fn()`` (after ``warmup`` unprofiled calls) and attribute device time.

    ``steps`` is how many decode steps (or forwards) ``fn`` performs, for kernels per step. On CUDA the kernels
    are CUPTI's; on the CPU the aten operators' self times. ``trace_path`` exports a Chrome/Perfetto trace.
    ``scopes``: also record each CPU operator's callers (``KernelEvent.scope``, for ``step_part``) from the Python
    stack (``with_stack``: the profiled wall time grows, about doubling for the embedded model's step).
    """
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    on_cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize()
    with profile(activities=activities, with_stack=scopes) as prof:
        t0 = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if trace_path:
        prof.export_chrome_trace(trace_path)
    events = _device_events(prof, on_cuda, scopes)
    device = torch.cuda.get_device_name() if on_cuda else "cpu"
    return ProfileResult(device, wall, steps, events, trace_path, on_cuda)


def plot_timeline(result: ProfileResult, ax=None, max_ms: float | None = None):
    """Kernels on a time axis, one row per category: the gaps are the idle device."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(10, 3))[1]
    if not result.events:
        return ax
    t0 = min(e.start_us for e in result.events)
    cats = [*CATEGORIES, "other"]
    colors = plt.get_cmap("tab10")
    for i, cat in enumerate(cats):
        spans = [((e.start_us - t0) / 1e3, e.dur_us / 1e3) for e in result.events if e.category == cat]
        if max_ms is not None:
            spans = [s for s in spans if s[0] <= max_ms]
        ax.broken_barh(spans, (i - 0.4, 0.8), color=colors(i))
    ax.set_yticks(range(len(cats)), cats)
    ax.set_xlabel("time (ms)")
    if max_ms is not None:
        ax.set_xlim(0, max_ms)
    return ax
