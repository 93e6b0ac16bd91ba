"""RMSNorm, optionally fused with the residual add that precedes it in a Llama decoder layer.

    out = weight * (x / sqrt(mean(x^2) + eps))                          (plain)
    residual_out = x + residual;  out = rms_norm(residual_out)           (fused, ``residual`` given)

Memory-bound: the plain kernel reads ``x`` once and writes ``out`` once (``2 * rows * cols * bytes``);
eager torch makes about five passes (cast, square, mean, multiply, multiply by the weight). The fused form
replaces the separate add (read 2, write 1) and norm (read 1, write 1) with one pass (read 2, write 2).

Rounding follows Hugging Face's ``LlamaRMSNorm`` exactly: statistics in float32, the normalised value cast to
the input dtype before it is multiplied by the weight, and the residual sum rounded to the input dtype before
it is normalised (as ``residual + hidden_states`` is in the model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_same_shape, check_tensor, next_pow2, rows_view

MAX_COLS = 65536  # one row per program, held in registers in one pass


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 residual: torch.Tensor | None = None):
    """Torch reference (Hugging Face's ``LlamaRMSNorm``); with ``residual``: ``(out, x + residual)``."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return (out, x) if residual is not None else out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res, stride_out,
                     stride_res_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the model rounds the sum to its dtype
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w  # cast before the weight, as LlamaRMSNorm does
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dimension of ``x`` ``[..., hidden]`` with ``weight`` ``[hidden]``.

    Without ``residual`` returns ``out`` (shape and dtype of ``x``). With ``residual`` (same shape and dtype
    as ``x``) returns ``(out, residual_out)`` where ``residual_out = x + residual`` and
    ``out = rms_norm(residual_out)``.
    dtypes: float32, float16, bfloat16; the weight may be any of them (the output takes ``x``'s dtype).
    """
    check_tensor("x", x, FLOAT_DTYPES)
    check_tensor("weight", weight, FLOAT_DTYPES, dim=1, device=x.device)
    if x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [hidden] with hidden = x.shape[-1] of x "
                         f"{tuple(x.shape)}")
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"hidden size {x.shape[-1]} is larger than this one-pass kernel holds; "
                         f"allowed <= {MAX_COLS}")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    if residual is not None:
        check_tensor("residual", residual, (x.dtype,), device=x.device)
        check_same_shape("x", x, "residual", residual)
    x2 = rows_view(x, "x")
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    w = weight.contiguous()
    block = next_pow2(n_cols)
    if residual is None:
        if n_rows:
            _rms_norm_kernel[(n_rows,)](x2, x2, w, out, out, n_cols, x2.stride(0), 0, out.stride(0), 0, eps,
                                        HAS_RESIDUAL=False, BLOCK=block, num_warps=_num_warps(block))
        return out.view(x.shape)
    r2 = rows_view(residual, "residual")
    res_out = torch.empty_like(x2)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](x2, r2, w, out, res_out, n_cols, x2.stride(0), r2.stride(0),
                                    out.stride(0), res_out.stride(0), eps, HAS_RESIDUAL=True, BLOCK=block,
                                    num_warps=_num_warps(block))
    return out.view(x.shape), res_out.view(x.shape)
