"""Per-row dynamic FP8 (e4m3) quantisation of activations in one kernel: the prologue of an FP8 W8A8 GEMM.

``torch._scaled_mm`` multiplies e4m3 activations by e4m3 weights, so every linear layer of an FP8 model first turns
its 16-bit input rows into e4m3 with one scale per row (the row's absolute maximum over 448). Written in eager torch
that is seven kernels (cast, abs, amax, divide, clamp, divide, clamp, cast), each reading or writing the row; at a
decode batch they cost more than the GEMM. Here one program per row reads it twice (the maximum, then the codes) and
writes the codes and the scale: one launch.

``quantize_rows_fp8_ref`` is the torch reference (``labkit.quant.fp8`` quantises with it: ``quantize_fp8_rows``): the
kernel returns the same scale and, code by code, the same e4m3 values (both divide in float32 and round once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TINY = 1e-12  # the smallest scale: an all-zero row stays zero whatever it is


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantisation of ``x`` ``[M, K]`` -> (e4m3 codes ``[M, K]``, float32 scales ``[M, 1]``), ``x ~=
    codes * scale``: the kernel's torch reference, and ``labkit.quant.fp8.quantize_fp8_rows``."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=TINY)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _round_e4m3(v):
    """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as a float32: e4m3 keeps 3
    mantissa bits, so the grid's step at ``v`` is ``2^(exponent - 3)`` (``2^-9`` among the subnormals). Rounding here
    and converting an exact value gives the hardware's ``cvt.rn`` codes everywhere, Triton's CPU interpreter included
    (whose own conversion drops the carry when rounding crosses a power of two: 127.9 becomes 64)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 below 2^22 to an integer, ties to even
    return ((v / step + magic) - magic) * step


@triton.jit
def _rows_fp8_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k, BLOCK):
        mask = start + cols < k
        v = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    for start in range(0, k, BLOCK):
        mask = start + cols < k
        v = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        code = _round_e4m3(tl.minimum(tl.maximum(v / scale, -448.0), 448.0))
        tl.store(q_ptr + row * stride_q + start + cols, code.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (float32, float16, bfloat16; rows contiguous) -> (e4m3 ``[M, K]``, float32 ``[M, 1]``) in
    one launch; what ``quantize_rows_fp8_ref`` computes."""
    check_tensor("x", x, FLOAT_DTYPES, dim=2)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        block = min(2048, triton.next_power_of_2(k))
        _rows_fp8_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, num_warps=4 if block <= 1024
                               else 8)
    elif m:
        s.fill_(TINY)
    return q, s
