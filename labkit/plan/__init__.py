"""An analytical planner: which layout serves a model on a cluster at a given traffic and latency objective.

For a ``ModelConfig``, a ``Cluster`` (GPU type, GPUs per node, nodes, links), ``Traffic`` (arrival rate, prompt and
output lengths) and an ``SLO`` (p99 time to first token, time per output token), ``plan`` enumerates
tensor-parallel x pipeline-parallel layouts, weight and KV precisions and maximum batch sizes, and predicts for
each: memory per GPU (does it fit), the decode and prefill step times, communication, throughput and latency. The
step times are roofline floors (``labkit.parallel.cost_model``) scaled by efficiencies *calibrated from measured
H200 steps* (``scripts/bench_step_sweep.py``), so the prediction says what this software achieves, not what the
datasheet allows; ``validate`` reports how far the predictions land from the measurements. Each weight and KV
format takes the fastest path measured for it at the batch planned for (``labkit.plan.calibration.kernel_paths``).

Serving model (continuous batching, one replica of ``tp x pp`` GPUs, ``replicas`` of them share the traffic): with
``n`` sequences decoding, a step takes ``t(n)``; prefills are interleaved and take a share ``rho = lambda_r *
t_prefill`` of the time, so a token takes ``tpot = t(n) / (1 - rho)`` and Little's law gives ``n = lambda_r x
output_mean x tpot``, solved by fixed-point iteration; the layout is saturated when ``n`` would exceed the batch
limit. Time to first token is the prefill of a p99-length prompt, one decode step of waiting for a step boundary,
and the queueing of an M/D/1 prefill server at p99 (``-ln(0.01)`` times its mean wait). These are approximations,
stated as such; the engine notebook measures the real thing.

``decode_step_parts`` is the one cost model of a layout's decode step: the planner, notebook 06's tables
(``layouts``) and the capstone call it. Its efficiencies are fitted on single-GPU steps and its collectives are the
datasheet links (or a multi-GPU record's fits), so a prediction for more than one GPU carries ``MULTI_GPU_CAVEAT``
until a multi-GPU record exists.

Files: ``inputs`` (Cluster, Traffic, Calibration, validation), ``steps`` (step times), ``calibration`` (fitting
to the records, validation against them), ``serve`` (the serving model and the ranked plan), ``scenario`` (the
175B scenario and the one recommendation), ``layouts`` (notebook 06's tables), ``summary`` (reading
``results/summary.json``).
"""

from labkit.plan.arithmetic import USABLE, min_tp, model_arithmetic
from labkit.plan.calibration import (
                                     FORMAT_GEMM_RECORD,
                                     NOMINAL,
                                     STEP_SWEEP_RECORD,
                                     calibration_of,
                                     fit_calibration,
                                     kernel_paths,
                                     load_calibration,
                                     mape,
                                     multi_gpu_records,
                                     validate,
)
from labkit.plan.inputs import KV_DTYPES, WEIGHT_DTYPES, Calibration, Cluster, KernelPath, Traffic
from labkit.plan.layouts import LAYOUTS_175B, calibrated_cluster, every_layout, layout_rows, worked_example_175b
from labkit.plan.scenario import SCENARIO_175B, Recommendation, Scenario, load_sweep, recommend, scenario_gpu
from labkit.plan.serve import Plan, best_by_format, explain, plan
from labkit.plan.steps import (
                                     MULTI_GPU_CAVEAT,
                                     decode_step_parts,
                                     decode_step_time,
                                     kv_read_time,
                                     prefill_time,
                                     weight_paths,
)
from labkit.plan.summary import load_summary

__all__ = ["Calibration", "Cluster", "FORMAT_GEMM_RECORD", "KV_DTYPES", "KernelPath", "LAYOUTS_175B",
           "MULTI_GPU_CAVEAT", "NOMINAL", "Plan", "Recommendation", "SCENARIO_175B", "STEP_SWEEP_RECORD", "Scenario",
           "Traffic", "USABLE", "WEIGHT_DTYPES", "best_by_format", "calibrated_cluster", "calibration_of",
           "decode_step_parts", "decode_step_time", "every_layout", "explain", "fit_calibration", "kernel_paths",
           "kv_read_time", "layout_rows", "load_calibration", "load_summary", "load_sweep", "mape", "min_tp",
           "model_arithmetic", "multi_gpu_records", "plan", "prefill_time", "recommend", "scenario_gpu", "validate",
           "weight_paths", "worked_example_175b"]
