"""Appendix to notebook 04: the engine's A/B passes, every decode-step pass in one table, and the top kernels of
every profiled step. Moved out of notebook 04 to keep it to its question: they justify the engine's fusions; the main notebook
quotes only each method's best step.

What the engine fuses (labkit's ``ModelRunner``, notebook 05): q/k/v and gate/up merged into one GEMV each, RoPE and
the cache write in one kernel, paged decode attention -- about a dozen kernels per layer against HF's ~25. With
int4 or int8 weights each layer's neighbours fold into its GEMVs (``fused_forward``, on the stationary GEMVs): the
RMSNorms run in the prologues of the q/k/v and gate/up GEMVs, the residual adds in the stores of the o and down
GEMVs, SwiGLU as the down GEMV prepares its activations, RoPE and the k/v cache write as the q/k/v GEMV stores its
rows -- four GEMVs and attention per layer.

Each A/B pass flips one option against the default in the same run and records the default's speed-up (the step
with the option off over the step with it on; > 1: the option pays):

* ``quant.int4_layer_ops_fusion_speedup`` -- int4 with the norms and adds in kernels of their own
  (``fuse_layer_ops=False``);
* ``quant.int4_qkv_rope_fusion_speedup`` -- RoPE and the cache write in a kernel of their own (``fuse_qkv_rope``);
* ``quant.int4_gemv_pdl_speedup`` -- every GEMV launched plainly (``gemv_pdl=False``; by default every GEMV but the
  first is a programmatic dependent launch, whose programs start while the kernel ahead finishes);
* ``quant.int8_layer_ops_fusion_speedup`` -- the int8 step with separate kernels around the split-K int8 GEMV.

Two more options lost their A/B and left labkit (results/h200/records/04_quantization.json): decode attention as a
dependent launch (``quant.int4_early_attention_speedup``) and its merge folded into the split kernel
(``quant.int4_fused_attention_merge_speedup``).

Run on a GPU (the main job ``python -m labkit run`` does not run the appendix)::

    python notebooks/appendix/quantization_passes.py --out out/appendix

It writes ``records/quantization_passes.json`` and ``figures.json`` under ``--out`` (merge them with
``python -m labkit merge OUT results/<gpu>``).
"""

from __future__ import annotations

import argparse
import os
import sys

AB_PASSES = [("int4", {"fuse_layer_ops": False}), ("int4", {"fuse_qkv_rope": False}), ("int4", {"gemv_pdl": False}),
             ("int8", {"fuse_layer_ops": False})]
FIGURES = {("int4", "fuse_layer_ops"): "quant.int4_layer_ops_fusion_speedup",
           ("int4", "fuse_qkv_rope"): "quant.int4_qkv_rope_fusion_speedup",
           ("int4", "gemv_pdl"): "quant.int4_gemv_pdl_speedup",
           ("int8", "fuse_layer_ops"): "quant.int8_layer_ops_fusion_speedup"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/appendix", help="output folder for the record and figures.json")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    ap.add_argument("--iters", type=int, default=50, help="timed replays per step")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("the A/B passes time CUDA-graph replays of the engine on a GPU; no CUDA device here", file=sys.stderr)
        return 2
    os.environ["LABKIT_OUT"] = os.path.abspath(args.out)
    import pandas as pd

    import labkit  # noqa: F401
    from labkit.bench import record_figure, write_record
    from labkit.experiments.quantization import breakdown_tables, speed_rows
    from labkit.hardware import measure_copy_bandwidth
    from labkit.models import random_model

    bandwidth = measure_copy_bandwidth()
    big = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=0)
    common = dict(context_len=args.context, iters=args.iters, bandwidth=bandwidth)
    speed = speed_rows(big, methods=("int8", "int4", "fp8", "bnb-int8", "bnb-nf4"), **common)
    speed += speed_rows(big, methods=("int8", "int4", "fp8"), patch=True, breakdown=12, **common)
    speed += speed_rows(big, methods=("int8", "int4", "int4+lm_head", "int4+int8_head", "fp8"), runner="engine",
                        breakdown=16, **common)
    for method, opts in AB_PASSES:
        speed += speed_rows(big, methods=(method,), runner="engine", breakdown=16, engine_options=opts, **common)
    pd.set_option("display.width", 200)
    print(pd.DataFrame(speed).drop(columns=["samples_s", "breakdown"], errors="ignore").round(3).to_string())
    steps, kernels = breakdown_tables(speed)
    print(steps.round(3).to_string())
    print(kernels.round(1).to_string())
    rec = write_record("quantization_passes", {"context": args.context, "bandwidth_bytes_per_s": bandwidth,
                                               "speed": speed})
    ok = [r for r in speed if r.get("status") == "ok"]
    for (method, key), name in FIGURES.items():
        default = [r for r in ok if r["method"] == method and r["timing"] == "engine_graph"
                   and not r.get("engine_options")]
        ab = [r for r in ok if r["method"] == method and key in r.get("engine_options", {})]
        if not default or not ab:
            continue
        without, with_ = (default[0], ab[0]) if ab[0]["engine_options"][key] else (ab[0], default[0])
        record_figure(name, without["decode_ms"] / with_["decode_ms"], "x", rec,
                      note=f"llama-3-8b {method}, batch 1, engine graph replays in one run: {key}=False "
                      f"{without['decode_ms']:.3f} ms over {key}=True {with_['decode_ms']:.3f} ms")
    print(f"wrote {rec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
