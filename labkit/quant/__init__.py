"""Weight quantisation: int8 / int4 weight-only, a calibrated 4-bit method (GPTQ), bitsandbytes LLM.int8 and NF4,
FP8. ``quantize`` swaps a model's ``nn.Linear`` layers for quantised ones; the layers and the packing formats are
exported for code that builds or inspects them (the engine merges and fuses labkit's int8 / int4 layers). Each
labkit layer multiplies with labkit's own kernels, or, with a kernel table measured on the machine (``dispatch``),
with the kernel that table found fastest at the batch: labkit's or a peer's (``peers``: tinygemm, ``_int_mm``,
gemlite, labkit's fused FP8). What the methods cost and buy is measured by ``labkit.experiments.quantization``
(notebook 04).

    from labkit.quant import quantize
    qmodel = quantize(model, "int4", group_size=128)      # same HF model class: generate() works unchanged
    fast = quantize(model, "int4", dispatch="measured")   # the kernel per batch from this machine's table
"""

from labkit.quant.bnb import bnb_int8_linear, bnb_nf4_linear, bnb_tensors, require_bitsandbytes
from labkit.quant.dispatch import DispatchTable, KernelChoice, load_table, use_dispatch
from labkit.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, fp8_supported, quantize_fp8, quantize_fp8_rows
from labkit.quant.gptq import gptq_quantize, gptq_quantize_model
from labkit.quant.methods import CALIB_SPLITS, HEAD_METHODS, METHODS, quantize, target_linears
from labkit.quant.packing import dequantize_int4, dequantize_int8, pack_int4, unpack_int4
from labkit.quant.peers import LABKIT_PATHS, PEERS, PeerUnavailable, build_peer
from labkit.quant.weight_only import (
    INT4_QMAX,
    INT8_QMAX,
    Int4Linear,
    Int8Linear,
    concat_linears,
    int4_group_params,
    quantize_int4,
    quantize_int8,
)

__all__ = ["quantize", "METHODS", "HEAD_METHODS", "CALIB_SPLITS", "target_linears", "Int8Linear", "Int4Linear",
           "Fp8Linear", "concat_linears", "quantize_int8", "quantize_int4", "int4_group_params", "INT8_QMAX",
           "INT4_QMAX", "pack_int4", "unpack_int4", "dequantize_int4", "dequantize_int8", "gptq_quantize",
           "gptq_quantize_model", "bnb_int8_linear", "bnb_nf4_linear", "bnb_tensors", "require_bitsandbytes",
           "FP8_DTYPE", "FP8_MAX", "fp8_supported", "quantize_fp8", "quantize_fp8_rows", "DispatchTable",
           "KernelChoice", "load_table", "use_dispatch", "LABKIT_PATHS", "PEERS", "PeerUnavailable", "build_peer"]
