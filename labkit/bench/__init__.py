"""The measurement layer: timing, result records and figures here; serving benchmarks (``labkit.bench.serving``:
workloads replayed against the engine on a virtual or real clock, SLO metrics) and their workloads
(``labkit.bench.workload``); counted, skipped and timed collectives (``labkit.bench.collectives``); timed pipeline
schedules (``labkit.bench.schedules``). Product code (``labkit.model``, ``engine``, ``kvcache``, ``kernels``,
``quant``, ``parallel``) never imports it: a measurement wraps the product from outside.

Timing: CUDA events (through ``triton.testing.do_bench``, which also clears L2 between runs) on the GPU,
optionally as CUDA-graph replays for launches shorter than ~50 us; ``perf_counter`` on the CPU. Always a warm-up,
always the median with its spread, always the raw samples kept.

Records: one JSON file per experiment, with the device name, library versions, git commit, run id, the command that
made it and the raw timings. Figures: each named number the workbook quotes, with its unit, machine, run, kind
(measured or derived) and the record it came from, collected in ``figures.json`` of the run's output folder and
merged into ``results/summary.json`` (``labkit.figures``: each figure's value per machine class, side by side).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from labkit.data import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "results"
SUMMARY_PATH = RESULTS_DIR / "summary.json"


@dataclass
class Timing:
    """Samples of one timed region, in seconds, and how they were taken."""

    samples_s: list[float]
    method: str
    extra: dict = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median_s

    @property
    def median_us(self) -> float:
        return 1e6 * self.median_s

    def quantile_s(self, q: float) -> float:
        s = sorted(self.samples_s)
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how far apart repeated runs land."""
        return (self.quantile_s(0.9) - self.quantile_s(0.1)) / self.median_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(median_s=self.median_s, p10_s=self.quantile_s(0.1), p90_s=self.quantile_s(0.9))
        return d

    def __repr__(self) -> str:
        return (f"Timing(median={self.median_ms:.4f} ms, spread={self.spread:.2f}, n={len(self.samples_s)}, "
                f"{self.method})")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device | str | None = None, warmup: int = 3, iters: int = 20,
            cuda_graph: bool = False) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``iters`` timed ones.

    On CUDA, samples come from ``triton.testing.do_bench`` (CUDA events, L2 cleared before each call) or, with
    ``cuda_graph=True``, ``do_bench_cudagraph`` (graph replays: no launch overhead). On the CPU, ``perf_counter``.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        return _time_cuda(fn, dev, warmup, iters, cuda_graph)
    if cuda_graph:
        raise ValueError("cuda_graph=True needs a CUDA device; CUDA graphs do not exist on the CPU")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing(samples, "wall_clock")


def _time_cuda(fn, dev: torch.device, warmup: int, iters: int, cuda_graph: bool) -> Timing:
    import triton.testing as tt

    for _ in range(warmup):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    est_ms = max(1e3 * (time.perf_counter() - t0), 1e-3)
    rep_ms = max(est_ms * iters, 5 * est_ms)
    if cuda_graph:
        ms = tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="all")
        return Timing([m / 1e3 for m in ms], "cuda_graph_replay")
    ms = tt.do_bench(fn, warmup=est_ms, rep=rep_ms, return_mode="all")
    return Timing([m / 1e3 for m in ms], "cuda_events")


def time_region(fn: Callable[[], object], device: torch.device | str | None = None, warmup: int = 1,
                iters: int = 5) -> Timing:
    """Time a long region (a whole generate, a served workload) by wall clock with device synchronisation."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        samples.append(time.perf_counter() - t0)
    return Timing(samples, "wall_clock_synced")


# --- records --------------------------------------------------------------------------------------------------
def git_commit() -> str:
    """The commit of the code that ran: ``$LABKIT_GIT_COMMIT`` when set (a copy of a working tree, as the H200
    runs get, can sit on an older ``.git`` whose HEAD is not the code), else git's HEAD (with ``-dirty``), else
    unknown."""
    given = os.environ.get("LABKIT_GIT_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def environment() -> dict:
    """Device, library versions, commit and command: the header of every record."""
    import transformers

    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "command": os.environ.get("LABKIT_COMMAND", " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])),
        "profile": os.environ.get("LABKIT_PROFILE"),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run": run_id(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def machine_tag() -> str:
    """Short machine label for figures: the GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def output_dir() -> Path:
    """Where the current run writes records: ``$LABKIT_OUT`` (set by the workbook runner) or ``out/local``."""
    out = Path(os.environ.get("LABKIT_OUT", REPO_ROOT / "out" / "local"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def _jsonable(x):
    if isinstance(x, Timing):
        return x.to_dict()
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} to a record")


def write_record(name: str, data: dict, out_dir: Path | str | None = None) -> Path:
    """Write ``records/<name>.json`` under ``out_dir`` with the environment header; returns its path."""
    if not name or "/" in name:
        raise ValueError(f"name={name!r} must be a non-empty file stem without '/'")
    folder = Path(out_dir) if out_dir is not None else output_dir()
    (folder / "records").mkdir(parents=True, exist_ok=True)
    path = folder / "records" / f"{name}.json"
    path.write_text(json.dumps({"env": environment(), "data": data}, indent=1, default=_jsonable))
    return path


def record_figure(name: str, value, unit: str, record: Path | str, bar: str | None = None,
                  out_dir: Path | str | None = None, note: str | None = None, machine: str | None = None,
                  derived: bool = False) -> dict:
    """Add one named figure to ``figures.json`` of the run's output folder and return its entry.

    ``record`` is the record file the number comes from; ``bar`` states the issue's bar ("<= 0.04") if any;
    ``machine``: where it was measured, when not this machine (a figure derived from a committed GPU record);
    ``derived``: the value is configuration or arithmetic fixed by the code (a request count, bytes per parameter of
    a format, a roofline intensity, a datasheet number), not a measurement: a claim cannot rest on such figures
    alone. Each entry carries the run it was recorded in (``run_id()``), so that claims compare figures of one run.
    """
    if "." not in name:
        raise ValueError(f"figure name {name!r} must be '<area>.<figure>', e.g. 'kvcache.paged_waste_frac'")
    folder = Path(out_dir) if out_dir is not None else output_dir()
    path = folder / "figures.json"
    figures = json.loads(path.read_text()) if path.exists() else {}
    value = value.item() if isinstance(value, torch.Tensor) else value
    entry = {"value": value, "unit": unit, "machine": machine or machine_tag(), "record": str(record),
             "run": run_id(), "kind": "derived" if derived else "measured"}
    if bar:
        entry["bar"] = bar
    if note:
        entry["note"] = note
    figures[name] = entry
    path.write_text(json.dumps(figures, indent=1, default=_jsonable))
    return entry


# --- runs and machines ----------------------------------------------------------------------------------------
_PROCESS_RUN: list[str] = []


def new_run_id() -> str:
    """A run id: the UTC start time and the commit of the code, ``2026-12-07T10:00:00Z@16cb26f0a1b2``."""
    commit = git_commit()
    head, dirty = (commit[:-6], "-dirty") if commit.endswith("-dirty") else (commit, "")
    return f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}@{head[:12]}{dirty}"


def run_id() -> str:
    """The run a figure belongs to: ``$LABKIT_RUN_ID`` (``python -m labkit run`` sets one for all its notebooks),
    else one id per process (a Jupyter kernel, a benchmark script), made on first use."""
    given = os.environ.get("LABKIT_RUN_ID")
    if given:
        return given
    if not _PROCESS_RUN:
        _PROCESS_RUN.append(new_run_id())
    return _PROCESS_RUN[0]
