"""What a decoder layer does around its quantised projections, done inside the stationary GEMVs.

At decode batch 1 a layer is four GEMVs and attention if the GEMVs take in their neighbours: the RMSNorm in the
prologue of the q/k/v and gate/up GEMVs (each program takes the row's statistic; a split program re-reads the row
from L2), SwiGLU as the down GEMV prepares its activations, the residual add in the store of the o and down GEMVs,
and RoPE with the paged-cache write in the store of the merged q/k/v GEMV. Each removes a launch and a round trip
of the activations through memory, with the bits of the separate kernels (the norm's statistic within a rounding:
it is summed in another order). Measured in results/h200/records/04_quantization.json (the engine's 8B int4 step).

The ``@triton.jit`` helpers here are called by ``stationary.py``'s kernels; ``with_neighbours`` and
``qkv_rope_cache`` are the host side: the fused launch where the stationary GEMV applies, else the separate kernels
around the plain product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_pdl, check_tensor


@triton.jit
def _row_rstd(x_ptr, K, eps, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """``1 / sqrt(mean(x ** 2) + eps)`` of the whole row ``x`` (``K = CHUNKS * CHUNK`` values), in float32 as
    ``labkit.kernels.rms_norm`` computes it; every chunk's load is issued before the first is summed."""
    offs = tl.arange(0, CHUNK)
    sq = tl.zeros([CHUNK], tl.float32)
    for j in tl.static_range(CHUNKS):
        v = tl.load(x_ptr + j * CHUNK + offs).to(tl.float32)
        sq += v * v
    return 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)


@triton.jit
def _slice_activations(x_ptr, k, K, SWIGLU: tl.constexpr):
    """The activations at positions ``k`` as float32; with ``SWIGLU`` ``x_ptr`` holds ``[gate | up]`` (``2K``
    values) and they are ``silu(gate) * up``, rounded as ``silu_and_mul`` rounds (the silu, then the product, to
    the input dtype): the same bits as running that kernel first."""
    if SWIGLU:
        g = tl.load(x_ptr + k)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (act.to(tl.float32) * tl.load(x_ptr + K + k).to(tl.float32)).to(g.dtype).to(tl.float32)
    return tl.load(x_ptr + k).to(tl.float32)


@triton.jit
def _normed_activations(x_ptr, norm_w_ptr, k, K, eps, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """RMSNorm's output at positions ``k`` as float32: ``x`` times the row's ``rstd`` rounded to the input dtype,
    times the norm's weight, rounded again (as ``labkit.kernels.rms_norm`` and Hugging Face's ``LlamaRMSNorm``
    round). The slice's and the weight's loads go out first; ``CHUNKS == 1``: ``k`` is the whole row and the
    statistic comes from it, else from the row read again in ``CHUNKS`` chunks of ``CHUNK`` (from L2)."""
    x = tl.load(x_ptr + k)
    w = tl.load(norm_w_ptr + k).to(tl.float32)
    xf = x.to(tl.float32)
    if CHUNKS == 1:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(tl.sum(xf * xf, 2), 1), 0) / K + eps)
    else:
        rstd = _row_rstd(x_ptr, K, eps, CHUNK, CHUNKS)
    return ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)


@triton.jit
def _output_rows(total, rows, res_ptr, out_ptr, RESIDUAL: tl.constexpr):
    """Store float32 row sums in the output's dtype; with ``RESIDUAL`` plus the residual stream's rows, the sum
    rounded again (a decoder layer's ``residual + hidden_states``: the projection's output is rounded first)."""
    y = total.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        y = (y.to(tl.float32) + tl.load(res_ptr + rows).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows, y)


@triton.jit
def _rope_first_row(g, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The first physical row of logical row block ``g`` when blocks pair rotary dims: heads of ``2 * HALF`` rows
    hold ``2 * HALF / BLOCK_N`` blocks, block ``m`` of a head taking dims ``m * BLOCK_N / 2 + j`` and ``HALF + m *
    BLOCK_N / 2 + j``."""
    G: tl.constexpr = 2 * HALF // BLOCK_N
    return (g // G) * (2 * HALF) + (g % G) * (BLOCK_N // 2)


@triton.jit
def _rope_rows(g, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Physical rows (int64 ``[BLOCK_N]``) of logical row block ``g``: half of them in a head's first half, the
    same dims of its second half after them."""
    S: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, BLOCK_N)
    return (_rope_first_row(g, BLOCK_N, HALF) + (j % S) + (j // S) * HALF).to(tl.int64)


@triton.jit
def _rope_step(g, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Physical rows from logical block ``g``'s first row to block ``g + 1``'s."""
    return _rope_first_row(g + 1, BLOCK_N, HALF) - _rope_first_row(g, BLOCK_N, HALF)


@triton.jit
def _rope_cache_rows(total, g0, out_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots,
                     R: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Store ``R`` logical rows' float32 sums (blocks ``g0``...) at their physical rows: rounded to the output's
    dtype, the first ``n_rot_rows`` rows (q, k) rotated as ``labkit.kernels.rope`` rotates them (float32 math on
    the rounded values, one rounding), k and v rows also written to the paged caches' row at the token's slot."""
    S: tl.constexpr = BLOCK_N // 2
    dt = out_ptr.dtype.element_ty
    y = tl.reshape(total.to(dt), [R // BLOCK_N, 2, S])
    x1, x2 = tl.split(tl.permute(y, (0, 2, 1)))  # [blocks, S]: dims d of the first half, HALF + d of the second
    g = g0 + tl.arange(0, R // BLOCK_N)[:, None]
    G: tl.constexpr = 2 * HALF // BLOCK_N
    d = (g % G) * S + tl.arange(0, S)[None, :]
    row1 = ((g // G) * (2 * HALF) + d).to(tl.int64)
    c = tl.load(cos_ptr + d).to(tl.float32)
    sn = tl.load(sin_ptr + d).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    rot = row1 < n_rot_rows
    lo = tl.where(rot, (x1f * c - x2f * sn).to(dt), x1)
    hi = tl.where(rot, (x2f * c + x1f * sn).to(dt), x2)
    tl.store(out_ptr + row1, lo)
    tl.store(out_ptr + row1 + HALF, hi)
    slot = tl.zeros_like(row1) + tl.load(slot_ptr).to(tl.int64)  # as a block: a scalar mask will not broadcast
    in_pool = (slot >= 0) & (slot < n_slots)
    base = tl.where(in_pool, slot, 0) * n_k_rows
    k_first = n_rot_rows - n_k_rows
    is_k = in_pool & (row1 >= k_first) & (row1 < n_rot_rows)
    is_v = in_pool & (row1 >= n_rot_rows)
    tl.store(kc_ptr + base + row1 - k_first, lo, mask=is_k)
    tl.store(kc_ptr + base + row1 + HALF - k_first, hi, mask=is_k)
    tl.store(vc_ptr + base + row1 - n_rot_rows, lo, mask=is_v)
    tl.store(vc_ptr + base + row1 + HALF - n_rot_rows, hi, mask=is_v)


def _check_norm(weight: torch.Tensor | None, eps: float, k: int, x: torch.Tensor,
                swiglu: bool) -> tuple[torch.Tensor, float] | None:
    if weight is None:
        return None
    if swiglu:
        raise ValueError("norm_weight and swiglu=True cannot be combined: an RMSNorm precedes the q/k/v and "
                         "gate/up projections, SwiGLU the down projection")
    check_tensor("norm_weight", weight, FLOAT_DTYPES, dim=1, device=x.device)
    if weight.shape[0] != k:
        raise ValueError(f"norm_weight {tuple(weight.shape)} must be [K] = [{k}]")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"norm_eps={eps!r} must be a non-negative float")
    return weight.contiguous(), float(eps)


def _check_residual(residual: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor | None:
    if residual is None:
        return None
    check_tensor("residual", residual, (x.dtype,), device=x.device)
    if tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"residual {tuple(residual.shape)} must be the output's shape {(*x.shape[:-1], n)}")
    return residual


def with_neighbours(x: torch.Tensor, n: int, k: int, what: str, swiglu: bool, norm_weight: torch.Tensor | None,
                    norm_eps: float, residual: torch.Tensor | None, pdl: str, plan, launch, product) -> torch.Tensor:
    """``[residual +] product(act(x))`` for a quantised projection of ``[N, K]`` weights (``what`` names them),
    ``act`` SwiGLU or an RMSNorm (``w4a16_matmul``'s arguments): inside the stationary GEMV where ``plan(rows,
    normed)`` gives a launch (``launch(rows, plan, **neighbours)``), else the separate kernels around ``product``."""
    width = 2 * k if swiglu else k
    if x.dim() == 0 or x.shape[-1] != width:
        shape = "[..., 2K] = [gate | up] with swiglu=True" if swiglu else "[..., K]"
        raise ValueError(f"x {tuple(x.shape)} must be {shape}, K={k} from {what}")
    norm = _check_norm(norm_weight, norm_eps, k, x, swiglu)
    res = _check_residual(residual, x, n)
    check_pdl(pdl)
    rows = x.reshape(-1, width)
    picked = plan(rows, norm is not None) if n else None
    if picked is not None:
        fused = dict(swiglu=swiglu or None, norm=norm, residual=None if res is None else res.reshape(1, n).contiguous(),
                     pdl=pdl or None)
        out = launch(rows.contiguous(), picked, **{key: val for key, val in fused.items() if val is not None})
        return out.view(*x.shape[:-1], n)
    if swiglu:
        from labkit.kernels.silu_and_mul import silu_and_mul

        x = silu_and_mul(x)
    if norm is not None:
        from labkit.kernels.rms_norm import rms_norm

        x = rms_norm(x, *norm)
    out = product(x)
    return out if res is None else out + res


def qkv_rope_cache(x: torch.Tensor, n: int, k: int, what: str, num_heads: int, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   norm_weight: torch.Tensor | None, norm_eps: float, pdl: str, plan, launch,
                   matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k/v projection, RoPE and the cache write of ``w4a16_qkv_rope_cache`` for weights of ``n`` rows
    (``what`` names them): in the stationary GEMV's store where ``plan(rows)`` gives a split launch that fits the
    heads (``launch(rows, plan, **neighbours)``), else ``matmul(norm_weight=, norm_eps=, pdl=)`` then
    ``apply_rope_and_cache``."""
    check_tensor("x", x, FLOAT_DTYPES, device=k_cache.device)
    check_tensor("k_cache", k_cache, FLOAT_DTYPES, dim=4)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not isinstance(num_heads, int) or num_heads < 1 or n != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"{what} must hold (num_heads={num_heads!r} + 2 * {kv_heads}) * {head_dim} rows: q, k "
                         f"and v of k_cache {tuple(k_cache.shape)}'s heads")
    rows = x.reshape(-1, k) if x.dim() and x.shape[-1] == k else None
    fused = _qkv_rope_plan(rows, plan, head_dim, (k_cache, v_cache), cos, sin, slot_mapping)
    if fused is None:
        from labkit.kernels.rope import apply_rope_and_cache

        qkv = matmul(norm_weight=norm_weight, norm_eps=norm_eps, pdl=pdl)
        q, kk, v = qkv.reshape(-1, n).split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        t = q.shape[0]
        return apply_rope_and_cache(q.view(t, num_heads, head_dim), kk.view(t, kv_heads, head_dim),
                                    v.view(t, kv_heads, head_dim), cos, sin, k_cache, v_cache, slot_mapping)
    norm = _check_norm(norm_weight, norm_eps, k, x, False)
    check_pdl(pdl)
    rope = dict(cos=cos.reshape(-1), sin=sin.reshape(-1), slot=slot_mapping.reshape(1), k_cache=k_cache,
                v_cache=v_cache, num_heads=num_heads)  # the kernel reads the tables' first head_dim / 2 values
    out = launch(rows.contiguous(), fused, rope=rope, **({"norm": norm} if norm is not None else {}),
                 **({"pdl": pdl} if pdl else {}))
    q_rows = num_heads * head_dim
    return (out[:, :q_rows].view(1, num_heads, head_dim),
            out[:, q_rows:q_rows + kv_heads * head_dim].view(1, kv_heads, head_dim))


def _qkv_rope_plan(rows: torch.Tensor | None, plan, head_dim: int, caches: tuple, cos: torch.Tensor,
                   sin: torch.Tensor, slot_mapping: torch.Tensor):
    """The split stationary launch (``plan(rows)``, as a normed GEMV takes it) for ``qkv_rope_cache``'s fused path,
    or None where it does not apply (more than one row, float32, row blocks that do not fit the heads, caches not
    of ``rows``' dtype and layout, tables or slots not of one token)."""
    if rows is None or rows.shape[0] != 1 or head_dim % 2:
        return None
    if any(c.dtype != rows.dtype or not c.is_contiguous() or c.device != rows.device or c.shape != caches[0].shape
           for c in caches):
        return None
    if any(t.numel() not in (head_dim // 2, head_dim) or t.device != rows.device for t in (cos, sin)) or \
            slot_mapping.numel() != 1 or slot_mapping.dtype.is_floating_point:
        return None
    picked = plan(rows)
    if picked is None or picked.split_p2 == 1 or picked.block_n % 2 or head_dim % picked.block_n or \
            picked.red_rows % picked.block_n:
        return None
    return picked
