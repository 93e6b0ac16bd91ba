"""Notebook 06's layout tables, through the planner's one cost model (``labkit.plan.steps.decode_step_parts``).

``calibrated_cluster`` is a GPU of the scenario's kind with the calibration of the committed records: its measured
ceilings where the step sweep ran on that GPU, the datasheet's elsewhere (the same fitted efficiencies then stand
for another GPU, which the table says). ``layout_rows`` evaluates chosen ``(tp, pp, microbatches)`` layouts,
``every_layout`` every ``tp x pp`` split of a GPU count, and ``worked_example_175b`` the 175B layouts notebook 06
reads: the numbers of the planner and of notebook 06 for one layout come from the same function.
"""

from __future__ import annotations

from labkit.data import machine_class
from labkit.hardware import Hardware, get_hardware, measured_hardware
from labkit.model import ModelConfig, get_config
from labkit.plan import steps
from labkit.plan.calibration import STEP_SWEEP_RECORD, load_calibration
from labkit.plan.inputs import Calibration, Cluster

LAYOUTS_175B = [(8, 1, 1), (16, 1, 1), (8, 2, 1), (8, 2, 2), (4, 2, 2), (1, 8, 8)]
"""(tp, pp, micro-batches) of notebook 06's 175B table: TP in a node, TP across nodes, TP in a node x PP across
nodes with one and with ``pp`` micro-batches, a narrower TP, PP only."""


def calibrated_cluster(gpu: str | Hardware = "h200", gpus_per_node: int = 8, nodes: int = 2,
                       intra: str = "nvlink4", inter: str = "ib-ndr", sweep_path=STEP_SWEEP_RECORD,
                       cal: Calibration | None = None) -> tuple[Cluster, Calibration, str]:
    """(cluster, calibration, note): ``gpu`` with the committed sweep's measured ceilings when the sweep ran on that
    kind of GPU, its datasheet otherwise; the note says which."""
    loaded, sweep = load_calibration(sweep_path)
    cal = cal or loaded
    base = gpu if isinstance(gpu, Hardware) else get_hardware(gpu, "gpu")
    name = gpu if isinstance(gpu, str) else base.name
    measured_on = sweep["data"]["ceilings"].get("device", "?") if sweep else None
    if measured_on and machine_class(measured_on) == name:
        hw, note = measured_hardware(sweep["data"]["ceilings"], base), f"ceilings measured on {measured_on}"
    else:
        hw = base
        note = f"{name}: datasheet ceilings" + (f", efficiencies fitted on {measured_on}" if measured_on else "")
    return Cluster(hw, gpus_per_node=gpus_per_node, nodes=nodes, intra=intra, inter=inter), cal, note


def layout_rows(spec: ModelConfig | str, cluster: Cluster, cal: Calibration, layouts: list[tuple[int, int, int]],
                batch: int, context: int, weights: str = "bf16", kv: str = "bf16") -> list[dict]:
    """One ``decode_step_parts`` row per ``(tp, pp, microbatches)`` layout, labelled ``TPa x PPb``."""
    spec = get_config(spec, "spec")
    return [dict(steps.decode_step_parts(spec, cluster, cal, tp, pp, batch, context, weights, kv, m),
                 layout=f"TP{tp} x PP{pp}") for tp, pp, m in layouts]


def every_layout(spec: ModelConfig | str, cluster: Cluster, cal: Calibration, num_gpus: int, batch: int,
                 context: int, weights: str = "bf16", kv: str = "bf16") -> list[dict]:
    """Every ``tp x pp = num_gpus`` split (TP sizes that divide the heads, ``pp`` micro-batches), fitting ones
    first, fastest first: PP against TP decided by the numbers."""
    spec = get_config(spec, "spec")
    layouts = [(t, num_gpus // t, num_gpus // t) for t in range(1, num_gpus + 1)
               if num_gpus % t == 0 and spec.num_heads % t == 0 and num_gpus // t <= spec.num_layers]
    rows = layout_rows(spec, cluster, cal, layouts, batch, context, weights, kv)
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def worked_example_175b(gpu: str | Hardware = "h200", batch: int = 32, context: int = 2048, weights: str = "bf16",
                        cal: Calibration | None = None) -> list[dict]:
    """GPT-3 175B decoding on nodes of 8 ``gpu``: one row per layout of ``LAYOUTS_175B`` (see notebook 06)."""
    cluster, cal, note = calibrated_cluster(gpu, cal=cal)
    return [dict(r, hardware=note) for r in layout_rows("gpt3-175b", cluster, cal, LAYOUTS_175B, batch, context,
                                                          weights)]
