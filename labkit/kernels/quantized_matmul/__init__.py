"""Weight-only quantised matmul with the dequantisation fused into the weight load (W8A16, W4A16).

``y = x @ W.T`` where ``W`` is stored as int8 (per-output-channel scale) or packed int4 (group-wise scale and
zero-point), in the formats of ``packing``. At decode batch sizes a linear layer is a GEMV: it reads every weight
byte once and does 2 FLOPs per weight, so its time is the weight bytes over bandwidth. Storing 1 or 0.5 bytes per
weight instead of 2 and expanding them in registers -- never in memory -- cuts that time about 2x or 4x (minus the
scales' bytes). Dequantising to a bf16 copy first, as the torch reference does, would read the int weights, write
and re-read bf16: slower than plain bf16.

The budget, 4096 -> 14336: int8 weights are 58.7 MB, int4 at group 128 29.4 MB plus 1.8 MB of scales and zeros,
bf16 117 MB; notebook 03 times each against its bytes (results/h200/records/03_kernels.json).

Files, by what they do:

* ``matmul.py``: the public functions and their torch references; which kernel a call takes.
* ``stationary.py``: the decode GEMVs (one 16-bit row, whole tiles): each program prepares a slice of activations
  once and walks down its rows; int4 and int8.
* ``splitk.py``: the general GEMVs (any shape, float32 too), split along K, autotuned on CUDA.
* ``gemm.py``: more than one row, on Tensor Cores.
* ``fused.py``: RMSNorm, SwiGLU, the residual add, RoPE and the paged-cache write inside the stationary GEMVs.
* ``ptx.py``: reading int4/int8 words in registers without conversion instructions; the packed float16 dots.
* ``tuning.py``: every tile as data (``QuantTuning``; ``HOPPER``, ``INTERPRETER``; ``tuning_for(device)``), with
  the measurements each choice rests on.
* ``packing.py``: the int4/int8 formats (``labkit.quant`` writes them; ``labkit.quant.packing`` re-exports them).

    from labkit.kernels.quantized_matmul import w4a16_matmul
    y = w4a16_matmul(x, packed, scales, zeros, group_size=128)   # x [..., K] -> y [..., N]
"""

from labkit.kernels.quantized_matmul.matmul import (
    w4a16_matmul,
    w4a16_matmul_ref,
    w4a16_qkv_rope_cache,
    w8a16_matmul,
    w8a16_matmul_ref,
    w8a16_qkv_rope_cache,
)
from labkit.kernels.quantized_matmul.packing import dequantize_int4, dequantize_int8, pack_int4, unpack_int4
from labkit.kernels.quantized_matmul.tuning import (
    HOPPER,
    INTERPRETER,
    GemmTile,
    QuantTuning,
    SplitKTile,
    StationaryPlan,
    StationaryRule,
    StationaryTile,
    stationary_plan,
    tuning_for,
)

__all__ = ["HOPPER", "INTERPRETER", "GemmTile", "QuantTuning", "SplitKTile", "StationaryPlan", "StationaryRule",
           "StationaryTile", "dequantize_int4", "dequantize_int8", "pack_int4", "stationary_plan", "tuning_for",
           "unpack_int4", "w4a16_matmul", "w4a16_matmul_ref", "w4a16_qkv_rope_cache", "w8a16_matmul",
           "w8a16_matmul_ref", "w8a16_qkv_rope_cache"]
