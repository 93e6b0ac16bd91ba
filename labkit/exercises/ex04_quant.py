"""Notebook 04 (quantisation): int8 per-channel quantisation, int4 group quantisation and its inverse.

Format (``labkit.kernels.quantized_matmul.packing``): per group of ``group_size`` inputs of a row, ``w = (q - zero)
* scale`` with integer codes ``q`` in [0, 15]; ``packed`` uint8 ``[N, K // 2]`` holds ``q[n, 2j]`` in the low nibble
and ``q[n, 2j + 1]`` in the high nibble of byte ``j``; ``scales`` and ``zeros`` ``[N, K // group_size]``. The
solutions are labkit's ``quantize_int8``, ``quantize_int4`` and ``dequantize_int4``.
"""

from __future__ import annotations

import torch

from labkit.exercises.core import Case, Exercise, register, tensor_diff
from labkit.kernels.quantized_matmul.packing import dequantize_int4, unpack_int4
from labkit.quant.weight_only import quantize_int4, quantize_int8

SHAPES = [(1, 8, 4), (3, 32, 8), (5, 96, 32), (17, 256, 128), (64, 128, 64)]


def _weight(n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    w[0, :] = w[0, :].abs()  # an all-positive row: its range must still include 0
    return w


def _quant_cases() -> list[Case]:
    return [Case(f"weight [{n}, {k}] float32, group_size={gs}", (n, k, gs)) for n, k, gs in SHAPES]


def _run_quant(fn, data):
    n, k, gs = data
    return fn(_weight(n, k), gs)


def _compare_quant(expected, actual):
    if not (isinstance(actual, (tuple, list)) and len(actual) == 3):
        return f"expected a tuple (packed, scales, zeros), got {type(actual).__name__}"
    packed, scales, zeros = expected
    a_packed, a_scales, a_zeros = actual
    for name, e, a in (("scales", scales, a_scales), ("zeros", zeros, a_zeros)):
        d = tensor_diff(e.float(), a.float() if isinstance(a, torch.Tensor) else a, rtol=1e-5, atol=1e-7)
        if d:
            return f"{name}: {d}"
    if not isinstance(a_packed, torch.Tensor) or a_packed.dtype != torch.uint8 or a_packed.shape != packed.shape:
        got = f"{a_packed.dtype} {tuple(a_packed.shape)}" if isinstance(a_packed, torch.Tensor) else type(a_packed)
        return f"packed: expected uint8 {tuple(packed.shape)} (two codes per byte), got {got}"
    d = tensor_diff(unpack_int4(packed).float(), unpack_int4(a_packed).float(), rtol=0, atol=0)
    return None if d is None else f"codes q (unpacked from your packed bytes, low nibble first): {d}"


register(Exercise(
    "04.int4_quantize", "int4 group quantisation: weight -> (packed, scales, zeros)", quantize_int4,
    _quant_cases, _run_quant, _compare_quant,
    hint="lo = min(group, 0), hi = max(group, 0); scale = (hi - lo) / 15 (1 where 0); zero = round(-lo / scale); "
         "q = clamp(round(w / scale + zero), 0, 15); low nibble = even column"))


def _dequant_cases() -> list[Case]:
    return [Case(f"packed [{n}, {k // 2}] uint8, scales/zeros [{n}, {k // gs}] float32, group_size={gs}",
                 (n, k, gs)) for n, k, gs in SHAPES]


def _run_dequant(fn, data):
    n, k, gs = data
    packed, scales, zeros = quantize_int4(_weight(n, k), gs)
    g = torch.Generator().manual_seed(n + k)
    zeros = zeros + torch.randint(-2, 3, zeros.shape, generator=g).float()  # zero-points away from the usual 8
    return fn(packed, scales, zeros, gs)


register(Exercise(
    "04.int4_dequantize", "int4 group dequantisation: (packed, scales, zeros) -> weight", dequantize_int4,
    _dequant_cases, _run_dequant, lambda e, a: tensor_diff(e, a, rtol=1e-6, atol=1e-7),
    hint="byte j of a row holds column 2j in its low 4 bits and 2j+1 in its high 4 bits; group g of a row covers "
         "columns g*group_size .. (g+1)*group_size - 1"))


def _int8_cases() -> list[Case]:
    return [Case(f"weight [{n}, {k}] float32" + (", one row all zeros" if z else ""), (n, k, z))
            for n, k, z in ((1, 5, False), (4, 33, True), (17, 256, False), (3, 7, True), (64, 100, True))]


def _run_int8(fn, data):
    n, k, zero_row = data
    w = _weight(n, k)
    if zero_row:
        w[-1] = 0.0
    return fn(w)


def _compare_int8(expected, actual):
    if not (isinstance(actual, (tuple, list)) and len(actual) == 2):
        return f"expected a tuple (q, scale), got {type(actual).__name__}"
    (q, scale), (a_q, a_scale) = expected, actual
    d = tensor_diff(scale, a_scale, rtol=1e-6, atol=0)
    if d:
        return f"scale: {d}"
    if not isinstance(a_q, torch.Tensor) or a_q.dtype != torch.int8:
        return f"q: expected an int8 tensor, got {getattr(a_q, 'dtype', type(a_q).__name__)}"
    d = tensor_diff(q.float(), a_q.float(), rtol=0, atol=0)
    return None if d is None else f"q: {d}"


register(Exercise(
    "04.int8_quantize", "int8 per-output-channel symmetric quantisation: weight -> (q, scale)",
    quantize_int8, _int8_cases, _run_int8, _compare_int8,
    hint="one scale per row: max |w| / 127 (1 for a row of zeros); q = round(w / scale), clamped to [-127, 127]"))
