"""Notebook 04 (quantisation and precision): every method side by side (``compare``), what a method costs and buys
(``metrics``: perplexity, layer error, bytes held, peak memory, step time, the bytes-per-weight arithmetic) and the
FP32 / TF32 / BF16 / FP16 / INT8 / FP8 experiments (``precision``)."""

from labkit.experiments.quantization import precision
from labkit.experiments.quantization.compare import (
    BASELINE,
    accuracy_rows,
    breakdown_tables,
    method_options,
    plot_step_breakdown,
    speed_rows,
    step_parts,
)
from labkit.experiments.quantization.metrics import (
    bytes_held,
    bytes_per_weight,
    decode_weight_bytes,
    heldout_perplexity,
    hf_decode_step_time,
    layer_errors,
    linear_weight_bytes,
    model_decode_bytes,
    peak_allocated,
)

__all__ = ["precision", "BASELINE", "accuracy_rows", "breakdown_tables", "method_options", "plot_step_breakdown",
           "speed_rows", "step_parts", "bytes_held", "bytes_per_weight", "model_decode_bytes", "hf_decode_step_time",
           "decode_weight_bytes", "heldout_perplexity", "layer_errors", "linear_weight_bytes", "peak_allocated"]
