"""FP8 (e4m3) linear layers: weights with per-output-channel scales, activations with per-token scales.

e4m3 has 3 mantissa bits and a range of +-448, so every tensor needs a scale that maps its range onto that of
e4m3. Weights get one scale per output channel (fixed at quantisation); activations one per token, computed on
the fly from the token's absmax (dynamic quantisation; a CUDA-graph-safe tensor op). Hopper's tensor cores
multiply two e4m3 matrices at twice the bf16 rate and apply both scales in the epilogue: ``torch._scaled_mm``
with row-wise scales. Where that is not available the same numerics are emulated: both operands are rounded
to e4m3, widened to float32 and multiplied (accumulation in float32, as the tensor cores do).

Backends: ``auto`` (``scaled_mm`` on CUDA with compute capability >= 8.9 and dimensions divisible by 16,
``emulated`` elsewhere; decided per call from the input's device),
``scaled_mm`` (the activation quantisation in eager torch, seven small kernels, then ``torch._scaled_mm``; also runs
on the CPU through torch's CPU kernel, which is how the CUDA call is tested here),
``fused`` (the activation quantisation in one Triton kernel, ``labkit.kernels.fp8_quant``, then ``torch._scaled_mm``:
the same codes and scales, one launch instead of seven; on the CPU through Triton's interpreter),
``emulated``.

A layer may also hold a ``labkit.quant.dispatch.KernelChoice`` (``dispatch``): then the number of rows picks the
kernel, from a table measured on the machine (a peer's, such as a weight-only FP8 GEMV, where it was faster).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.kernels.fp8_quant import quantize_rows_fp8_ref as quantize_fp8_rows
from labkit.quant.weight_only import _check_weight

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of weights and activations (e4m3, no infinities)."""
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
"""Largest finite e4m3 value (448): scales map each row's absolute maximum to it."""
BACKENDS = ("auto", "scaled_mm", "fused", "emulated")


def fp8_supported(device: torch.device | str) -> bool:
    """True when ``torch._scaled_mm`` has FP8 tensor cores on ``device`` (CUDA compute capability >= 8.9)."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` -> (e4m3 ``[N, K]``, float32 per-row scale ``[N]``) with ``w ~= q * scale``: the
    activations' per-row quantisation (``quantize_fp8_rows``) applied to the weight's rows."""
    _check_weight(weight)
    q, scale = quantize_fp8_rows(weight.detach())
    return q, scale[:, 0]


def _resolve_backend(backend: str, device: torch.device, n: int, k: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {list(BACKENDS)}")
    if backend == "auto":
        backend = "scaled_mm" if fp8_supported(device) and not (n % 16 or k % 16) else "emulated"
    if backend in ("scaled_mm", "fused"):
        if device.type == "cuda" and not fp8_supported(device):
            cap = torch.cuda.get_device_capability(device)
            raise ValueError(f"backend={backend!r}: {torch.cuda.get_device_name(device)} (compute capability "
                             f"{cap[0]}.{cap[1]}) has no FP8 tensor cores (needs >= 8.9: Ada, Hopper); use "
                             "backend='emulated'")
        if n % 16 or k % 16:
            raise ValueError(f"backend={backend!r} needs in_features={k} and out_features={n} divisible "
                             "by 16; use backend='emulated'")
    return backend


class Fp8Linear(nn.Module):
    """``y = fp8(x) @ fp8(W).T * scales + bias``; output in the activation dtype.

    Buffers: ``weight`` e4m3 ``[N, K]``, ``weight_scale`` float32 ``[N]``, optional ``bias`` ``[N]``.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: str = "auto"):
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight_scale.shape != (weight.shape[0],):
            raise ValueError(f"weight must be {FP8_DTYPE} [N, K] and weight_scale [N]; got {weight.dtype} "
                             f"{tuple(weight.shape)} and {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        # fail early, where the layer is built; 'auto' is decided per call from the input's device
        _resolve_backend(backend, weight.device, self.out_features, self.in_features)
        self.backend = backend
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> Fp8Linear:
        w, scale = quantize_fp8(linear.weight)
        return cls(w, scale, linear.bias, backend)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` this layer computes with."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    dispatch = None  # a labkit.quant.dispatch.KernelChoice: the kernel by the number of rows (None: this backend)
    MERGE_TENSORS = ("weight", "weight_scale")  # row tensors labkit.quant.concat_linears joins (q/k/v, gate/up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        peer = self.dispatch.kernel_for(x2) if self.dispatch is not None else None
        if peer is not None:
            y = peer(x2).to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        backend = _resolve_backend(self.backend, x.device, self.out_features, self.in_features)
        if backend == "fused":
            from labkit.kernels.fp8_quant import quantize_rows_fp8

            xq, x_scale = quantize_rows_fp8(x2)
        else:
            xq, x_scale = quantize_fp8_rows(x2)
        if backend in ("scaled_mm", "fused"):
            # Row-wise scaled FP8 GEMM needs a bfloat16 output; mat2 must be column-major, which W.T is.
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale[None, :],
                                 out_dtype=torch.bfloat16)
        else:
            y = (xq.float() * x_scale) @ self.dequantize().T
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel x " \
               f"per-token, backend={self.backend}"
