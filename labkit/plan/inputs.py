"""The planner's inputs: a ``Cluster``, ``Traffic``, the ``Calibration`` of step times, and their validation.

Every check names the argument, the value and what is allowed: a planner fed ``tp=0`` or a NaN rate would
otherwise divide by zero or rank nonsense layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from labkit.bench.workload import LengthDist
from labkit.checks import ArgumentTypeError, check_choice, check_positive_int
from labkit.hardware import Hardware

WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4")
"""Weight formats the planner can place: bf16 and three 8/4-bit formats with measured kernels."""
KV_DTYPES = ("bf16", "fp8", "int8")
"""KV-cache formats the planner can place."""


def check_formats(name: str, values, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """One format name or several (a tuple or list of them), as a tuple of names from ``allowed``."""
    if isinstance(values, str):
        values = (values,)
    if not isinstance(values, (tuple, list)):
        raise ArgumentTypeError(f"{name}={values!r} must be a format name or a tuple of them; allowed: "
                                f"{list(allowed)}")
    if not values:
        raise ValueError(f"{name}=() is empty; allowed: {list(allowed)}")
    return tuple(check_choice(name, v, allowed) for v in values)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs; ``intra`` links GPUs inside a node, ``inter`` across nodes."""

    gpu: Hardware
    gpus_per_node: int = 8
    nodes: int = 1
    intra: str = "nvlink4"
    inter: str = "ib-ndr"

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, Hardware):
            raise ValueError(f"gpu={self.gpu!r} must be a labkit.hardware.Hardware (get_hardware('h200'))")
        check_positive_int("gpus_per_node", self.gpus_per_node)
        check_positive_int("nodes", self.nodes)
        from labkit.parallel.cost_model import LINKS, Link

        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                check_choice(name, getattr(self, name), sorted(LINKS))

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Traffic:
    """Poisson arrivals at ``rate_req_s`` with prompt and output lengths from two distributions."""

    rate_req_s: float
    prompt_len: LengthDist
    output_len: LengthDist

    def __post_init__(self) -> None:
        if not (isinstance(self.rate_req_s, (int, float)) and math.isfinite(self.rate_req_s)
                and self.rate_req_s > 0):
            raise ValueError(f"rate_req_s={self.rate_req_s!r} must be a finite number > 0 (requests per second)")
        for name in ("prompt_len", "output_len"):
            if not isinstance(getattr(self, name), LengthDist):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a LengthDist (LengthDist.fixed(512))")

    def quantile(self, which: str, q: float) -> float:
        xs = _samples(self._dist(which))
        return float(xs[min(len(xs) - 1, int(q * len(xs)))])

    def mean(self, which: str) -> float:
        return _mean(self._dist(which))

    def _dist(self, which: str) -> LengthDist:
        if which not in ("prompt", "output"):
            raise ValueError(f"which={which!r} is unknown; allowed: ['prompt', 'output']")
        return self.prompt_len if which == "prompt" else self.output_len


@lru_cache(maxsize=64)
def _mean(dist: LengthDist) -> float:
    xs = _samples(dist)
    return sum(xs) / len(xs)


@lru_cache(maxsize=64)
def _samples(dist: LengthDist, n: int = 20000) -> tuple[int, ...]:
    """Sorted draws of a length distribution (seeded), shared by every candidate of a plan."""
    import torch

    return tuple(sorted(dist.sample(n, torch.Generator().manual_seed(0))))


@dataclass(frozen=True)
class KernelPath:
    """One measured way to run a format's matmuls (or KV reads), as a time ratio to bf16 at one batch.

    ``ratio`` = this path's time / the bf16 path's time at ``batch`` rows (measured in the same record); it stands
    for that batch only: no planner input is carried across batches. ``params``: weights of the layer shape it was
    measured on (0: not recorded); where a format has rows of several shapes, a step takes the shape nearest its own
    per-GPU layer. ``record``: the record it comes from; ``machine``: where it was measured."""

    fmt: str
    path: str
    batch: int
    ratio: float
    record: str
    machine: str
    params: int = 0


@dataclass(frozen=True)
class Calibration:
    """How this software's steps relate to the roofline, fitted to measured single-GPU steps.

    Decode, per stage and micro-batch: ``layers x layer_overhead_s + weight bytes / (bandwidth x
    bandwidth_eff[w]) + KV bytes / (bandwidth x kv_eff)``, plus ``params x dequant_s_per_param[w]`` when quantised
    weights multiply more than one row (the dequantising GEMM path, which costs compute per weight that the
    batch-1 GEMV does not); never less than the FLOPs at ``compute_eff``. Prefill: ``layers x
    prefill_layer_overhead_s + FLOPs / (matmul rate x compute_eff[w])``. Every efficiency is at most 1 (time
    is never below its floor) and every overhead at least 0. ``layer_overhead_s`` is the fixed cost of a layer's
    kernels (launches, tails, small kernels that never reach bandwidth); it scales with the layers a stage holds.

    ``kernels``: further measured paths per weight format (``KernelPath``, e.g. cuBLAS ``torch._scaled_mm`` for
    FP8, tinygemm for int4) whose time is the bf16 weight read times their ratio; a decode step uses the fastest
    path measured for its format at its micro-batch, padded up to the next measured batch as the engine pads a step
    to its captured graph's batch (``padded_batch``), and none measured only at smaller batches. ``swept_batches``: per
    weight format the step sweep measured, the (smallest, largest) decode batch it measured: its fitted path stands
    for batches in that range only (bf16, the baseline every ratio multiplies, everywhere). ``kv_paths``: the same for
    KV formats (the KV read of bf16 times the ratio); a KV format with no measured path is charged the bf16 time (its
    memory saving counts, an unmeasured speed-up does not). ``machine``: the machine of the records that calibrated
    it.

    ``collectives``: alpha-beta fits of collectives measured on several GPUs of one node (``{"all_reduce@8":
    {"alpha_s", "beta_bytes_per_s"}}``), used instead of the datasheet links where they hold the rank count;
    ``multi_gpu``: the multi-GPU step record that validates layouts of more than one GPU ("" while none exists:
    those predictions are ``labkit.plan.steps.MULTI_GPU_CAVEAT``).
    """

    bandwidth_eff: dict
    compute_eff: dict
    layer_overhead_s: float
    source: str
    kv_eff: float = 1.0
    dequant_s_per_param: dict = field(default_factory=dict)
    prefill_layer_overhead_s: float = 0.0
    kernels: tuple = ()
    kv_paths: tuple = ()
    machine: str = "nominal"
    collectives: dict = field(default_factory=dict)
    multi_gpu: str = ""
    swept_batches: dict = field(default_factory=dict)

    def bw(self, weights: str) -> float:
        return self.bandwidth_eff.get(weights, self.bandwidth_eff.get("bf16", min(self.bandwidth_eff.values())))

    def compute(self, weights: str) -> float:
        return self.compute_eff.get(weights, self.compute_eff.get("bf16", min(self.compute_eff.values())))

    def dequant(self, weights: str) -> float:
        """Seconds per weight parameter of the batched dequantising path (0 for unquantised weights)."""
        if weights in ("bf16", "fp16"):
            return 0.0
        return self.dequant_s_per_param.get(weights, max(self.dequant_s_per_param.values(), default=0.0))

    def swept(self, weights: str, batch: int | None = None) -> bool:
        """Whether the step sweep measured this weight format itself (its fitted path applies), and with ``batch``:
        at a batch inside the range it measured (bf16 at any batch)."""
        if weights not in self.bandwidth_eff:
            return False
        if batch is None or weights == "bf16" or weights not in self.swept_batches:
            return True
        lo, hi = self.swept_batches[weights]
        return lo <= batch <= hi

    def measured(self, fmt: str, kv: bool = False) -> bool:
        """Whether any path of ``fmt`` was measured, at any batch."""
        return any(p.fmt == fmt for p in (self.kv_paths if kv else self.kernels))

    def padded_batch(self, fmt: str, batch: int) -> int | None:
        """The smallest batch of at least ``batch`` rows at which a weight path of ``fmt`` was measured (None past
        the largest): the batch a step of ``batch`` sequences runs, padded up as the engine pads a step to the
        batch of its captured CUDA graph. Its time is measured; nothing is carried from a smaller batch."""
        return min((p.batch for p in self.kernels if p.fmt == fmt and p.batch >= batch), default=None)

    def paths(self, fmt: str, batch: int, kv: bool = False, params: int | None = None) -> list[KernelPath]:
        """The paths of ``fmt`` measured at ``batch`` itself (none stands for another batch). Where they were
        measured on layers of several shapes, those of the shape nearest ``params`` weights per layer (by ratio)."""
        rows = [p for p in (self.kv_paths if kv else self.kernels) if p.fmt == fmt and p.batch == batch]
        shapes = {p.params for p in rows}
        if params and len(shapes) > 1:
            near = min(shapes, key=lambda s: (abs(math.log(max(s, 1) / params)), -s))
            rows = [p for p in rows if p.params == near]
        return rows
