"""The weight formats the quantised matmuls read, and their torch unpacking (the kernels' references).

The quantisers (``labkit.quant``) write these formats; they live here, beside the kernels that read them, so that
the kernels depend on nothing in ``labkit.quant``. Int4 (group-wise asymmetric, as ``w4a16_matmul`` reads it):

* quantised values ``q`` are integers in ``[0, 15]``; a weight is ``w = (q - zero) * scale``
* ``packed``: uint8 ``[N, K // 2]``; byte ``k // 2`` of row ``n`` holds ``q[n, k]`` for even ``k`` in its low nibble
  and ``q[n, k + 1]`` in its high nibble
* ``scales``, ``zeros``: ``[N, K // group_size]`` floating (zeros are float zero-points, not necessarily integers)

Int8 (per output channel, symmetric): ``w = q * scale`` with ``q`` int8 ``[N, K]`` and ``scale`` ``[N]``.
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack integer values in ``[0, 15]`` of shape ``[N, K]`` (``K`` even) into uint8 ``[N, K // 2]``."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be 2-D with an even number of columns, got shape {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"q must hold values in [0, 15], got [{int(q.min())}, {int(q.max())}]")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 ``[N, K // 2]`` to uint8 values in ``[0, 15]`` of shape ``[N, K]``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """Weights ``[N, K]`` from the packed int4 format (torch reference for the fused kernel's load)."""
    q = unpack_int4(packed).to(scales.dtype)
    n, k = q.shape
    if k % group_size or scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"scales/zeros must be [{n}, {k // group_size}] for K={k}, group_size={group_size}; "
                         f"got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    w = (q.view(n, k // group_size, group_size) - zeros[..., None]) * scales[..., None]
    return w.reshape(n, k).to(dtype or scales.dtype)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Weights ``[N, K]`` from int8 ``q`` and per-output-channel ``scale`` ``[N]``."""
    if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
        raise ValueError(f"q must be int8 [N, K] and scale [N]; got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(scale.shape)}")
    return (q.to(scale.dtype) * scale[:, None]).to(dtype or scale.dtype)
