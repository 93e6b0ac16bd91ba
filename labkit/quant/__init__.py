"""Weight quantisation: int8 / int4 weight-only, a calibrated 4-bit method (GPTQ), bitsandbytes LLM.int8
and NF4, FP8; the measurements that compare them (``labkit.quant.metrics``) and the precision experiments
(``labkit.quant.precision``).

    from labkit.quant import quantize
    qmodel = quantize(model, "int4", group_size=128)      # same HF model class: generate() works unchanged
"""

from labkit.quant.methods import METHODS, quantize, target_linears

__all__ = ["METHODS", "quantize", "target_linears"]
