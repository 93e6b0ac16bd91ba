"""Weight-only int8 and int4 quantisation by round-to-nearest (RTN), and the linear layers that hold them.

Decode at small batch reads every weight once per token, so its time is the weights' bytes over memory bandwidth;
storing them in 8 or 4 bits and widening them inside the matmul (``w8a16`` / ``w4a16``) cuts those bytes 2x or ~3.8x
while activations and accumulation stay in floating point. The formats are ``labkit.quant.packing``'s: int8 per
output channel, symmetric; int4 per group of ``group_size`` inputs, asymmetric, with integer zero-points (stored in
the scales' float dtype, where they are exact), so a weight of zero is represented exactly.

The layers call the fused Triton kernels of ``labkit.kernels.quantized_matmul`` on CUDA (``backend``); elsewhere they
dequantise to the activation dtype and call ``F.linear``: the torch reference the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.kernels.common import KernelLog
from labkit.kernels.quantized_matmul import w4a16_matmul, w4a16_qkv_rope_cache, w8a16_matmul, w8a16_qkv_rope_cache
from labkit.kernels.quantized_matmul.packing import dequantize_int4, dequantize_int8, pack_int4

INT8_QMAX = 127
"""Largest int8 code of symmetric weight quantisation (codes in [-127, 127])."""
INT4_QMAX = 15
"""Largest unsigned int4 code (codes in [0, 15], zero point 8)."""
BACKENDS = ("auto", "torch", "triton")


# --- quantisers ----------------------------------------------------------------------------------------------
def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating tensor [out_features, in_features], got "
                         f"{weight.dtype} of shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight holds inf or NaN; quantising it would hide that")


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel absmax int8: ``weight`` ``[N, K]`` -> (``q`` int8 ``[N, K]``, ``scale`` ``[N]``).

    ``scale = max|w_row| / 127`` (rounded to ``scale_dtype``, default the weight's dtype, *before* rounding
    ``q`` so that ``q * scale`` uses the stored scale). A row of zeros gets scale 1 (any scale is exact
    there).
    """
    _check_weight(weight)
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_QMAX, torch.ones_like(amax))
    scale = scale.to(scale_dtype or weight.dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def _check_group(k: int, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size={group_size!r} must be an even integer >= 2 (128 is the usual choice)")
    if k % group_size:
        divisors = [g for g in (32, 64, 128, 256) if k % g == 0]
        raise ValueError(f"group_size={group_size} does not divide in_features={k}; allowed for this layer: "
                         f"{divisors or 'an even divisor of ' + str(k)}. Nothing is padded or truncated.")


def int4_group_params(w_groups: torch.Tensor, scale_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max grid of groups ``[..., group_size]`` -> (``scale``, integer ``zero``), each
    ``[...]``.

    The range always includes 0 so that ``zero`` is an integer in [0, 15]; a constant group gets scale 1.
    ``scale`` is rounded to ``scale_dtype`` (the dtype it is stored in) before ``zero`` is derived from it.
    """
    lo = w_groups.amin(dim=-1).clamp(max=0.0)
    hi = w_groups.amax(dim=-1).clamp(min=0.0)
    scale = (hi - lo) / INT4_QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
    zero = torch.round(-lo / scale).clamp(0, INT4_QMAX)
    return scale, zero


def int4_round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Integer codes in [0, 15] of ``w`` on the grid ``(q - zero) * scale`` (all broadcastable, float32)."""
    return torch.round(w / scale + zero).clamp(0, INT4_QMAX)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric RTN int4: ``weight`` ``[N, K]`` -> (``packed`` uint8 ``[N, K // 2]``,
    ``scales`` ``[N, K // group_size]``, ``zeros`` ``[N, K // group_size]``) in the ``packing`` format."""
    _check_weight(weight)
    n, k = weight.shape
    _check_group(k, group_size)
    sdt = scale_dtype or weight.dtype
    w = weight.detach().float().view(n, k // group_size, group_size)
    scale, zero = int4_group_params(w, sdt)
    q = int4_round(w, scale[..., None], zero[..., None]).to(torch.uint8).view(n, k)
    return pack_int4(q), scale.to(sdt), zero.to(sdt)


# --- the kernels -------------------------------------------------------------------------------------------
def _use_kernels(backend: str, device: torch.device | str) -> bool:
    """Whether a layer of ``backend`` runs its Triton kernel on ``device`` ('auto': on CUDA; 'triton': everywhere,
    through the interpreter on the CPU)."""
    return backend == "triton" or (backend == "auto" and torch.device(device).type == "cuda")


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {list(BACKENDS)}")
    return backend


# --- modules -------------------------------------------------------------------------------------------------
class _QuantizedLinear(nn.Module):
    """What labkit's quantised linears share: ``y = x @ W.T + bias``, by their Triton kernel (``_kernel``, called on
    ``(x, *self.weights())``) or by dequantising and ``F.linear`` (the torch reference), and on the kernel its
    epilogue as arguments (``forward``'s ``norm``, ``residual``, ``swiglu``: the decoder's neighbours inside the GEMV).
    ``qkv_kernel``: the q/k/v GEMV with RoPE and the cache write (``labkit.model.ops.qkv_projection``). Subclasses set
    ``in_features``, ``out_features``, ``bias`` and ``backend``. ``tuning``: the kernels' launch parameters
    (``labkit.kernels.quantized_matmul.QuantTuning``), None for the device's table."""

    tuning = None
    dispatch = None  # a labkit.quant.dispatch.KernelChoice: the kernel by the number of rows (None: labkit's)

    @staticmethod
    def _kernel(x, *weights, **kw) -> torch.Tensor:
        raise NotImplementedError

    def weights(self) -> tuple:
        """The kernel's weight arguments after ``x`` (tensors, then the group size where there is one)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None,
                swiglu: bool = False, pdl: str = "", log: KernelLog | None = None) -> torch.Tensor:
        """``x @ W.T + bias``; with an epilogue ``residual + self(pre(x))`` on labkit's GEMV (whoever passes one has
        resolved that it runs: ``FusionPlan.quant_epilogues``), ``pre`` the RMSNorm ``norm`` (q/k/v, gate/up) or,
        with ``swiglu``, ``silu(gate) * up`` of ``x`` ``[..., 2 * in_features]`` (down); ``residual`` ``[...,
        out_features]`` (o and down end in the residual add); one 16-bit row does all of it inside the stationary
        GEMV. ``pdl``: its programmatic dependent launch ('release', 'overlap'); ``log``: a ``KernelLog`` it is
        recorded in (op 'projection')."""
        if norm is not None or residual is not None or swiglu:
            return self._with_epilogue(x, norm, residual, swiglu, pdl, log)
        if self.dispatch is not None:  # a peer kernel where the machine's table measured one faster at these rows
            peer = self.dispatch.kernel_for(x.reshape(-1, self.in_features))
            if peer is not None:
                y = peer(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
        if not self.uses_kernels(x.device):
            return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        y = self._kernel(x.reshape(-1, self.in_features), *self.weights(), **self._tuned()).view(*x.shape[:-1],
                                                                                                self.out_features)
        return y if self.bias is None else y + self.bias

    def _with_epilogue(self, x, norm, residual, swiglu: bool, pdl: str, log) -> torch.Tensor:
        opts = {"swiglu": swiglu, **({"pdl": pdl} if pdl else {}), **self._tuned()}
        if norm is not None:
            opts.update(norm_weight=norm.weight, norm_eps=norm.eps)
        inside = residual is not None and self.bias is None  # the bias comes between the product and the add
        if inside:
            opts["residual"] = residual
        if log is not None:
            fused = ("norm",) * (norm is not None) + ("residual",) * inside + ("swiglu",) * swiglu
            log.record("projection", self._kernel.__name__, fused, pdl)
        y = self._kernel(x, *self.weights(), **opts)  # which checks x's width, and that norm and swiglu do not meet
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None or inside else residual + y

    def _tuned(self) -> dict:
        return {} if self.tuning is None else {"tuning": self.tuning}

    def uses_kernels(self, device: torch.device | str) -> bool:
        """Whether this layer runs labkit's Triton kernel on inputs on ``device`` (its backend and the device)."""
        return _use_kernels(self.backend, device)


class Int8Linear(_QuantizedLinear):
    """``y = x @ (q * scale[:, None]).T + bias``: int8 weights, activations and output in ``scale``'s dtype.

    Buffers: ``qweight`` int8 ``[N, K]``, ``scale`` ``[N]``, optional ``bias`` ``[N]``. ``backend``: ``auto``
    (fused kernel on CUDA, torch elsewhere), ``torch`` or ``triton``.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: str = "auto"):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != (qweight.shape[0],):
            raise ValueError(f"qweight must be int8 [N, K] and scale [N]; got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(scale.dtype))
        self.backend = _check_backend(backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> Int8Linear:
        q, scale = quantize_int8(linear.weight)
        return cls(q, scale, linear.bias, backend)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight ``[N, K]`` this layer computes with."""
        return dequantize_int8(self.qweight, self.scale, dtype)

    _kernel, qkv_kernel = staticmethod(w8a16_matmul), staticmethod(w8a16_qkv_rope_cache)

    def weights(self) -> tuple:
        return self.qweight, self.scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, " \
               f"backend={self.backend}"


class Int4Linear(_QuantizedLinear):
    """``y = x @ W.T + bias`` with ``W = (q - zero) * scale`` per group: packed int4 weights.

    Buffers: ``packed`` uint8 ``[N, K // 2]``, ``scales`` and ``zeros`` ``[N, K // group_size]``, optional
    ``bias`` ``[N]``. Made by RTN (``from_linear``) or by a calibrated method (``labkit.quant.gptq``): the
    format, and so the kernel, is the same.
    """

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, backend: str = "auto"):
        super().__init__()
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"packed must be uint8 [N, K // 2], got {packed.dtype} {tuple(packed.shape)}")
        n, k = packed.shape[0], 2 * packed.shape[1]
        _check_group(k, group_size)
        if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"scales and zeros must be [{n}, {k // group_size}], got {tuple(scales.shape)} "
                             f"and {tuple(zeros.shape)}")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().to(scales.dtype))
        self.backend = _check_backend(backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, backend: str = "auto") -> Int4Linear:
        packed, scales, zeros = quantize_int4(linear.weight, group_size)
        return cls(packed, scales, zeros, group_size, linear.bias, backend)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight ``[N, K]`` this layer computes with."""
        return dequantize_int4(self.packed, self.scales, self.zeros, self.group_size, dtype)

    _kernel, qkv_kernel = staticmethod(w4a16_matmul), staticmethod(w4a16_qkv_rope_cache)

    def weights(self) -> tuple:
        return self.packed, self.scales, self.zeros, self.group_size

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 " \
               f"group_size={self.group_size}, backend={self.backend}"


# --- merging layers that read one input ----------------------------------------------------------------------
def _repoint(linears: list[nn.Module], name: str, merged: torch.Tensor) -> None:
    """Make each module's ``name`` a row slice of ``merged`` (the rows it held, in order); a parameter stays a
    (frozen) parameter, a buffer a buffer."""
    parts = merged.split([getattr(m, name).shape[0] for m in linears], dim=0)
    for m, part in zip(linears, parts):
        setattr(m, name, nn.Parameter(part, requires_grad=False) if name in m._parameters else part)


# the tensors that hold each mergeable kind's weight, row by output feature
_WEIGHT_TENSORS = {nn.Linear: ("weight",), Int8Linear: ("qweight", "scale"), Int4Linear: ("packed", "scales", "zeros")}


def concat_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``cat([lin(x) for lin in linears], -1)`` with a single matmul, or ``None`` (nothing
    changed) where they cannot be merged.

    ``linears``: layers of one kind that read the same ``K`` features, all with a bias or none -- plain
    ``nn.Linear`` (one dtype and device), ``Int8Linear`` or ``Int4Linear`` (one group size and backend), or a kind
    naming its row tensors in ``MERGE_TENSORS`` (``Fp8Linear``). A kernel table the layers hold
    (``labkit.quant.dispatch``) moves to the merged layer, its peers rebuilt for the merged weights. Their
    weights (for the quantised kinds ``qweight``/``scale`` or ``packed``/``scales``/``zeros``) and biases are
    concatenated by output rows, and each input layer is re-pointed at its row slice of the result: the same
    values, no extra memory, and the input layers still work on their own. At decode batch sizes one GEMV over ``N1
    + N2 + ...`` rows replaces several narrow ones, each of which pays a launch and fills the GPU poorly (k/v
    projections of an 8B model are 1024 rows).
    """
    kinds = {type(m) for m in linears}
    kind0 = next(iter(kinds))
    names = _WEIGHT_TENSORS.get(kind0, getattr(kind0, "MERGE_TENSORS", None)) if len(kinds) == 1 else None
    biased = {getattr(m, "bias", None) is not None for m in linears}
    if names is None or len(biased) != 1:
        names = None
    elif biased == {True}:
        names = (*names, "bias")
    if names is None:
        return None
    shape = {(m.in_features, getattr(m, "backend", None), getattr(m, "group_size", None)) for m in linears}
    if len(shape) != 1 or any(len({(getattr(m, n).dtype, getattr(m, n).device) for m in linears}) != 1
                              for n in names):
        return None
    kind, first = type(linears[0]), linears[0]
    cat = {n: torch.cat([getattr(m, n).detach() for m in linears], dim=0) for n in names}
    if kind is nn.Linear:
        merged = nn.Linear(first.in_features, cat["weight"].shape[0], bias=False, device="meta")
        merged.weight = nn.Parameter(cat["weight"], requires_grad=False)
        if "bias" in cat:
            merged.bias = nn.Parameter(cat["bias"], requires_grad=False)
    else:
        extra = (first.group_size,) if kind is Int4Linear else ()
        merged = kind(*(cat[n] for n in names if n != "bias"), *extra, bias=cat.get("bias"), backend=first.backend)
        merged.tuning = getattr(first, "tuning", None)
    for n in names:
        _repoint(linears, n, getattr(merged, n))
    if getattr(first, "dispatch", None) is not None:  # the same table; peers of the merged shape, from its weights
        merged.dispatch = first.dispatch.for_layer(merged)
    return merged
