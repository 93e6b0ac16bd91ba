"""Triton kernels, one file each, with a torch reference beside every kernel.

``rms_norm`` (+ fused residual add), ``silu_and_mul``, ``rope`` (``apply_rope``), ``softmax``,
``flash_attention``, ``paged_attention`` (+ split context, int8/fp8 KV), ``quantized_matmul``
(``w8a16_matmul``, ``w4a16_matmul``), ``patch`` (``patch_model`` / ``unpatch`` for Hugging Face Llama),
``bench`` (``python -m labkit bench kernels``) and ``study`` (notebook 03's arithmetic and experiments).
Import the modules (``from labkit.kernels.rms_norm import rms_norm``); this package exports no names, so
``from labkit.kernels import paged_attention`` stays the module.
"""
