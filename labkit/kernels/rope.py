"""Rotary position embedding (RoPE) applied to q and k in one pass, Llama/GPT-NeoX style (``rotate_half``).

For each head vector ``x = [x1, x2]`` (two halves of ``head_dim / 2``) and the angle table of its token:

    out = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]

Memory-bound: q and k are read once and written once; ``cos``/``sin`` (one row per token, shared by all
heads) are read once per token. Eager torch (``q * cos + rotate_half(q) * sin``) makes about five passes
over q and k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor, next_pow2


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Torch reference in float32 (shapes as ``apply_rope``); ``(q_out, k_out)`` in the inputs' dtypes."""
    half = q.shape[-1] // 2
    c, s = cos[..., :half].float().unsqueeze(-2), sin[..., :half].float().unsqueeze(-2)  # [..., 1, half]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, tok, stride_xt, stride_xh, stride_ot, stride_oh, n_heads, c, s,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, copy_ptr=None, stride_ch=0,
                  copy_heads=0):
    """Rotate one token's heads into ``out_ptr``; with ``copy_ptr`` (a row of heads, ``stride_ch`` apart) also
    store the first ``copy_heads`` rotated heads there (the paged-cache row of k: rotated once, written twice;
    0 heads skips the copy)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < HALF)
    src = x_ptr + tok * stride_xt + h * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    lo, hi = (x1f * c - x2f * s).to(x1.dtype), (x2f * c + x1f * s).to(x1.dtype)
    dst = out_ptr + tok * stride_ot + h * stride_oh + d
    tl.store(dst, lo, mask=mask)
    tl.store(dst + HALF, hi, mask=mask)
    if copy_ptr is not None:
        dst = copy_ptr + h * stride_ch + d
        copy_mask = (h < copy_heads) & (d < HALF)
        tl.store(dst, lo, mask=copy_mask)
        tl.store(dst + HALF, hi, mask=copy_mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, n_q_heads, n_k_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_ct, stride_st, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + tok * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_st + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, tok, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, c, s,
                  HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, tok, stride_kt, stride_kh, stride_kot, stride_koh, n_k_heads, c, s,
                  HALF, BLOCK_HK, BLOCK_D)


def _tokens_view(x: torch.Tensor, name: str, inplace: bool) -> torch.Tensor:
    """``x`` ``[..., heads, head_dim]`` as ``[tokens, heads, head_dim]`` (last dim contiguous)."""
    if x.stride(-1) == 1:
        try:
            return x.view(-1, x.shape[-2], x.shape[-1])
        except RuntimeError:
            pass
    if inplace:
        raise ValueError(f"{name} {tuple(x.shape)} with strides {x.stride()} cannot be viewed as [tokens, "
                         "heads, head_dim] with a contiguous last dim; use inplace=False or make it "
                         "contiguous")
    return x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()


def _table_view(t: torch.Tensor, name: str, lead: torch.Size, half: int) -> torch.Tensor:
    if tuple(t.shape[:-1]) != tuple(lead) or t.shape[-1] not in (half, 2 * half):
        raise ValueError(f"{name} {tuple(t.shape)} must be [{', '.join(map(str, lead))}, "
                         f"head_dim // 2 = {half}] (or [..., head_dim] with equal halves, as in HF)")
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False):
    """Rotate ``q`` ``[..., num_heads, head_dim]`` and ``k`` ``[..., num_kv_heads, head_dim]`` by RoPE.

    ``cos``, ``sin``: ``[..., head_dim // 2]`` with the same leading dims (one row per token; Hugging Face's
    ``[..., head_dim]`` tables, whose two halves are equal, are accepted and their first half used). Angles
    may be float32 or the inputs' dtype; the arithmetic is float32. Returns ``(q_out, k_out)``: new tensors,
    or ``q`` and ``k`` themselves when ``inplace``. q and k: float32, float16 or bfloat16, one dtype.
    """
    check_tensor("q", q, FLOAT_DTYPES)
    check_tensor("k", k, (q.dtype,), device=q.device)
    check_tensor("cos", cos, FLOAT_DTYPES, device=q.device)
    check_tensor("sin", sin, FLOAT_DTYPES, device=q.device)
    if q.dim() < 2 or k.dim() != q.dim() or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [..., heads, head_dim] with the "
                         "same leading dims and head_dim")
    if q.shape[-1] % 2:
        raise ValueError(f"head_dim={q.shape[-1]} must be even")
    half = q.shape[-1] // 2
    c, s = _table_view(cos, "cos", q.shape[:-2], half), _table_view(sin, "sin", q.shape[:-2], half)
    q3, k3 = _tokens_view(q, "q", inplace), _tokens_view(k, "k", inplace)
    q_out = q3 if inplace else torch.empty_like(q3)
    k_out = k3 if inplace else torch.empty_like(k3)
    n_tok = q3.shape[0]
    if n_tok and half:
        bhq, bhk = next_pow2(q3.shape[1]), next_pow2(k3.shape[1])
        _rope_kernel[(n_tok,)](q3, k3, c, s, q_out, k_out, q3.shape[1], k3.shape[1],
                               q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
                               q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                               c.stride(0), s.stride(0), HALF=half, BLOCK_HQ=bhq, BLOCK_HK=bhk,
                               BLOCK_D=next_pow2(half), num_warps=4 if (bhq + bhk) * half <= 2048 else 8)
    if inplace:
        return q, k
    return q_out.view(q.shape), k_out.view(k.shape)


# --- RoPE fused with the paged KV-cache write (the serving engine's per-layer step) ----------------------------
@triton.jit
def _copy_heads(src, dst, n_heads, stride_sh, stride_dh, D: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_FULL: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_FULL)[None, :]
    mask = (h < n_heads) & (d < D)
    tl.store(dst + h * stride_dh + d, tl.load(src + h * stride_sh + d, mask=mask), mask=mask)


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_out_ptr, kc_ptr, vc_ptr,
                       n_q_heads, n_k_heads, n_slots, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_ct, stride_st, stride_cs, stride_ch, HALF: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_FULL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    in_pool = (slot >= 0) & (slot < n_slots)  # a slot outside the pools (-1: padding, as in vLLM) is not written
    row = tl.where(in_pool, slot, 0) * stride_cs
    cached_heads = tl.where(in_pool, n_k_heads, 0)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(cos_ptr + tok * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_st + d, mask=d < HALF, other=0.0).to(tl.float32)
    D: tl.constexpr = 2 * HALF
    _rotate_heads(q_ptr, q_out_ptr, tok, stride_qt, stride_qh, n_q_heads * D, D, n_q_heads, c, s, HALF, BLOCK_HQ,
                  BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, tok, stride_kt, stride_kh, n_k_heads * D, D, n_k_heads, c, s, HALF, BLOCK_HK,
                  BLOCK_D, kc_ptr + row, stride_ch, cached_heads)
    _copy_heads(v_ptr + tok * stride_vt, vc_ptr + row, cached_heads, stride_vh, stride_ch, D, BLOCK_HK, BLOCK_FULL)


def apply_rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """RoPE on ``q`` and ``k`` and the paged-cache write of the rotated ``k`` and of ``v``, in one launch.

    ``q`` ``[T, num_heads, D]``, ``k``/``v`` ``[T, num_kv_heads, D]`` (last dim contiguous), ``cos``/``sin``
    ``[T, D // 2]`` or ``[T, D]`` (as ``apply_rope``), ``k_cache``/``v_cache`` contiguous ``[num_blocks,
    block_size, num_kv_heads, D]`` in the dtype of ``k`` (unquantised caches), ``slot_mapping`` int ``[T]``
    (slot = block * block_size + offset; a slot outside the pools, such as -1, is skipped). Returns ``(q_rot,
    k_rot)``, new ``[T, heads, D]`` tensors; the caches hold ``k_rot`` and ``v`` at the slots. Replaces
    ``apply_rope`` then ``PagedKVCache.write`` (three or more launches per layer) in the engine's step.
    """
    check_tensor("q", q, FLOAT_DTYPES)
    check_tensor("k", k, (q.dtype,), device=q.device)
    check_tensor("v", v, (q.dtype,), device=q.device)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, (k.dtype,), dim=4, device=q.device)
        if not c.is_contiguous() or tuple(c.shape[2:]) != tuple(k.shape[1:]):
            raise ValueError(f"{name} {tuple(c.shape)} must be contiguous [num_blocks, block_size, "
                             f"{k.shape[1]}, {k.shape[2]}]")
    if q.dim() != 3 or k.dim() != 3 or tuple(v.shape) != tuple(k.shape) or q.shape[0] != k.shape[0] or \
            q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, heads, D] with "
                         "k and v of one shape")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != q.shape[0] or slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} must be int [T={q.shape[0]}]")
    check_tensor("slot_mapping", slot_mapping, device=q.device)
    half = q.shape[-1] // 2
    c, s = _table_view(cos, "cos", q.shape[:1], half), _table_view(sin, "sin", q.shape[:1], half)
    q3, k3, v3 = (_tokens_view(x, n, False) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    q_out, k_out = torch.empty_like(q3), torch.empty_like(k3)
    if q3.shape[0]:
        bhq, bhk = next_pow2(q3.shape[1]), next_pow2(k3.shape[1])
        _rope_cache_kernel[(q3.shape[0],)](
            q3, k3, v3, c, s, slot_mapping, q_out, k_out, k_cache, v_cache, q3.shape[1], k3.shape[1],
            k_cache.shape[0] * k_cache.shape[1], q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
            v3.stride(0), v3.stride(1),
            c.stride(0), s.stride(0), k_cache.stride(1), k_cache.stride(2), HALF=half, BLOCK_HQ=bhq,
            BLOCK_HK=bhk, BLOCK_D=next_pow2(half), BLOCK_FULL=next_pow2(2 * half),
            num_warps=4 if (bhq + 2 * bhk) * half <= 2048 else 8)
    return q_out, k_out
