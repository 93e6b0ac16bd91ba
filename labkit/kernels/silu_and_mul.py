"""SwiGLU's activation: ``silu(gate) * up`` in one pass (vLLM's ``silu_and_mul``).

Input ``x`` is ``[..., 2 * d]`` holding ``gate = x[..., :d]`` and ``up = x[..., d:]`` (the output of a merged
gate/up projection), or ``gate`` and ``up`` come as two ``[..., d]`` tensors (separate projections, as in
Hugging Face's ``LlamaMLP``); the output is ``[..., d]``. Memory-bound: one read of ``x`` and one write of the output,
``3 * d * bytes`` per row, where eager torch writes and re-reads ``silu(gate)`` (5 * d).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor, rows_view


def silu_and_mul_ref(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: ``F.silu(gate) * up``, rounded as Hugging Face's ``LlamaMLP`` rounds."""
    if up is None:
        d = x.shape[-1] // 2
        x, up = x[..., :d], x[..., d:]
    return torch.nn.functional.silu(x) * up


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, out_ptr, d, stride_g, stride_u, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounded to the input dtype, as F.silu returns it
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``; returns ``[..., d]`` in ``x``'s dtype (float32, float16, bfloat16).

    ``x`` ``[..., 2 * d]`` holds ``[gate | up]``; or pass ``x`` = gate ``[..., d]`` and ``up`` ``[..., d]``.
    """
    check_tensor("x", x, FLOAT_DTYPES)
    if up is None:
        if x.dim() == 0 or x.shape[-1] % 2:
            raise ValueError(f"x must be [..., 2 * d] with an even last dimension, got shape {tuple(x.shape)}")
        x2 = rows_view(x, "x")
        d = x2.shape[1] // 2
        gate, up2 = x2[:, :d], x2[:, d:]
    else:
        check_tensor("up", up, (x.dtype,), device=x.device)
        if up.shape != x.shape or x.dim() == 0:
            raise ValueError(f"gate x {tuple(x.shape)} and up {tuple(up.shape)} must have the same shape")
        gate, up2 = rows_view(x, "x"), rows_view(up, "up")
        d = gate.shape[1]
    out = torch.empty(gate.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(4096, triton.next_power_of_2(max(d, 1)))
    if gate.shape[0] and d:
        grid = (gate.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](gate, up2, out, d, gate.stride(0), up2.stride(0), out.stride(0), BLOCK=block,
                                   num_warps=4 if block <= 1024 else 8)
    return out.view(*x.shape[:-1], d)
