"""Which kernel each quantised number of the capstone comes from, and which numbers a better kernel would change.

A quantised format's speed is its kernel's, not the format's: labkit's own kernels (the teaching kernels: a batch-one
GEMV, a plain tensor-core GEMM) win at one row and lose at serving batches to kernels built for them. The planner
takes the fastest kernel measured per format at each batch (``labkit.plan``), so its GPU counts move with the kernels
measured; the accuracy figures do not. ``plan_figures`` records, per weight format, the planner's GPU count with every
measured kernel, the kernel its plan's step reads the weights with, and the GPU count with labkit's own kernels only
(the same planner on a calibration holding only them); ``KERNELS`` is the paragraph notebook 08 renders from those
figures and notebook 04's kernel figures (``labkit.experiments.quantization.format_gemm``).
"""

from __future__ import annotations

from dataclasses import replace

from labkit.quant.peers import LABKIT_PATHS

WEIGHTS = ("bf16", "fp8", "int8", "int4")
TEACHING = frozenset({*LABKIT_PATHS.values(), "labkit int8 GEMV, engine step", "labkit int4 GEMV, engine step",
                      "torch._scaled_mm W8A8, engine step"})
"""Paths that are labkit's own kernels: the layers' own paths and notebook 04's engine steps (FP8's is
``Fp8Linear``'s eager quantisation and ``_scaled_mm``)."""

KERNELS = (
    "Which kernel each quantised number comes from ({label.kernels_q}): at one row labkit's GEMVs win, int4 at "
    "{quant.int4_labkit_gemm_speedup_b1:.2f}x bf16's linears; at a serving batch of sixty-four rows labkit's int4 "
    "GEMM runs {quant.int4_labkit_gemm_speedup_b64:.2f}x, the fastest int4 kernel measured "
    "({quant.int4_best_path_b64}) {quant.int4_best_gemm_speedup_b64:.2f}x, and the fastest FP8 kernel "
    "({quant.fp8_best_path_b64}) {quant.fp8_best_gemm_speedup_b64:.2f}x against a roofline of "
    "{quant.fp8_roofline_speedup_b64:.1f}x. The planner's FP8 plan reads its weights with {plan.kernel_175b_fp8} and "
    "serves the 175B on {plan.gpus_175b_fp8} GPUs ({plan.gpus_175b_fp8_labkit} with labkit's kernels only; bf16: "
    "{plan.gpus_175b_bf16}); int4 reads with {plan.kernel_175b_int4}, {plan.gpus_175b_int4} GPUs "
    "({plan.gpus_175b_int4_labkit} with labkit's). A faster kernel moves these speed-ups and GPU counts; the "
    "perplexity rows do not move.")
"""The capstone's paragraph on kernels, rendered from figures (``labkit.experiments.capstone.render_paragraph``)."""


def labkit_only(cal):
    """``cal`` with only labkit's own kernel paths (``TEACHING``) and the step sweep's fitted engine path."""
    return replace(cal, kernels=tuple(k for k in cal.kernels if k.path in TEACHING))


def plan_figures(rec, labkit_rec=None) -> list[tuple]:
    """``(name, value, unit, note)`` per weight format of a ``Recommendation``: ``plan.gpus_175b_{w}`` (fewest GPUs
    meeting the objective, None where no plan does), ``plan.kernel_175b_{w}`` (the path its step reads the weights
    with, at its largest batch) and, for the quantised formats, ``plan.gpus_175b_{w}_labkit`` (the same planner with
    labkit's own kernels only: ``labkit_rec``, planned here when not given)."""
    from labkit.model import get_config
    from labkit.plan import decode_step_parts, recommend

    sc = rec.scenario
    spec, cluster = get_config(sc.model), sc.cluster(rec.gpu)
    ctx = int(sc.traffic().mean("prompt") + sc.traffic().mean("output") / 2)
    if labkit_rec is None:
        labkit_rec = recommend(sc, cal=labkit_only(rec.cal))
    objective = f"{sc.rate_req_s} req/s, p99 TTFT <= {sc.ttft_s} s, TPOT <= {sc.tpot_s} s"
    out = []
    for w in WEIGHTS:
        p = rec.by_weights.get(w)
        out.append((f"plan.gpus_175b_{w}", p.gpus if p else None, "GPUs", f"fewest GPUs meeting the SLO with {w} "
                    f"weights, the fastest kernel measured per batch; {objective}"))
        kernel = decode_step_parts(spec, cluster, rec.cal, p.tp, p.pp, p.max_batch, ctx, w, p.kv,
                                   memory=False)["weights_path"] if p else "no plan meets the objective"
        out.append((f"plan.kernel_175b_{w}", kernel, "path",
                    f"the kernel the {w} plan's decode step reads its weights with, at its largest batch"))
        if w != "bf16":
            q = labkit_rec.by_weights.get(w)
            out.append((f"plan.gpus_175b_{w}_labkit", q.gpus if q else None, "GPUs",
                        f"fewest GPUs meeting the SLO with {w} weights and labkit's own kernels only; {objective}"))
    return out
