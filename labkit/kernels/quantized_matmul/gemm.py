"""The quantised GEMMs for more than one row of ``x``: Tensor-Core ``tl.dot`` over weights dequantised in registers.

int8 weights become ``x``'s dtype exactly and meet ``x`` in one dot per step, the per-row scale applied to the
float32 accumulator at the end. int4 with power-of-two groups of 16 or more (``_w4_gemm_grouped``) steps through K
inside one group at a time, so it loads each scale and zero-point once per step and row of weights, and reads the
nibbles as floats without a conversion instruction (``ptx.py``'s magic number); any other even group size takes
``_w4_gemm``, which loads them once per weight (correct, not tuned for speed). On
CUDA the tiles are autotuned per power-of-two ``(M, N, K)`` bucket over ``tuning.GEMM_CANDIDATES``; the
interpreter takes the tuning's fixed ``GemmTile`` (float16/float32 only: its ``tl.dot`` is wrong in bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import next_pow2, refuse_bf16_dot_on_cpu
from labkit.kernels.quantized_matmul.ptx import _MAGIC, _TWO23
from labkit.kernels.quantized_matmul.tuning import GEMM_CANDIDATES, GemmTile


@triton.jit
def _tile_pids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program order: consecutive programs share weight tiles in L2."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column offsets of this program's output tile (in ``_tile_pids`` order)."""
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om):
    """Write a float32 accumulator tile in the output's dtype, inside ``[M, N]``."""
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _w8_gemm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_KEY, N_KEY, K_KEY,
             PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr):
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=(offs_n[:, None] < N) & (k[None, :] < K), other=0)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)  # int8 -> x dtype: exact
    s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    _store_tile(out_ptr, acc * s[None, :], offs_m, offs_n, M, N, stride_om)


@triton.jit
def _w4_gemm(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_zn,
             stride_om, M_KEY, N_KEY, K_KEY, GROUP: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    n64 = offs_n.to(tl.int64)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + offs_j
        j_ok = j < K // 2
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        a_even = tl.load(x_rows + 2 * j[None, :], mask=m_ok[:, None] & j_ok[None, :], other=0.0)
        a_odd = tl.load(x_rows + 2 * j[None, :] + 1, mask=m_ok[:, None] & j_ok[None, :], other=0.0)
        ld = n_ok[:, None] & j_ok[None, :]
        pk = tl.load(p_ptr + n64[:, None] * stride_pn + j[None, :], mask=ld, other=0)
        g = (2 * j) // GROUP
        s = tl.load(s_ptr + n64[:, None] * stride_sn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n64[:, None] * stride_zn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        w_lo = (((pk & 0xF).to(tl.float32) - z) * s).to(a_even.dtype)  # weights of the even k
        w_hi = (((pk >> 4).to(tl.float32) - z) * s).to(a_even.dtype)   # weights of the odd k
        acc = tl.dot(a_even, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(a_odd, tl.trans(w_hi), acc, input_precision=PRECISION)
    _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om)


@triton.jit
def _w4_gemm_grouped(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_zn,
                     stride_om, M_KEY, N_KEY, K_KEY, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Power-of-two groups >= 16 with ``BLOCK_K`` dividing ``GROUP``: every K step lies inside one group, so its
    scales and zero-points are one ``[BLOCK_N]`` load per step (not one per weight), the nibbles become floats
    without a conversion instruction (the magic-number trick of the GEMV) and are interleaved back into k order
    for one ``tl.dot`` over the whole step."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    n64 = offs_n.to(tl.int64)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    p_rows = p_ptr + n64[:, None] * stride_pn + tl.arange(0, HALF)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of GROUP, hence of BLOCK_K: no mask along K
        a = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)
        pk = tl.load(p_rows + k0 // 2, mask=n_ok[:, None], other=0).to(tl.int32)
        g = k0 // GROUP
        s = tl.load(s_ptr + n64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n64 * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)
        lo = ((pk & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23  # the even k of each byte
        hi = (((pk >> 4) & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23  # the odd k
        q = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # [n, j, 2] -> [n, 2j + {0, 1}]
        w = ((q - z[:, None]) * s[:, None]).to(a.dtype)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om)


def _gemm_configs() -> list:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for m, n, k, w, s in GEMM_CANDIDATES]


def _prune_gemm(configs, named_args, **kwargs):
    m = named_args["M_KEY"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)]
    return kept or configs


def _prune_gemm_grouped(configs, named_args, **kwargs):
    """As ``_prune_gemm``, with each step narrowed to divide the group (``BLOCK_K <= GROUP``)."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    out = {}
    for c in _prune_gemm(configs, named_args, **kwargs):
        meta = dict(c.kwargs, BLOCK_K=min(c.kwargs["BLOCK_K"], group))
        out.setdefault(tuple(sorted(meta.items())) + (c.num_warps, c.num_stages),
                       triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages))
    return list(out.values())


_w8_gemm_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY"],
                                 prune_configs_by={"early_config_prune": _prune_gemm})(_w8_gemm)
_w4_gemm_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY", "GROUP"],
                                 prune_configs_by={"early_config_prune": _prune_gemm})(_w4_gemm)
_w4_gemm_grouped_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY", "GROUP"],
                                         prune_configs_by={"early_config_prune": _prune_gemm_grouped})(
    _w4_gemm_grouped)
_KERNELS = {"w8": (_w8_gemm, _w8_gemm_tuned), "w4": (_w4_gemm, _w4_gemm_tuned),
            "w4_grouped": (_w4_gemm_grouped, _w4_gemm_grouped_tuned)}


def quantized_gemm(x2: torch.Tensor, n: int, kind: str, args: tuple, w_strides: tuple, meta: dict,
                   tile: GemmTile | None) -> torch.Tensor:
    """Rows ``x2`` ``[M, K]`` through the GEMM ``kind`` (``"w8"``, ``"w4"``, ``"w4_grouped"``): ``args`` the weight
    tensors, ``w_strides`` their row strides, ``meta`` constexprs beside the tile (``GROUP``); ``tile`` a fixed
    launch (int4 grouped: ``block_k`` narrowed to the group), or None for the autotuner (CUDA). Returns ``[M, N]``."""
    gemm, tuned = _KERNELS[kind]
    m, k = x2.shape
    refuse_bf16_dot_on_cpu("x", x2)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    ptrs = (x2, *args, out, m, n, k, x2.stride(0), *w_strides, out.stride(0), next_pow2(m), next_pow2(n),
            next_pow2(k))
    meta = dict(meta, PRECISION="ieee" if x2.dtype == torch.float32 else "tf32")
    if tile is None:
        if x2.device.type != "cuda":
            raise ValueError("the GEMM's autotuner needs CUDA; pass a GemmTile in the tuning on the CPU")
        tuned[lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)](*ptrs, **meta)
        return out
    block_k = min(tile.block_k, meta["GROUP"]) if kind == "w4_grouped" else tile.block_k
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    gemm[grid](*ptrs, **meta, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=tile.group_m,
               num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
