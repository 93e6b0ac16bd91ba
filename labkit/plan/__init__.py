"""An analytical planner: which layout serves a model on a cluster at a given traffic and latency objective.

For a ``ModelSpec``, a ``Cluster`` (GPU type, GPUs per node, nodes, links), ``Traffic`` (arrival rate, prompt and
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

Files: ``inputs`` (Cluster, Traffic, Calibration, validation), ``steps`` (step times), ``calibration`` (fitting
to the records, validation against them), ``serve`` (the serving model and the ranked plan), ``scenario`` (the
175B scenario and the one recommendation), ``summary`` (reading ``results/summary.json``).
"""

from labkit.plan.calibration import (
                                     FORMAT_GEMM_RECORD,
                                     NOMINAL,
                                     STEP_SWEEP_RECORD,
                                     calibration_of,
                                     fit_calibration,
                                     kernel_paths,
                                     load_calibration,
                                     mape,
                                     validate,
)
from labkit.plan.inputs import KV_DTYPES, WEIGHT_DTYPES, Calibration, Cluster, KernelPath, Traffic
from labkit.plan.scenario import SCENARIO_175B, Recommendation, Scenario, load_sweep, recommend, scenario_gpu
from labkit.plan.serve import Plan, best_by_format, explain, plan
from labkit.plan.steps import decode_step_time, kv_read_time, prefill_time, weight_paths
from labkit.plan.summary import TIERS, load_summary, strategy_table

__all__ = ["Calibration", "Cluster", "FORMAT_GEMM_RECORD", "KV_DTYPES", "KernelPath", "NOMINAL", "Plan",
           "Recommendation", "SCENARIO_175B", "STEP_SWEEP_RECORD", "Scenario", "TIERS", "Traffic", "WEIGHT_DTYPES",
           "best_by_format", "calibration_of", "decode_step_time", "explain", "fit_calibration", "kernel_paths",
           "kv_read_time", "load_calibration", "load_summary", "load_sweep", "mape", "plan", "prefill_time",
           "recommend", "scenario_gpu", "strategy_table", "validate", "weight_paths"]
