"""The int4 / int8 weight formats, defined beside the kernels that read them
(``labkit.kernels.quantized_matmul.packing``); re-exported here for the quantisers."""

from labkit.kernels.quantized_matmul.packing import dequantize_int4, dequantize_int8, pack_int4, unpack_int4

__all__ = ["dequantize_int4", "dequantize_int8", "pack_int4", "unpack_int4"]
