"""The public quantised matmuls: ``w8a16_matmul``, ``w4a16_matmul``, the merged q/k/v projections with RoPE and
the cache write (``w8a16_qkv_rope_cache``, ``w4a16_qkv_rope_cache``), and their torch references.

Each picks its kernel from the call: one 16-bit row with whole tiles takes a stationary GEMV (``stationary.py``;
int8 only with neighbours inside), any other single row the split-K GEMV (``splitk.py``), more rows the Tensor-Core
GEMM (``gemm.py``). ``tuning`` (``tuning.QuantTuning``) gives the launches; None takes ``tuning_for(device)``.
``log`` (a ``labkit.kernels.common.KernelLog``) records the launch each call took: op 'matmul', the launcher, the
neighbours it took in, its PDL mode and a stationary GEMV's plan.
"""

from __future__ import annotations

import torch

from labkit.kernels.common import FLOAT_DTYPES, KernelLog, check_tensor
from labkit.kernels.quantized_matmul.fused import qkv_rope_cache, with_neighbours
from labkit.kernels.quantized_matmul.gemm import quantized_gemm
from labkit.kernels.quantized_matmul.packing import dequantize_int4
from labkit.kernels.quantized_matmul.splitk import any_group_gemv, splitk_gemv
from labkit.kernels.quantized_matmul.stationary import w4_gemv_xs, w8_gemv_xs
from labkit.kernels.quantized_matmul.tuning import (
    QuantTuning,
    StationaryPlan,
    check_tuning,
    sms_of,
    stationary_plan,
    tuning_for,
)


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference: dequantise to float32 (float64 if ``x`` is), matmul, cast to ``x``'s dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(dt) @ (qweight.to(dt) * scale.to(dt)[:, None]).T).to(x.dtype)


def w4a16_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """Torch reference through ``packing.dequantize_int4`` in float32 (float64 if ``x`` is)."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_int4(packed, scales.to(dt), zeros.to(dt), group_size)
    return (x.to(dt) @ w.T).to(x.dtype)


def _tuning(tuning: QuantTuning | None, device: torch.device) -> QuantTuning:
    return tuning_for(device) if tuning is None else check_tuning(tuning)


def _logged(log: KernelLog | None, name: str, launch):
    """``launch(rows, plan, **neighbours)`` of the stationary GEMV ``name``, recorded in ``log`` first."""
    if log is None:
        return launch

    def run(rows, plan, **kw):
        log.record("matmul", name, [k for k in kw if k != "pdl"], kw.get("pdl", ""), plan, rows.shape[0])
        return launch(rows, plan, **kw)
    return run


def _note(log: KernelLog | None, name: str, rows: int) -> None:
    if log is not None:
        log.record("matmul", name, rows=rows)


# --- int8 ------------------------------------------------------------------------------------------------------
def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, swiglu: bool = False,
                 norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                 residual: torch.Tensor | None = None, pdl: str = "", tuning: QuantTuning | None = None,
                 log: KernelLog | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` with the int8 weights dequantised in registers.

    ``x`` ``[..., K]`` float16/bfloat16/float32 (bfloat16 with more than one row needs CUDA); ``qweight`` int8
    ``[N, K]``; ``scale`` ``[N]`` (any float dtype). Returns ``[..., N]`` in ``x``'s dtype, accumulated in
    float32. One row of ``x`` takes the split-K GEMV, more rows the Tensor-Core GEMM. ``swiglu``,
    ``norm_weight``/``norm_eps``, ``residual`` and ``pdl``: a decoder layer's neighbours of the projection, as
    ``w4a16_matmul`` takes them; one 16-bit row with whole words does them inside the stationary int8 GEMV
    (``w8_gemv_xs``); a bare product keeps the autotuned split-K GEMV, faster there (notebook 03). ``tuning``: the
    launches (None: ``tuning_for(x.device)``); ``log``: as the module docstring says.
    """
    w, s = _check_int8_weights(qweight, scale)
    n, k = w.shape
    check_tensor("x", x, FLOAT_DTYPES, device=qweight.device)
    t = _tuning(tuning, x.device)
    wanted = swiglu or norm_weight is not None or residual is not None or bool(pdl)
    return with_neighbours(
        x, n, k, f"qweight {tuple(qweight.shape)}", swiglu, norm_weight, norm_eps, residual, pdl,
        plan=lambda rows, norm: _plan8(rows, n, k, w, norm, t) if wanted else None,
        launch=_logged(log, "w8_gemv_xs", lambda rows, plan, **kw: w8_gemv_xs(rows, w.view(torch.int32), s, plan,
                                                                                **kw)),
        product=lambda x_: _w8a16_matmul(x_, w, s, t, log))


def _check_int8_weights(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Refuse int8 weights the kernels cannot read; returns them with contiguous rows and scales."""
    check_tensor("qweight", qweight, (torch.int8,), dim=2)
    check_tensor("scale", scale, FLOAT_DTYPES, dim=1, device=qweight.device)
    if scale.shape[0] != qweight.shape[0]:
        raise ValueError(f"scale {tuple(scale.shape)} must be [N] with N={qweight.shape[0]} from qweight "
                         f"{tuple(qweight.shape)}")
    return qweight if qweight.stride(-1) == 1 else qweight.contiguous(), scale.contiguous()


def _check_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    check_tensor("x", x, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be [..., K] with K={k}, the in-features of {what}")
    return x.reshape(-1, k) if x.stride(-1) == 1 else x.reshape(-1, k).contiguous()


def _w8a16_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, t: QuantTuning,
                  log: KernelLog | None = None) -> torch.Tensor:
    """The product alone (checked arguments): the split-K GEMV for one row, the GEMM for more."""
    n, k = w.shape
    x2 = _check_x(x, k, f"qweight {tuple(w.shape)}")
    m = x2.shape[0]
    if m and n:
        _note(log, "splitk_gemv" if m == 1 else "quantized_gemm", m)
    if m == 0 or n == 0:
        out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    elif m == 1:
        aligned = k % 4 == 0 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0
        out = splitk_gemv(x2, n, 8, (w.view(torch.uint8), s), (w.stride(0), 0xFF, 0xFF00),
                          {"WORDS_ALIGNED": aligned}, t.w8_splitk)
    else:
        out = quantized_gemm(x2, n, "w8", (w, s), (w.stride(0),), {}, t.gemm)
    return out.view(*x.shape[:-1], n)


def _plan8(x2: torch.Tensor, n: int, k: int, w: torch.Tensor, norm: bool, t: QuantTuning) -> StationaryPlan | None:
    """The stationary int8 GEMV's launch for activation rows ``x2`` and int8 weights ``w``, or None where another
    kernel takes them: more than one row, float32 activations, or rows not whole 4-byte words."""
    if x2.shape[0] != 1 or x2.dtype == torch.float32 or k % 4 or w.stride(0) % 4 or w.data_ptr() % 4:
        return None
    return stationary_plan(n, k, 4, t.w8_stationary, sms_of(t, x2.device), norm=norm)


def w8a16_qkv_rope_cache(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, num_heads: int,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                         pdl: str = "", tuning: QuantTuning | None = None,
                         log: KernelLog | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w4a16_qkv_rope_cache`` for a merged int8 q/k/v projection (``qweight`` int8 ``[(num_heads + 2 *
    num_kv_heads) * head_dim, K]``, ``scale`` ``[N]``): on one 16-bit row the stationary int8 GEMV rotates and
    caches in its store, else ``w8a16_matmul`` then ``apply_rope_and_cache``."""
    w, s = _check_int8_weights(qweight, scale)
    check_tensor("x", x, FLOAT_DTYPES, device=qweight.device)
    n, k = w.shape
    t = _tuning(tuning, x.device)
    return qkv_rope_cache(
        x, n, k, f"qweight {tuple(qweight.shape)}", num_heads, cos, sin, k_cache, v_cache, slot_mapping,
        norm_weight, norm_eps, pdl, plan=lambda rows: _plan8(rows, n, k, w, True, t),
        launch=_logged(log, "w8_gemv_xs", lambda rows, plan, **kw: w8_gemv_xs(rows, w.view(torch.int32), s, plan,
                                                                                **kw)),
        matmul=lambda **kw: w8a16_matmul(x, w, s, tuning=t, log=log, **kw))


# --- int4 ------------------------------------------------------------------------------------------------------
def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, swiglu: bool = False, norm_weight: torch.Tensor | None = None,
                 norm_eps: float = 1e-6, residual: torch.Tensor | None = None, pdl: str = "",
                 tuning: QuantTuning | None = None, log: KernelLog | None = None) -> torch.Tensor:
    """``x @ W.T`` with ``W = (q - zeros) * scales`` per group, unpacked from int4 in registers.

    ``x`` ``[..., K]`` float16/bfloat16/float32 (bfloat16 with more than one row needs CUDA); ``packed`` uint8
    ``[N, K // 2]`` (low nibble = even ``k``); ``scales``, ``zeros`` ``[N, K // group_size]`` (any float dtype);
    ``group_size`` an even divisor of ``K`` (powers of two from 8 to 1024 take the stationary or split-K GEMV at
    batch 1, other sizes a plain per-weight one). Returns ``[..., N]`` in ``x``'s dtype, accumulated in float32.

    What a decoder layer does around its projections can come in too; one 16-bit row on the stationary GEMV does
    it inside the kernel (no launch of its own, no round trip through memory), any other case with the separate
    kernels first (or last), as the model rounds:

    * ``swiglu``: ``x`` is ``[..., 2K]``, a merged gate/up projection's output ``[gate | up]``, and the product is
      ``silu_and_mul(x) @ W.T`` (an MLP's down projection), with the same bits as ``silu_and_mul`` first.
    * ``norm_weight`` ``[K]`` (and ``norm_eps``): the product is ``rms_norm(x, norm_weight, norm_eps) @ W.T``
      (the projections after a layer's RMSNorm), within a rounding of the separate kernel (the row statistic is
      summed in another order).
    * ``residual`` ``[..., N]`` in ``x``'s dtype: returns ``residual + x @ W.T``, the product rounded first (the
      o and down projections, which end in the residual add).

    ``pdl`` (``"release"``, ``"overlap"``; sm_90, the stationary GEMV only): programmatic dependent launch, so
    that a chain of GEMVs streams weights through each launch's tail (``stationary.w4_gemv_xs``). ``tuning``: the
    launches (None: ``tuning_for(x.device)``); ``log``: as the module docstring says.
    """
    p, s, z = _check_int4_weights(packed, scales, zeros, group_size)
    n, k = p.shape[0], 2 * p.shape[1]
    check_tensor("x", x, FLOAT_DTYPES, device=packed.device)
    t = _tuning(tuning, x.device)
    return with_neighbours(
        x, n, k, f"packed {tuple(packed.shape)} (K = 2 * packed.shape[1])", swiglu, norm_weight, norm_eps,
        residual, pdl, plan=lambda rows, norm: _plan4(rows, n, k, group_size, p, t, norm),
        launch=_logged(log, "w4_gemv_xs", lambda rows, plan, **kw: w4_gemv_xs(rows, p.view(torch.int32), s, z,
                                                                                group_size, plan, **kw)),
        product=lambda x_: _w4a16_matmul(x_, p, s, z, group_size, t, log))


def _check_int4_weights(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refuse int4 weights the kernels cannot read; returns them with contiguous rows, scales and zeros."""
    check_tensor("packed", packed, (torch.uint8,), dim=2)
    check_tensor("scales", scales, FLOAT_DTYPES, dim=2, device=packed.device)
    check_tensor("zeros", zeros, FLOAT_DTYPES, dim=2, device=packed.device)
    n, k = packed.shape[0], 2 * packed.shape[1]
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be an even integer dividing K={k} (e.g. 32, 64, 128)")
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must be "
                         f"[N, K // group_size] = [{n}, {k // group_size}]")
    return packed if packed.stride(-1) == 1 else packed.contiguous(), scales.contiguous(), zeros.contiguous()


def _w4a16_matmul(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int,
                  t: QuantTuning, log: KernelLog | None = None) -> torch.Tensor:
    """The product alone (checked arguments): the stationary or split-K GEMV for one row, the GEMM for more."""
    n, k = p.shape[0], 2 * p.shape[1]
    x2 = _check_x(x, k, f"packed {tuple(p.shape)} (K = 2 * packed.shape[1])")
    args, strides = (p, s, z), (p.stride(0), s.stride(0), z.stride(0))
    m = x2.shape[0]
    if m == 0 or n == 0:
        out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    elif m == 1 and _word_gemv(group_size, p):
        words = p.view(torch.int32)  # K % 8 == 0 here: whole 4-byte words per row
        plan = _plan4(x2, n, k, group_size, p, t)
        if plan is not None:
            launch = _logged(log, "w4_gemv_xs", lambda rows, plan: w4_gemv_xs(rows, words, s, z, group_size, plan))
            return launch(x2, plan).view(*x.shape[:-1], n)
        _note(log, "splitk_gemv", 1)
        half = 0 if x2.dtype == torch.float32 else (1 if x2.device.type == "cuda" else 2)
        out = splitk_gemv(x2, n, 4, (words, s, z), (words.stride(0), s.stride(0), z.stride(0), 0x4F000000),
                          {"GROUP": group_size, "HALF_MATH": half}, t.w4_splitk)
    elif m == 1:
        _note(log, "any_group_gemv", 1)
        out = any_group_gemv(x2, p, s, z, group_size)
    else:
        _note(log, "quantized_gemm", m)
        grouped = group_size >= 16 and group_size & (group_size - 1) == 0
        out = quantized_gemm(x2, n, "w4_grouped" if grouped else "w4", args, strides, {"GROUP": group_size}, t.gemm)
    return out.view(*x.shape[:-1], n)


def _word_gemv(group_size: int, p: torch.Tensor) -> bool:
    """Whether the int4 GEMVs that read int32 words take these weights: power-of-two groups of 8-1024, rows on
    4-byte boundaries."""
    return 8 <= group_size <= 1024 and group_size & (group_size - 1) == 0 and p.data_ptr() % 4 == 0


def _plan4(x2: torch.Tensor, n: int, k: int, group_size: int, p: torch.Tensor, t: QuantTuning,
           norm: bool = False) -> StationaryPlan | None:
    """The stationary GEMV's launch for activation rows ``x2`` and packed weights ``p``, or None where another
    kernel takes them: more than one row, float32 activations, or groups or rows it cannot read as words. Word
    pairs wherever a group holds two words or more."""
    if x2.shape[0] != 1 or x2.dtype == torch.float32 or not _word_gemv(group_size, p):
        return None
    return stationary_plan(n, k, group_size, t.w4_stationary, sms_of(t, x2.device), norm=norm,
                           pair_words=group_size >= 16)


def w4a16_qkv_rope_cache(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6, pdl: str = "",
                         tuning: QuantTuning | None = None, log: KernelLog | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A merged q/k/v projection in int4, then RoPE on q and k and the paged-cache write of k and v: what
    ``labkit.kernels.rope.apply_rope_and_cache`` does to ``w4a16_matmul(x, ..., norm_weight=, norm_eps=)`` split
    into heads. ``x`` ``[T, K]``; ``packed`` ``[(num_heads + 2 * num_kv_heads) * head_dim, K // 2]`` with
    ``num_kv_heads`` and ``head_dim`` from ``k_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``cos``/``sin``, caches and ``slot_mapping`` as ``apply_rope_and_cache`` takes them. Returns ``(q_rot [T,
    num_heads, head_dim], k_rot [T, num_kv_heads, head_dim])``.

    One 16-bit row on a split stationary launch whose row blocks fit the heads does it in the GEMV: its programs
    walk each head's rows in rotary pairs (``fused._rope_rows``), and the last program of a row chunk rotates and
    stores them and writes the cache rows -- one launch for the projection, RoPE and the cache write. Anything else
    runs ``w4a16_matmul`` then ``apply_rope_and_cache``. ``pdl``, ``tuning``: as ``w4a16_matmul`` takes them.
    """
    p, s, z = _check_int4_weights(packed, scales, zeros, group_size)
    check_tensor("x", x, FLOAT_DTYPES, device=packed.device)
    n, k = p.shape[0], 2 * p.shape[1]
    t = _tuning(tuning, x.device)
    return qkv_rope_cache(
        x, n, k, f"packed {tuple(packed.shape)}", num_heads, cos, sin, k_cache, v_cache, slot_mapping, norm_weight,
        norm_eps, pdl, plan=lambda rows: _plan4(rows, n, k, group_size, p, t, norm=True),
        launch=_logged(log, "w4_gemv_xs", lambda rows, plan, **kw: w4_gemv_xs(rows, p.view(torch.int32), s, z,
                                                                                group_size, plan, **kw)),
        matmul=lambda **kw: w4a16_matmul(x, p, s, z, group_size, tuning=t, log=log, **kw))
