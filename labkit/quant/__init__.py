"""Weight quantisation: int8 / int4 weight-only, a calibrated 4-bit method, bitsandbytes, FP8."""
