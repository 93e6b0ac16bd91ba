"""Notebook 03 (kernels): RMSNorm, SwiGLU (``silu(gate) * up``) and softmax Triton kernels, written from skeletons.

The learner passes a ``@triton.jit`` kernel with the signature the task gives; the checker launches it (one program
per row for RMSNorm, blocks of ``BLOCK`` elements for SwiGLU) on irregular sizes, outputs filled with NaN first, so
an element never written shows. A plain function ``fn(x, weight, eps)`` / ``fn(gate, up)`` is accepted too: that is
how labkit's own kernels (``labkit.kernels.rms_norm`` and ``silu_and_mul``, the solutions) are checked. On a CPU
the kernels run through Triton's interpreter (fp32, small sizes: seconds).
"""

from __future__ import annotations

import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU-only host)
from labkit.device import default_device
from labkit.exercises.core import Case, Exercise, register, tensor_diff
from labkit.kernels.rms_norm import rms_norm
from labkit.kernels.silu_and_mul import silu_and_mul
from labkit.kernels.softmax import softmax


def _is_kernel(fn) -> bool:
    import triton

    return isinstance(fn, triton.runtime.jit.KernelInterface)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rms_cases() -> list[Case]:
    sizes = [(1, 8, 1e-6), (3, 33, 1e-6), (5, 100, 1e-5), (2, 257, 1e-6), (4, 64, 0.5), (7, 1000, 1e-6)]
    return [Case(f"x [{r}, {c}] float32, eps={e:g}", (r, c, e)) for r, c, e in sizes]


def _run_rms(fn, data):
    rows, cols, eps = data
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    dev = default_device()
    x = (torch.randn(rows, cols, generator=g) * 3 + 0.5).to(dev)
    w = (torch.rand(cols, generator=g) + 0.5).to(dev)
    if not _is_kernel(fn):
        return fn(x, w, eps)
    out = torch.full_like(x, float("nan"))
    fn[(rows,)](x, w, out, cols, eps, BLOCK=_next_pow2(cols))
    return out


def _compare_fp32(expected, actual):
    return tensor_diff(expected, actual, rtol=1e-4, atol=1e-5)


register(Exercise(
    "03.rms_norm", "RMSNorm Triton kernel: out = x / sqrt(mean(x^2) + eps) * w, one program per row",
    rms_norm, _rms_cases, _run_rms, _compare_fp32,
    hint="mask the columns >= n_cols (other=0.0) on load and store; the mean divides by n_cols, not BLOCK"))

BLOCK_SWIGLU = 128


def _swiglu_cases() -> list[Case]:
    shapes = [(1,), (100,), (128,), (3, 43), (2, 5, 129), (4099,)]
    return [Case(f"gate, up {list(s)} float32 ({torch.Size(s).numel()} elements, BLOCK={BLOCK_SWIGLU})", s)
            for s in shapes]


def _run_swiglu(fn, shape):
    g = torch.Generator().manual_seed(sum(shape))
    dev = default_device()
    gate, up = (torch.randn(*shape, generator=g) * 4).to(dev), torch.randn(*shape, generator=g).to(dev)
    if not _is_kernel(fn):
        return fn(gate, up)
    out = torch.full_like(gate, float("nan"))
    n = gate.numel()
    fn[(-(-n // BLOCK_SWIGLU),)](gate, up, out, n, BLOCK=BLOCK_SWIGLU)
    return out


register(Exercise(
    "03.silu_and_mul", "SwiGLU activation kernel: out = silu(gate) * up, elementwise in blocks", silu_and_mul,
    _swiglu_cases, _run_swiglu, _compare_fp32,
    hint="silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); the last block is partial: mask offsets >= n_elements"))


def _softmax_cases() -> list[Case]:
    sizes = [(2, 16, 1.0), (3, 37, 1.0), (4, 100, 30.0), (1, 1, 1.0), (5, 513, 60.0)]
    return [Case(f"x [{r}, {c}] float32, values up to about {int(4 * m)} in size", (r, c, m)) for r, c, m in sizes]


def _run_softmax(fn, data):
    rows, cols, scale = data
    g = torch.Generator().manual_seed(rows * 100 + cols)
    x = (torch.randn(rows, cols, generator=g) * scale).to(default_device())
    if not _is_kernel(fn):
        return fn(x)
    out = torch.full_like(x, float("nan"))
    fn[(rows,)](x, out, cols, BLOCK=_next_pow2(cols))
    return out


register(Exercise(
    "03.softmax", "row-wise softmax Triton kernel, safe from overflow", softmax, _softmax_cases, _run_softmax,
    _compare_fp32,
    hint="padding columns must not count: load them as -inf, not 0; subtract the row maximum before exp, or "
         "large values overflow to inf"))
