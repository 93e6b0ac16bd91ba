"""The kernels a practitioner would reach for beside labkit's own, as paths a quantised layer can take.

labkit's int8 / int4 / FP8 linears (``Int8Linear``, ``Int4Linear``, ``Fp8Linear``) are the teaching kernels: a
batch-one GEMV built around the bytes, and a plain tensor-core GEMM for more rows. Production stacks multiply the
same weight formats with other kernels, and which is fastest depends on the number of rows. Each ``PeerPath`` here
builds, from one of labkit's quantised layers (its codes and scales as they are: no second quantisation), a callable
``[M, K] -> [M, N]`` that computes the same product with another library's kernel:

==============================================  ======  ========================================================
path                                            format  kernel
==============================================  ======  ========================================================
``torch._int_mm W8A8 (cuBLAS)``                 int8    activations quantised per token in torch, cuBLAS int8
``gemlite A16W8 int8 (Triton)``                 int8    gemlite's weight-only int8 GEMV / split-K GEMM / GEMM
``gemlite A8W8 int8 dynamic (Triton)``          int8    gemlite, activations quantised per token in Triton
``torch._weight_int4pack_mm (tinygemm)``        int4    gpt-fast's and torchao's int4 weight-only kernel
``gemlite A16W4 (Triton)``                      int4    gemlite's 4-bit weight-only kernels
``Fp8Linear fused (Triton act quant + _scaled_mm)`` fp8 labkit's one-kernel row quantisation, cuBLAS FP8 GEMM
``gemlite A16W8 fp8 (Triton, weight-only)``     fp8     FP8 weights widened in the kernel, 16-bit activations
``gemlite A8W8 fp8 dynamic (Triton)``           fp8     gemlite, activations quantised per token in Triton
==============================================  ======  ========================================================

``LABKIT_PATHS`` names each format's own path (the layer's own forward). gemlite is optional (``pip install
labkit[peers]``; on the GPU from the wheels of ``tools/gpu-wheels.sh DIR peers``): ``build_peer`` raises
``PeerUnavailable`` with the import or build error, which a measurement records. tinygemm and ``_int_mm`` are in
torch; both have CPU kernels, so their format conversions are tested here. Which path a layer takes at which batch
is ``labkit.quant.dispatch``'s decision, from a table measured on the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.quant.fp8 import Fp8Linear, quantize_fp8_rows
from labkit.quant.packing import unpack_int4
from labkit.quant.weight_only import Int4Linear, Int8Linear

LABKIT_PATHS = {"int8": "labkit Int8Linear (Triton)", "int4": "labkit Int4Linear (Triton)",
                "fp8": "labkit Fp8Linear (eager act quant + _scaled_mm)"}
"""Each format's own path: the labkit layer's forward (for FP8 the eager quantisation of notebook 04)."""
LEGACY_NAMES = {"torch._scaled_mm W8A8 (cuBLAS)": LABKIT_PATHS["fp8"]}
"""Path names of records made before the peers were measured: their FP8 row was ``Fp8Linear``'s eager quantisation
and ``_scaled_mm``, labkit's own FP8 path."""
LAYER_TYPES = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}
"""The labkit layer each format's peers are built from."""
TINYGEMM_INNER_K_TILES = 8
"""tinygemm's ``inner_k_tiles`` (gpt-fast's and torchao's default): in-features must divide by 16 x this."""


class PeerUnavailable(RuntimeError):
    """A peer path that cannot be built here: its library is missing, or the shape or device is not one its kernel
    takes. The message says which."""


@dataclass(frozen=True)
class PeerPath:
    """One way to multiply a format's weights: ``name`` (as format_gemm rows and dispatch tables name it),
    ``fmt``, the library it comes from, whether it needs CUDA, and ``build(layer) -> callable``."""

    name: str
    fmt: str
    library: str
    cuda_only: bool
    build: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]


# --- int8 -------------------------------------------------------------------------------------------------------
def _int_mm(layer: Int8Linear):
    """W8A8 through cuBLAS ``torch._int_mm``: the layer's int8 codes and per-row scales; activations quantised per
    token (absmax / 127), int32 accumulation, both scales applied in float32. ``_int_mm`` needs more than 16 rows:
    smaller batches are padded to 32 (the padding is part of the path's cost)."""
    w_t = layer.qweight.t()  # [K, N], column-major: what _int_mm takes as its second operand
    scale = layer.scale.float()

    def run(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        xs = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        xq = (x.float() / xs).round().clamp(-127, 127).to(torch.int8)
        if m <= 16:
            xq = F.pad(xq, (0, 0, 0, 32 - m))
        return (torch._int_mm(xq, w_t)[:m].float() * xs * scale).to(x.dtype)
    return run


def _gemlite():
    try:
        import gemlite  # noqa: F401
        from gemlite import helper
    except Exception as e:  # ImportError, or gemlite's own check for CUDA at import
        raise PeerUnavailable(f"gemlite is not importable here ({type(e).__name__}: {str(e)[:160]}); install the "
                              "optional extra: pip install 'labkit[peers]' (on the GPU machine: the wheels of "
                              "tools/gpu-wheels.sh DIR peers)") from None
    _gemlite_configs()
    return helper


GEMLITE_AUTOTUNE = "default"
"""gemlite's autotune setting here: its shipped launch configurations where they hold the shape, else its default
ones. Its 'fast' search compiles dozens of variants per shape and kernel (minutes per layer), more than one device
call allows; a gemlite number is then a lower bound of what its search would find."""
GEMLITE_SETUP: dict = {}
"""What ``_gemlite_configs`` set up (the autotune setting, the configuration file loaded): measurements record it."""


def _gemlite_configs() -> None:
    """gemlite ships launch configurations tuned per GPU and loads the one whose tag is in the device's name; an H200
    ('nvidia_h200') matches none, so Hopper parts take the H100's (same sm_90). Autotune as ``GEMLITE_AUTOTUNE``."""
    if GEMLITE_SETUP or not torch.cuda.is_available():
        return
    import os

    import gemlite

    gemlite.set_autotune(GEMLITE_AUTOTUNE)
    name = torch.cuda.get_device_name().lower()
    path = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    loaded = "its own, by device name" if "h100" in name else "none"
    if "h100" not in name and torch.cuda.get_device_capability()[0] == 9 and os.path.exists(path):
        gemlite.load_config(path)
        loaded = "h100.json (same sm_90)"
    GEMLITE_SETUP.update(autotune=GEMLITE_AUTOTUNE, configs=loaded, version=getattr(gemlite, "__version__", "?"))


def _gemlite_layer(make) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        g = make()
    except PeerUnavailable:
        raise
    except Exception as e:
        raise PeerUnavailable(f"gemlite could not pack these weights ({type(e).__name__}: {str(e)[:200]})") from None
    return lambda x: g(x)


def _gemlite_rows(kind: str):
    """The builder of gemlite's ``helper.<kind>`` over an int8 or FP8 layer's codes and per-row scales."""
    def build(layer: nn.Module):
        helper = _gemlite()
        w, s = (layer.qweight, layer.scale) if isinstance(layer, Int8Linear) else (layer.weight, layer.weight_scale)
        return _gemlite_layer(lambda: getattr(helper, kind)(device=str(w.device), dtype=torch.bfloat16)
                              .from_weights(w, None, s.float()[:, None]))
    return build


# --- int4 -------------------------------------------------------------------------------------------------------
def tinygemm_weights(layer: Int4Linear, inner_k_tiles: int = TINYGEMM_INNER_K_TILES
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, ``scales_and_zeros`` ``[K // group, N, 2]``) of ``torch._weight_int4pack_mm`` holding
    exactly the layer's int4 weights. labkit stores ``w = (q - zero) * scale``; tinygemm computes ``w = (q - 8) *
    scale + zero'``, so ``zero' = (8 - zero) * scale`` (rounded to the activations' dtype, bf16 on the GPU). On the
    CPU, torch's ``_for_cpu`` pair of ops (another packing, the same arithmetic)."""
    n, k, g = layer.out_features, layer.in_features, layer.group_size
    n_div = 8 if layer.packed.is_cuda else 16  # the CPU kernel packs 16 output rows together
    if g not in (32, 64, 128, 256) or n % n_div or k % (16 * inner_k_tiles):
        raise PeerUnavailable(f"tinygemm takes group sizes 32-256, out_features % {n_div} == 0 and in_features % "
                              f"{16 * inner_k_tiles} == 0; this layer is [{n}, {k}] with group {g}")
    q = unpack_int4(layer.packed)  # [N, K] codes 0..15, uint8
    s = layer.scales.float()
    sz = torch.stack([s, (8 - layer.zeros.float()) * s], dim=-1).transpose(0, 1).contiguous()
    if q.is_cuda:
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(),
                                                            inner_k_tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), inner_k_tiles)
    return packed, sz


def _tinygemm(layer: Int4Linear):
    packed, sz = tinygemm_weights(layer)
    g = layer.group_size
    if packed.is_cuda:
        szb = sz.to(torch.bfloat16)

        def run(x: torch.Tensor) -> torch.Tensor:  # tinygemm multiplies bf16 activations only
            return torch._weight_int4pack_mm(x.to(torch.bfloat16), packed, g, szb).to(x.dtype)
        return run
    by_dtype = {dt: sz.to(dt) for dt in (torch.float32, torch.float16, torch.bfloat16)}
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, by_dtype[x.dtype])


def _gemlite_a16w4(layer: Int4Linear):
    helper = _gemlite()
    q = unpack_int4(layer.packed)
    return _gemlite_layer(lambda: helper.A16Wn(device=str(q.device), dtype=torch.bfloat16).from_weights(
        q, layer.scales.to(torch.bfloat16), layer.zeros.to(torch.bfloat16), 4, layer.group_size))


# --- fp8 --------------------------------------------------------------------------------------------------------
def _fp8_scaled_mm(fused: bool):
    """The layer's codes and scales through ``torch._scaled_mm`` (row-wise scales, bf16 out), the rows quantised by
    one Triton kernel (``fused``: the layer's ``fused`` backend) or in eager torch (its own ``scaled_mm``)."""
    def build(layer: Fp8Linear):
        from labkit.kernels.fp8_quant import quantize_rows_fp8

        quantise = quantize_rows_fp8 if fused else quantize_fp8_rows
        w_t, ws = layer.weight.t(), layer.weight_scale[None, :]
        if fused and (layer.out_features % 16 or layer.in_features % 16):
            raise PeerUnavailable(f"torch._scaled_mm needs both dimensions divisible by 16; the layer is "
                                  f"[{layer.out_features}, {layer.in_features}]")

        def run(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantise(x)
            return torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).to(x.dtype)
        return run
    return build


PEERS: dict[str, PeerPath] = {p.name: p for p in (
    PeerPath("torch._int_mm W8A8 (cuBLAS)", "int8", "torch", False, _int_mm),
    PeerPath("gemlite A16W8 int8 (Triton)", "int8", "gemlite", True, _gemlite_rows("A16W8_INT8")),
    PeerPath("gemlite A8W8 int8 dynamic (Triton)", "int8", "gemlite", True, _gemlite_rows("A8W8_int8_dynamic")),
    PeerPath("torch._weight_int4pack_mm (tinygemm)", "int4", "torch", False, _tinygemm),
    PeerPath("gemlite A16W4 (Triton)", "int4", "gemlite", True, _gemlite_a16w4),
    PeerPath("Fp8Linear fused (Triton act quant + _scaled_mm)", "fp8", "labkit", False, _fp8_scaled_mm(True)),
    PeerPath(LABKIT_PATHS["fp8"], "fp8", "labkit", False, _fp8_scaled_mm(False)),
    PeerPath("gemlite A16W8 fp8 (Triton, weight-only)", "fp8", "gemlite", True, _gemlite_rows("A16W8_FP8")),
    PeerPath("gemlite A8W8 fp8 dynamic (Triton)", "fp8", "gemlite", True, _gemlite_rows("A8W8_fp8_dynamic")),
)}
"""Every path a labkit layer can take besides its own, by name (module docstring)."""


def layer_format(layer: nn.Module) -> str | None:
    """'int8', 'int4' or 'fp8' for labkit's quantised layers, else None."""
    return next((f for f, t in LAYER_TYPES.items() if type(layer) is t), None)


def engine_paths(fmt: str) -> tuple[str, ...]:
    """Every path a layer of ``fmt`` can run in the engine: its own first, then the peers."""
    if fmt not in LAYER_TYPES:
        raise ValueError(f"fmt={fmt!r} is unknown; allowed: {sorted(LAYER_TYPES)}")
    return (LABKIT_PATHS[fmt], *(n for n, p in PEERS.items() if p.fmt == fmt and n != LABKIT_PATHS[fmt]))


def build_peer(name: str, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable ``x [M, K] -> [M, N]`` of peer ``name`` over ``layer``'s weights; ``PeerUnavailable`` (saying
    why) where it cannot run here; ``ValueError`` for an unknown name or a layer of another format."""
    if name not in PEERS:
        raise ValueError(f"peer {name!r} is unknown; allowed: {sorted(PEERS)}")
    p = PEERS[name]
    if type(layer) is not LAYER_TYPES[p.fmt]:
        raise ValueError(f"peer {name!r} multiplies {p.fmt} weights: it is built from a "
                         f"{LAYER_TYPES[p.fmt].__name__}, not a {type(layer).__name__}")
    device = next(iter(layer.buffers())).device
    if p.cuda_only and device.type != "cuda":
        raise PeerUnavailable(f"{name} runs on CUDA only (its kernels are Triton on the GPU); the layer is on "
                              f"{device}")
    return p.build(layer)
