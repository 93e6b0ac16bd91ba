"""SwiGLU's activation: ``silu(gate) * up`` in one pass (vLLM's ``silu_and_mul``).

Input ``x`` is ``[..., 2 * d]`` holding ``gate = x[..., :d]`` and ``up = x[..., d:]`` (the output of a merged
gate/up projection); the output is ``[..., d]``. Memory-bound: one read of ``x`` and one write of the output,
``3 * d * bytes`` per row, where eager torch writes and re-reads ``silu(gate)`` (5 * d).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor, rows_view


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``F.silu(x[..., :d]) * x[..., d:]``, rounded as Hugging Face's ``LlamaMLP`` rounds."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounded to the input dtype, as F.silu returns it
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2 * d]``; returns ``[..., d]`` in ``x``'s dtype.

    dtypes: float32, float16, bfloat16.
    """
    check_tensor("x", x, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * d] with an even last dimension, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    x2 = rows_view(x, "x")
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(4096, triton.next_power_of_2(max(d, 1)))
    if x2.shape[0] and d:
        grid = (x2.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](x2, out, d, x2.stride(0), out.stride(0), BLOCK=block,
                                   num_warps=4 if block <= 1024 else 8)
    return out.view(*x.shape[:-1], d)
