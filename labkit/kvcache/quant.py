"""Quantised KV: int8 and fp8 (e4m3) storage with one float32 scale per token and KV head, dequantised on
read.

Why per (token, head): a token's K/V are written once and never change, so a scale computed from that token's
own values needs no calibration and no re-quantisation later; keys of different heads differ in range by an
order of magnitude (RoPE and outlier channels), so one scale per head keeps small heads precise.

* ``int8``: ``scale = max|x| / 127``, ``q = round(x / scale)`` in ``[-127, 127]`` (symmetric, no zero point).
* ``fp8``: ``scale = max|x| / 448`` (448 = largest finite e4m3fn), ``q = (x / scale).to(float8_e4m3fn)``. The
  storage dtype is torch's native ``float8_e4m3fn`` on every device; on the CPU torch does the cast in
  software with the same round-to-nearest-even as the GPU, which is how the CPU "emulates" fp8.

Scales cost ``4 / head_dim`` bytes per element (6% of int8 at head_dim 64, 3% at 128); ``KVFormat`` counts
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.checks import ArgumentTypeError

FP8_MAX = 448.0
INT8_MAX = 127.0


@dataclass(frozen=True)
class KVFormat:
    """How K/V are stored: ``name`` (``fp32``/``bf16``/``fp16``/``int8``/``fp8``), storage dtype, scales or
    not."""

    name: str
    storage_dtype: torch.dtype
    quantised: bool

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V bytes of one token over all layers, scales included."""
        per_head = head_dim * self.elem_bytes + (4 if self.quantised else 0)
        return 2 * num_layers * num_kv_heads * per_head


KV_FORMATS = {
    "fp32": KVFormat("fp32", torch.float32, False),
    "bf16": KVFormat("bf16", torch.bfloat16, False),
    "fp16": KVFormat("fp16", torch.float16, False),
    "int8": KVFormat("int8", torch.int8, True),
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, True),
}
"""The KV formats by name: ``fp32``, ``bf16``, ``fp16`` (stored as is), ``int8`` and ``fp8`` (with scales)."""
_ALIASES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8",
            torch.float8_e4m3fn: "fp8", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
            "e4m3": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}


def kv_format(kv_dtype: str | torch.dtype, name: str = "kv_dtype") -> KVFormat:
    """The ``KVFormat`` of a name or torch dtype, with a clear error naming ``name`` and listing the allowed ones."""
    allowed = f"allowed: {sorted(KV_FORMATS)} (or torch.float32/bfloat16/float16/int8/float8_e4m3fn)"
    if not isinstance(kv_dtype, (str, torch.dtype)):
        raise ArgumentTypeError(f"{name}={kv_dtype!r} must be a KV-cache format name or a torch dtype; {allowed}")
    fmt = _ALIASES.get(kv_dtype, kv_dtype)
    if fmt not in KV_FORMATS:
        raise ValueError(f"{name}={kv_dtype!r} is not a KV-cache format; {allowed}")
    return KV_FORMATS[fmt]


def quantize_kv(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantise ``x`` ``[..., head_dim]`` (any float dtype) to ``fmt``.

    Returns ``(q, scale)``: ``q`` in ``fmt.storage_dtype`` with ``x``'s shape, ``scale`` float32
    ``x.shape[:-1]`` (``None`` for the unquantised formats, where ``q`` is ``x`` cast to the storage dtype).
    """
    if not fmt.quantised:
        return x.to(fmt.storage_dtype), None
    xf = x.float()
    qmax = INT8_MAX if fmt.name == "int8" else FP8_MAX
    # A vector of zeros gets scale 1 (any positive scale reproduces it exactly) instead of a 0/0.
    amax = xf.abs().amax(dim=-1)
    # times the float32 reciprocal, not "/ qmax": CUDA divides a tensor by a Python scalar as a multiplication by
    # its reciprocal and the CPU does not, so "/ qmax" stores different bytes on the two devices
    scale = torch.where(amax > 0, amax * (1.0 / qmax), torch.ones_like(amax))
    y = xf / scale.unsqueeze(-1)
    if fmt.name == "int8":
        q = y.round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_kv``: ``q * scale`` in ``dtype`` (a plain cast when ``scale`` is ``None``)."""
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
