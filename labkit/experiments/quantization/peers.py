"""The paths each weight format's kernels are timed on: labkit's beside the ones a practitioner would reach for.

``candidates`` names every path with its format and library: labkit's ``Int8Linear`` / ``Int4Linear`` / ``Fp8Linear``
and every peer of ``labkit.quant.peers`` built from them (tinygemm, ``_int_mm``, labkit's fused FP8 quantisation,
gemlite), plus what torchao's one-line configs build from the bf16 weights (int4 weight-only as it comes and with
tinygemm's packing, float8 dynamic row-wise) and ``torch.compile`` of FP8's quantisation and ``_scaled_mm`` together.
``build_path`` makes one over a bf16 linear's weights.

``check_path`` checks one: ``kernel_err``, its output against the float32 product of the weights it holds (its
format's rounding, dequantised), must stay within the format's bound (``TOLERANCE``); ``rel_err``, against the bf16
layer's own product, is what the format and the kernel cost together (reported beside the bound). The measurement
that checks and times every path at serving batches is ``labkit.experiments.quantization.format_gemm``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.quant.peers import LABKIT_PATHS, PEERS, PeerUnavailable, build_peer

TOLERANCE = {"bf16": 1e-2, "int8": 2e-2, "int4": 1e-1, "fp8": 1e-1}
"""Relative error bounds (DESIGN.md's table: bf16 compute 1e-2, int8 weights 2e-2, int4 weights 1e-1; FP8 e4m3 keeps
four significant bits, an int4 grid's precision, and takes int4's bound)."""
BF16 = "cuBLAS bf16"


def _torchao_int4(packing: str | None):
    def build(lin: nn.Linear):
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        cfg = Int4WeightOnlyConfig(group_size=128) if packing is None else \
            Int4WeightOnlyConfig(group_size=128, int4_packing_format=packing)
        seq = nn.Sequential(_copy(lin))
        quantize_(seq, cfg)
        return seq[0], seq[0].weight.dequantize()
    return build


def _torchao_fp8(lin: nn.Linear):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    seq = nn.Sequential(_copy(lin))
    quantize_(seq, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return seq[0], seq[0].weight.dequantize()


_COMPILED: list = []


def _compiled_fp8(lin: nn.Linear):
    """``torch.compile`` of the eager quantisation and ``_scaled_mm`` together (dynamic shapes: one compile for
    every layer and batch), over ``Fp8Linear``'s codes."""
    from labkit.quant.fp8 import Fp8Linear, quantize_fp8_rows

    layer = Fp8Linear.from_linear(lin, backend="scaled_mm")
    if not _COMPILED:
        def qmm(x, w_t, ws):
            xq, xs = quantize_fp8_rows(x)
            return torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        _COMPILED.append(torch.compile(qmm, dynamic=True))
    fn, w_t, ws = _COMPILED[0], layer.weight.t(), layer.weight_scale[None, :]
    return (lambda x: fn(x, w_t, ws)), layer.dequantize()


def _copy(lin: nn.Linear) -> nn.Linear:
    out = nn.Linear(lin.in_features, lin.out_features, bias=False, device=lin.weight.device, dtype=lin.weight.dtype)
    out.weight.data.copy_(lin.weight.data)
    return out


def candidates() -> dict[str, tuple[str, str]]:
    """``{path: (weight format, library)}`` of every path ``format_gemm.measure`` times, bf16 first, then per format
    labkit's own path, its peers (``labkit.quant.peers``), and the paths built from bf16 weights by torchao and
    torch.compile."""
    out = {BF16: ("bf16", "torch")}
    for fmt in ("int8", "int4", "fp8"):
        out[LABKIT_PATHS[fmt]] = (fmt, "labkit")
        out.update({n: (p.fmt, p.library) for n, p in PEERS.items() if p.fmt == fmt and n != LABKIT_PATHS[fmt]})
        if fmt == "int4":
            out["torchao Int4WeightOnlyConfig (as it comes)"] = ("int4", "torchao")
            out["torchao Int4WeightOnlyConfig tile_packed_to_4d (tinygemm)"] = ("int4", "torchao")
        if fmt == "fp8":
            out["torchao Float8DynamicActivationFloat8WeightConfig PerRow"] = ("fp8", "torchao")
            out["torch.compile(fp8 act quant + _scaled_mm)"] = ("fp8", "torch")
    return out


_FROM_BF16 = {"torchao Int4WeightOnlyConfig (as it comes)": _torchao_int4(None),
              "torchao Int4WeightOnlyConfig tile_packed_to_4d (tinygemm)": _torchao_int4("tile_packed_to_4d"),
              "torchao Float8DynamicActivationFloat8WeightConfig PerRow": _torchao_fp8,
              "torch.compile(fp8 act quant + _scaled_mm)": _compiled_fp8}


def labkit_layer(fmt: str, lin: nn.Linear) -> nn.Module:
    """labkit's layer of ``fmt`` holding ``lin``'s weights (the one every peer of the format is built from)."""
    from labkit.quant.fp8 import Fp8Linear
    from labkit.quant.weight_only import Int4Linear, Int8Linear

    if fmt == "int8":
        return Int8Linear.from_linear(lin)
    if fmt == "int4":
        return Int4Linear.from_linear(lin, 128)
    return Fp8Linear.from_linear(lin, backend="auto" if lin.weight.is_cuda else "emulated")


def build_path(name: str, lin: nn.Linear, layers: dict | None = None) -> tuple[Callable, torch.Tensor]:
    """(callable ``x [M, K] -> [M, N]``, the weight ``[N, K]`` it multiplies as float32) of path ``name`` over
    ``lin``'s weights. ``layers``: labkit's layers already made from ``lin``, by format (shared by a format's
    paths). Raises ``PeerUnavailable`` (or the library's error) where the path cannot be built."""
    cands = candidates()
    if name not in cands:
        raise ValueError(f"path {name!r} is unknown; allowed: {list(cands)}")
    fmt = cands[name][0]
    if name == BF16:
        return (lambda x: F.linear(x, lin.weight)), lin.weight.float()
    if name in _FROM_BF16:
        mod, w = _FROM_BF16[name](lin)
        return mod, w.float()
    layers = {} if layers is None else layers
    if fmt not in layers:
        layers[fmt] = labkit_layer(fmt, lin)
    layer = layers[fmt]
    fn = layer if name == LABKIT_PATHS[fmt] else build_peer(name, layer)
    return fn, layer.dequantize(torch.float32)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"


def _check(fn: Callable, w_path: torch.Tensor, ref_bf16: torch.Tensor, xs: list[torch.Tensor], fmt: str
           ) -> list[dict]:
    """Per activation of ``xs``: ``{kernel_err, rel_err, ok}`` of one path, against the float32 product of the weights
    it holds (``kernel_err``, which must be within ``TOLERANCE[fmt]``) and of the bf16 layer's (``ref_bf16``, the
    rows of ``xs`` stacked: ``rel_err``)."""
    with torch.no_grad():
        ref_path = torch.cat(xs).float() @ w_path.T
    out, row = [], 0
    for x in xs:
        with torch.no_grad():
            y = fn(x).float()
        rp, rb = ref_path[row:row + x.shape[0]], ref_bf16[row:row + x.shape[0]]
        row += x.shape[0]
        kernel = float((y - rp).norm() / rp.norm())
        ok = kernel == kernel and kernel <= TOLERANCE[fmt] and bool(torch.isfinite(y).all())
        out.append({"kernel_err": kernel, "rel_err": float((y - rb).norm() / rb.norm()), "ok": ok})
    return out


def check_path(fn: Callable, w_path: torch.Tensor, lin: nn.Linear, x: torch.Tensor, fmt: str) -> dict:
    """``{kernel_err, rel_err, ok}`` of one path on activations ``x``: against the float32 product of the weights it
    holds (``kernel_err``, which must be within ``TOLERANCE[fmt]``) and of the bf16 layer's (``rel_err``)."""
    with torch.no_grad():
        ref = x.float() @ lin.weight.float().T
    return _check(fn, w_path, ref, [x], fmt)[0]


def available(name: str, device: str = "cpu") -> str:
    """'ok' where path ``name`` builds on a small layer on ``device``, else its error (what a CPU can say ahead)."""
    lin = nn.Linear(256, 64, bias=False, device=device)
    try:
        build_path(name, lin)
        return "ok"
    except (PeerUnavailable, ImportError, RuntimeError, ValueError, AssertionError) as e:
        return _error(e)


BUILD_ORDER = ("labkit", "torch", "gemlite", "torchao", "torch.compile")
"""The order paths are built and checked in, so that a time budget spent leaves last what costs most to build and
matters least: labkit's own, torch's kernels (tinygemm, ``_int_mm``, labkit's fused FP8), gemlite (which compiles and
autotunes its Triton kernels per shape on first use), torchao's configs, then ``torch.compile``."""


def build_rank(name: str) -> int:
    """``name``'s place in ``BUILD_ORDER`` (a path of an unlisted library last)."""
    lib = "torch.compile" if name.startswith("torch.compile") else candidates()[name][1]
    return BUILD_ORDER.index(lib) if lib in BUILD_ORDER else len(BUILD_ORDER)


W8A8 = ("_int_mm", "A8W8", "_scaled_mm", "Float8Dynamic")
"""Path names with quantised activations: they multiply on the 8-bit tensor cores (twice bf16's rate on Hopper);
every other quantised path widens its weights to 16 bits and multiplies at bf16's rate."""


def is_w8a8(path: str) -> bool:
    """Whether a path quantises its activations too (``W8A8``)."""
    return any(k in path for k in W8A8) or path.startswith(("labkit Fp8Linear", "Fp8Linear", "torch.compile(fp8"))
