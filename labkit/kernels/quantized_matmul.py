"""Weight-only quantised matmul with the dequantisation fused into the weight load (W8A16, W4A16).

``y = x @ W.T`` where ``W`` is stored as int8 (per-output-channel scale) or packed int4 (group-wise scale and
zero-point), in the formats of ``labkit.quant.packing``. At decode batch sizes a linear layer is a GEMV: it
reads every weight byte once and does 2 FLOPs per weight, so its time is the weight bytes over bandwidth.
Storing 1 or 0.5 bytes per weight instead of 2 and expanding them in registers -- never in memory -- cuts
that time about 2x or 4x (minus the scales' bytes). Dequantising to a bf16 copy first, as the torch
reference does, would read the int weights, write and re-read bf16: slower than plain bf16.

Two kernels per format: a GEMV for one row of ``x`` (no Tensor Cores; a ``[BLOCK_N, BLOCK_K]`` weight tile
times a broadcast ``x`` slice, reduced at the end), and a tiled GEMM on Tensor Cores (``tl.dot``) for more
rows, so every batch size is correct and the decode case is fast.

Int4 in the GEMV: the two nibbles of a byte hold ``k`` and ``k + 1``, so the even and odd elements of ``x``
multiply the low and high nibbles; stepping one group at a time, the group's scale and zero-point are one
value per row (``(q - z) * s * x = s * q * x - s * z * x``), loaded once instead of once per weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor, next_pow2, refuse_bf16_dot_on_cpu


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference: dequantise to float32 (float64 if ``x`` is), matmul, cast to ``x``'s dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(dt) @ (qweight.to(dt) * scale.to(dt)[:, None]).T).to(x.dtype)


def w4a16_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """Torch reference through ``labkit.quant.packing.dequantize_int4`` in float32 (float64 if ``x`` is)."""
    from labkit.quant.packing import dequantize_int4

    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_int4(packed, scales.to(dt), zeros.to(dt), group_size)
    return (x.to(dt) @ w.T).to(x.dtype)


# --- GEMV (one row of x) ---------------------------------------------------------------------------------
@triton.jit
def _w8_gemv(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn, N_KEY, K_KEY,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduce once at the end, not once per tile
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc += w.to(tl.float32) * x[None, :]
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, (tl.sum(acc, 1) * s).to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _w4_gemv(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_zn, N_KEY, K_KEY,
             GROUP: tl.constexpr, FAST_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    if FAST_GROUPS:
        # one group per step: its scale and zero-point are one value per row, loaded once, and
        # sum_k (q - z) s x = s * sum_k q x - s z * sum_k x needs no per-weight scale load
        HALF_G: tl.constexpr = GROUP // 2
        offs_j = tl.arange(0, HALF_G)
        acc2 = tl.zeros([BLOCK_N, HALF_G], tl.float32)  # reduced once at the end
        for k0 in range(0, K, GROUP):
            j = k0 // 2 + offs_j  # byte index; K % GROUP == 0, so always in range
            pk = tl.load(p_ptr + n64[:, None] * stride_pn + j[None, :], mask=n_ok[:, None], other=0)
            x_even = tl.load(x_ptr + 2 * j).to(tl.float32)
            x_odd = tl.load(x_ptr + 2 * j + 1).to(tl.float32)
            g = k0 // GROUP
            s = tl.load(s_ptr + n64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            sz = s * tl.load(z_ptr + n64 * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)
            qx = (pk & 0xF).to(tl.float32) * x_even[None, :] + (pk >> 4).to(tl.float32) * x_odd[None, :]
            acc2 += s[:, None] * qx - sz[:, None] * (x_even + x_odd)[None, :]
        acc = tl.sum(acc2, 1)
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        offs_j = tl.arange(0, HALF)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + offs_j
            j_ok = j < K // 2
            ld = n_ok[:, None] & j_ok[None, :]
            pk = tl.load(p_ptr + n64[:, None] * stride_pn + j[None, :], mask=ld, other=0)
            x_even = tl.load(x_ptr + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
            g = (2 * j) // GROUP  # any even group size: both nibbles of a byte share a group
            s = tl.load(s_ptr + n64[:, None] * stride_sn + g[None, :], mask=ld, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + n64[:, None] * stride_zn + g[None, :], mask=ld, other=0.0).to(tl.float32)
            qx = (pk & 0xF).to(tl.float32) * x_even[None, :] + (pk >> 4).to(tl.float32) * x_odd[None, :]
            acc += tl.sum(s * (qx - z * (x_even + x_odd)[None, :]), 1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# --- GEMM (Tensor Cores) ---------------------------------------------------------------------------------
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
def _w8_gemm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_KEY, N_KEY, K_KEY,
             PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    out = (acc * s[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], out,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _w4_gemm(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_zn,
             stride_om, M_KEY, N_KEY, K_KEY, GROUP: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --- autotuning (CUDA) and fixed tiles (interpreter) -----------------------------------------------------
def _gemv_configs() -> list:
    # H200 GEMV: many small row blocks so every SM streams weights; 16-byte loads along K
    cfgs = [(16, 512, 4, 3), (32, 512, 8, 3), (8, 1024, 4, 3), (32, 256, 4, 4), (64, 256, 8, 3), (16, 1024, 8, 2)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in cfgs]


def _gemm_configs() -> list:
    cfgs = [(16, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for m, n, k, w, s in cfgs]


def _prune_w4_gemv(configs, named_args, **kwargs):
    """Fast group path: a step is one group, so BLOCK_K is moot; keep row blocks whose tile fits registers."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    if not kwargs.get("FAST_GROUPS", named_args.get("FAST_GROUPS")):
        return configs
    out, seen = [], set()
    for c in configs:
        key = (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
        if key not in seen and c.kwargs["BLOCK_N"] * group // 2 <= 8192:
            seen.add(key)
            out.append(c)
    return out or configs[:1]


def _prune_gemm(configs, named_args, **kwargs):
    m = named_args["M_KEY"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)]
    return kept or configs


_w8_gemv_tuned = triton.autotune(_gemv_configs(), key=["N_KEY", "K_KEY"])(_w8_gemv)
_w4_gemv_tuned = triton.autotune(_gemv_configs(), key=["N_KEY", "K_KEY", "GROUP"],
                                 prune_configs_by={"early_config_prune": _prune_w4_gemv})(_w4_gemv)
_w8_gemm_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY"],
                                 prune_configs_by={"early_config_prune": _prune_gemm})(_w8_gemm)
_w4_gemm_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY", "GROUP"],
                                 prune_configs_by={"early_config_prune": _prune_gemm})(_w4_gemm)
CPU_GEMV = dict(BLOCK_N=16, BLOCK_K=64)
CPU_GEMM = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)


def _check_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    check_tensor("x", x, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be [..., K] with K={k}, the in-features of {what}")
    return x.reshape(-1, k) if x.stride(-1) == 1 else x.reshape(-1, k).contiguous()


def _launch(x2: torch.Tensor, n: int, kernels: tuple, args: tuple, w_strides: tuple, gemv_meta: dict,
            gemm_meta: dict) -> torch.Tensor:
    """GEMV for one row, GEMM for more; ``kernels`` = (gemv, gemv_tuned, gemm, gemm_tuned)."""
    gemv, gemv_tuned, gemm, gemm_tuned = kernels
    m, k = x2.shape
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    cuda = x2.device.type == "cuda"
    if m == 1:
        ptrs = (x2, *args, out, n, k, *w_strides, next_pow2(n), next_pow2(k))
        if cuda:
            gemv_tuned[lambda c: (triton.cdiv(n, c["BLOCK_N"]),)](*ptrs, **gemv_meta)
        else:
            gemv[(triton.cdiv(n, CPU_GEMV["BLOCK_N"]),)](*ptrs, **gemv_meta, **CPU_GEMV)
        return out
    refuse_bf16_dot_on_cpu("x", x2)
    ptrs = (x2, *args, out, m, n, k, x2.stride(0), *w_strides, out.stride(0), next_pow2(m), next_pow2(n),
            next_pow2(k))
    meta = dict(gemm_meta, PRECISION="ieee" if x2.dtype == torch.float32 else "tf32")
    if cuda:
        gemm_tuned[lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)](*ptrs, **meta)
    else:
        grid = (triton.cdiv(m, CPU_GEMM["BLOCK_M"]) * triton.cdiv(n, CPU_GEMM["BLOCK_N"]),)
        gemm[grid](*ptrs, **meta, **CPU_GEMM)
    return out


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` with the int8 weights dequantised in registers.

    ``x`` ``[..., K]`` float16/bfloat16/float32 (bfloat16 with more than one row needs CUDA); ``qweight`` int8
    ``[N, K]``; ``scale`` ``[N]`` (any float dtype). Returns ``[..., N]`` in ``x``'s dtype, accumulated in
    float32. One row of ``x`` takes the GEMV kernel, more rows the Tensor-Core GEMM.
    """
    check_tensor("qweight", qweight, (torch.int8,), dim=2)
    check_tensor("scale", scale, FLOAT_DTYPES, dim=1, device=qweight.device)
    n, k = qweight.shape
    if scale.shape[0] != n:
        raise ValueError(f"scale {tuple(scale.shape)} must be [N] with N={n} from qweight {tuple(qweight.shape)}")
    x2 = _check_x(x, k, f"qweight {tuple(qweight.shape)}")
    check_tensor("x", x2, device=qweight.device)
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    kernels = (_w8_gemv, _w8_gemv_tuned, _w8_gemm, _w8_gemm_tuned)
    out = _launch(x2, n, kernels, (w, scale.contiguous()), (w.stride(0),), {}, {})
    return out.view(*x.shape[:-1], n)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """``x @ W.T`` with ``W = (q - zeros) * scales`` per group, unpacked from int4 in registers.

    ``x`` ``[..., K]`` float16/bfloat16/float32 (bfloat16 with more than one row needs CUDA); ``packed`` uint8
    ``[N, K // 2]`` (low nibble = even ``k``); ``scales``, ``zeros`` ``[N, K // group_size]`` (any float dtype);
    ``group_size`` an even divisor of ``K`` (powers of two >= 16 take the per-group fast path at batch 1).
    Returns ``[..., N]`` in ``x``'s dtype, accumulated in float32.
    """
    check_tensor("packed", packed, (torch.uint8,), dim=2)
    check_tensor("scales", scales, FLOAT_DTYPES, dim=2, device=packed.device)
    check_tensor("zeros", zeros, FLOAT_DTYPES, dim=2, device=packed.device)
    n, k = packed.shape[0], 2 * packed.shape[1]
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be an even integer dividing K={k} (e.g. 32, 64, 128)")
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must be "
                         f"[N, K // group_size] = [{n}, {k // group_size}]")
    x2 = _check_x(x, k, f"packed {tuple(packed.shape)} (K = 2 * packed.shape[1])")
    check_tensor("x", x2, device=packed.device)
    p = packed if packed.stride(-1) == 1 else packed.contiguous()
    s, z = scales.contiguous(), zeros.contiguous()
    fast = group_size >= 16 and group_size & (group_size - 1) == 0
    kernels = (_w4_gemv, _w4_gemv_tuned, _w4_gemm, _w4_gemm_tuned)
    out = _launch(x2, n, kernels, (p, s, z), (p.stride(0), s.stride(0), z.stride(0)),
                  {"GROUP": group_size, "FAST_GROUPS": fast}, {"GROUP": group_size})
    return out.view(*x.shape[:-1], n)
