"""Triton kernels, one file each (a package where an op needs several), with a torch reference beside every kernel.

``rms_norm`` (+ fused residual add), ``silu_and_mul``, ``rope`` (``apply_rope``), ``softmax``,
``flash_attention``, ``paged_attention`` (+ split context, int8/fp8 KV), ``paged_prefill_attention``,
``quantized_matmul`` (a package: ``w8a16_matmul``, ``w4a16_matmul``, the fused q/k/v + RoPE + cache projections,
the int4/int8 formats, and ``QuantTuning``, its tiles as data), ``fp8_quant`` (an FP8 GEMM's per-row activation
quantisation in one kernel), ``patch`` (``patch_model`` / ``unpatch`` for Hugging
Face Llama). Tuning is passed as data (arguments, ``QuantTuning``), never set as module flags. The benchmarks and
studies that measure these kernels live in ``labkit.experiments.kernels`` and ``research/``.
Import the modules (``from labkit.kernels.rms_norm import rms_norm``); this package exports no names, so
``from labkit.kernels import paged_attention`` stays the module.
"""
