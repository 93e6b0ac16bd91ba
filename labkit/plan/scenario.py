"""The scenario's 175B question as data, and the one recommendation notebooks 06 and 08 both quote.

``SCENARIO_175B`` fixes the model, cluster, traffic and SLO; ``recommend`` calibrates the planner on the committed
records (or a fresh ``format_gemm`` measurement), plans, and returns the ranked plans, the best one and the best
per weight and KV format. Both notebooks call it, so they cannot disagree about the layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from labkit.bench.serving import SLO
from labkit.bench.workload import LengthDist
from labkit.checks import check_number, check_positive_int
from labkit.hardware import Hardware, get_hardware, measured_hardware
from labkit.model import get_config
from labkit.plan.calibration import STEP_SWEEP_RECORD, load_calibration
from labkit.plan.inputs import Calibration, Cluster, Traffic
from labkit.plan.serve import Plan, best_by_format, plan


@dataclass(frozen=True)
class Scenario:
    """A model served on ``nodes`` x ``gpus_per_node`` GPUs at ``rate_req_s`` (log-normal prompts of median
    ``prompt_median``, exponential outputs of mean ``output_mean``) under a p99 TTFT and a TPOT objective."""

    model: str = "gpt3-175b"
    gpu: str = "h200"
    gpus_per_node: int = 8
    nodes: int = 4
    intra: str = "nvlink4"
    inter: str = "ib-ndr"
    rate_req_s: float = 20.0
    prompt_median: int = 512
    output_mean: int = 128
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    batches: tuple = (8, 16, 32, 64, 128, 256)

    def __post_init__(self) -> None:
        get_config(self.model, "model")
        get_hardware(self.gpu, "gpu")
        for name in ("gpus_per_node", "nodes", "prompt_median", "output_mean"):
            check_positive_int(name, getattr(self, name))
        for name in ("rate_req_s", "ttft_s", "tpot_s"):
            check_number(name, getattr(self, name), 0, low_open=True)

    def cluster(self, gpu: Hardware) -> Cluster:
        return Cluster(gpu, gpus_per_node=self.gpus_per_node, nodes=self.nodes, intra=self.intra, inter=self.inter)

    def traffic(self) -> Traffic:
        return Traffic(self.rate_req_s, LengthDist.lognormal(self.prompt_median, 0.8, 16, 2048 - 256),
                       LengthDist.exponential(self.output_mean, 1, 256))

    def slo(self) -> SLO:
        return SLO(ttft_s=self.ttft_s, tpot_s=self.tpot_s)


SCENARIO_175B = Scenario()
"""GPT-3 175B on four nodes of eight H200s at 20 req/s, p99 TTFT <= 2 s, TPOT <= 100 ms."""


@dataclass
class Recommendation:
    """What ``recommend`` decided, with everything that decided it."""

    scenario: Scenario
    cal: Calibration
    gpu: Hardware
    plans: list[Plan]
    best: Plan | None
    by_weights: dict = field(default_factory=dict)
    by_kv: dict = field(default_factory=dict)

    @property
    def layout(self) -> str:
        return self.best.layout if self.best is not None else "no layout meets the objective"

    def gpus(self, weights: str) -> int | None:
        """GPUs of the best plan with ``weights`` that meets the SLO (None when none does)."""
        p = self.by_weights.get(weights)
        return p.gpus if p is not None else None


def scenario_gpu(scenario: Scenario, sweep: dict | None) -> Hardware:
    """The scenario's GPU with the sweep's measured ceilings (when the sweep was measured on that GPU)."""
    base = get_hardware(scenario.gpu)
    if sweep is None:
        return base
    return measured_hardware(sweep["data"]["ceilings"], base)


def recommend(scenario: Scenario = SCENARIO_175B, sweep_path: Path | str = STEP_SWEEP_RECORD,
              format_gemm: dict | None = None, cal: Calibration | None = None, **changes) -> Recommendation:
    """Plan ``scenario`` (with ``changes`` applied, e.g. ``tpot_s=0.05`` or ``intra="pcie5"``) on the calibration of
    the committed records (``cal`` overrides it) and return the ranked plans and the picks."""
    if not isinstance(scenario, Scenario):
        raise ValueError(f"scenario={scenario!r} must be a labkit.plan.Scenario")
    scenario = replace(scenario, **changes) if changes else scenario
    loaded, sweep = load_calibration(sweep_path, format_gemm=format_gemm)
    cal = cal or loaded
    gpu = scenario_gpu(scenario, sweep)
    plans = plan(scenario.model, scenario.cluster(gpu), scenario.traffic(), scenario.slo(), cal=cal,
                 batches=scenario.batches)
    best = plans[0] if plans and plans[0].meets_slo else None
    return Recommendation(scenario, cal, gpu, plans, best, best_by_format(plans), best_by_format(plans, "kv"))


def load_sweep(path: Path | str = STEP_SWEEP_RECORD) -> dict | None:
    """The committed step-sweep record, or None."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None
