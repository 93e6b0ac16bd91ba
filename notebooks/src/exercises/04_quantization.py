# %% [markdown]
# ## Exercises
#
# Write labkit's weight formats: int8 per channel, then int4 per group both ways. Each check compares with
# labkit's `quantize_int8`, `quantize_int4` and `dequantize_int4` on irregular shapes and prints which elements
# differ. `python -m labkit exercises` lists your progress.
#
# ### Exercise 04.int8_quantize (10 minutes)
# First the simpler format: int8, symmetric, one scale per output channel (row). `quantize_int8(weight) -> (q,
# scale)`: `scale = max|row| / 127` (1 for a row of zeros) in the weight's dtype, `q = round(w / scale)` clamped to
# `[-127, 127]`, as `torch.int8`.

# %%
import torch


def quantize_int8(weight):
    # TODO: a scale per row, then the codes
    raise NotImplementedError("fill in quantize_int8")


# %%
from labkit.exercises import check

check("04.int8_quantize", quantize_int8)

# %% [markdown]
# ### Exercise 04.int4_quantize (25 minutes)
# The format: a weight `W` `[N, K]` is cut into groups of `group_size` consecutive inputs per row. Each group has a
# `scale` and an integer `zero` (stored as floats), and each weight an integer code `q` in `[0, 15]` with
# `w ≈ (q - zero) * scale`. Codes are packed two per byte: byte `j` of a row holds `q[2j]` in its low 4 bits and
# `q[2j + 1]` in its high 4 bits, so `packed` is uint8 `[N, K // 2]`; `scales` and `zeros` are
# `[N, K // group_size]`.
#
# `quantize(weight, group_size) -> (packed, scales, zeros)`, round to nearest, per group:
#
# * `lo = min(min(group), 0)`, `hi = max(max(group), 0)` (the range always holds 0, so a weight of 0 is exact);
# * `scale = (hi - lo) / 15`, or 1 where that is 0 (a group of zeros);
# * `zero = clamp(round(-lo / scale), 0, 15)`; `q = clamp(round(w / scale + zero), 0, 15)`;
# * `scales` and `zeros` in the weight's dtype.

# %%
def quantize(weight, group_size):
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    # TODO: scale and zero per group, codes q, then pack two codes per byte
    raise NotImplementedError("fill in quantize")


# %%
check("04.int4_quantize", quantize)

# %% [markdown]
# ### Exercise 04.int4_dequantize (15 minutes)
# The inverse: `dequantize(packed, scales, zeros, group_size) -> weight` `[N, K]` in the scales' dtype. The zero
# points in the check are not all 8: use each group's own.

# %%
def dequantize(packed, scales, zeros, group_size):
    # TODO: unpack the low and high nibbles into the right columns, then (q - zero) * scale per group
    raise NotImplementedError("fill in dequantize")


# %%
check("04.int4_dequantize", dequantize)
