"""Row-wise softmax over the last dimension, numerically safe (the row maximum is subtracted before ``exp``).

Rows up to ``MAX_FUSED_COLS`` are held in registers: one read, one write. Longer rows take the online form
(Milakov & Gimelshein 2018): one pass keeps a running maximum and a running sum rescaled whenever the
maximum grows, a second pass writes ``exp(x - max) / sum`` (two reads, one write) -- the same trick
FlashAttention uses across key tiles. A row of all ``-inf`` gives NaN, as ``torch.softmax`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor, next_pow2, rows_view

MAX_FUSED_COLS = 8192
LOOP_BLOCK = 2048


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``torch.softmax`` over the last dimension in float32, cast back to ``x``'s dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


@triton.jit
def _softmax_one_pass(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_online(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -float("inf"), tl.float32)  # per-lane running max and sum, merged at the end
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < n_cols,
                    other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # a lane that has seen only -inf so far has nothing to rescale: shift by 0 to avoid (-inf) - (-inf)
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)  # NaN for an all -inf row, as torch.softmax gives
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - row_max) / row_sum
        tl.store(out_ptr + row * stride_out + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``x`` ``[..., n]`` (float32, float16, bfloat16); same shape and dtype."""
    check_tensor("x", x, FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    x2 = rows_view(x, "x")
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    if n_rows and n_cols:
        if n_cols <= MAX_FUSED_COLS:
            block = next_pow2(n_cols)
            _softmax_one_pass[(n_rows,)](x2, out, n_cols, x2.stride(0), out.stride(0), BLOCK=block,
                                         num_warps=4 if block <= 2048 else 8)
        else:
            _softmax_online[(n_rows,)](x2, out, n_cols, x2.stride(0), out.stride(0), BLOCK=LOOP_BLOCK,
                                       num_warps=8)
    return out.view(x.shape)
