"""FlashAttention forward (Dao et al. 2022, FlashAttention-2 loop order) with grouped-query attention.

Each program owns ``BLOCK_M`` query rows of one head and walks the key/value tiles of its KV head, keeping
a running row maximum ``m``, a running denominator ``l`` and an un-normalised output ``acc`` (online
softmax), so the ``S x T`` score matrix never reaches memory: HBM traffic is one read of q, k, v per query
tile and one write of the output, and both matmuls (``q k^T`` and ``p v``) run on Tensor Cores (``tl.dot``).

Causal attention is aligned bottom-right (as in FlashAttention-2): with ``S`` queries and ``T >= S`` keys,
query ``i`` sits at position ``T - S + i`` and sees keys ``0 ... T - S + i``. For ``S == T`` that is the usual
lower triangle; for one decode query it is every key. Tiles fully below the diagonal are processed without a
mask, the diagonal band with one, tiles above it are skipped (half the FLOPs of the full square).

An optional boolean ``attn_mask`` (``True`` = attend, broadcastable to ``[B, H, S, T]``, as Hugging Face's
``sdpa_mask`` builds it for padded or static-cache batches) is applied tile by tile; a query row that may
attend to nothing gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_tensor, next_pow2, refuse_bf16_dot_on_cpu

LOG2E = 1.4426950408889634


def flash_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference in float32 (float64 if the inputs are): shapes and semantics as ``flash_attention``."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, s, d = q.shape
    t = k.shape[2]
    group = h // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    kf = k.to(dt).repeat_interleave(group, dim=1)
    vf = v.to(dt).repeat_interleave(group, dim=1)
    scores = torch.einsum("bhsd,bhtd->bhst", q.to(dt), kf) * scale
    allowed = torch.ones(s, t, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
    allowed = allowed.expand(b, h, s, t)
    if attn_mask is not None:
        allowed = allowed & attn_mask.expand(b, h, s, t)
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that may attend to nothing give zeros
    return torch.einsum("bhst,bhtd->bhsd", p, vf).to(q.dtype)


@triton.jit
def _attn_tiles(acc, l_i, m_i, q, k_base, v_base, mask_rows, stride_kn, stride_vn, stride_mn,
                q_pos, row_ok, offs_d, lo, hi, kv_len, diag, qk_scale,
                CAUSAL_MASK: tl.constexpr, BOUNDARY: tl.constexpr, HAS_MASK: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key tiles ``[lo, hi)`` into the running (acc, l, m) of one query tile. ``q_pos`` holds each
    row's query index (for the causal mask), ``mask_rows`` each row's pointer into the boolean mask."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if BOUNDARY:
            kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None],
                         mask=d_ok[:, None] & (cols[None, :] < kv_len), other=0.0)
        else:
            kt = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if CAUSAL_MASK:
            qk = tl.where(q_pos[:, None] + diag >= cols[None, :], qk, -float("inf"))
        if BOUNDARY:
            qk = tl.where(cols[None, :] < kv_len, qk, -float("inf"))
        if HAS_MASK:
            allowed = tl.load(mask_rows[:, None] + cols[None, :] * stride_mn,
                              mask=row_ok[:, None] & (cols[None, :] < kv_len), other=0)
            qk = tl.where(allowed != 0, qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if HAS_MASK:
            m_new = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing allowed yet stays at 0
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if BOUNDARY:
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                        mask=(cols[:, None] < kv_len) & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd(q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, qk_scale, q_len, kv_len, n_heads, group,
               stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
               stride_mb, stride_mh, stride_mm, stride_mn,
               S_BUCKET, T_BUCKET, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, PACK_GQA: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
    # longest causal tiles first: the last query tiles have the most keys, so they should not start last
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        # decode / short queries: one program per KV head, its query heads stacked as rows (row = s * group
        # + head-in-group), so each K/V tile is loaded once for the whole group and the tile is not mostly
        # padding
        b = tl.program_id(1) // (n_heads // group)
        kvh = tl.program_id(1) % (n_heads // group)
        q_pos = rows // group
        head = kvh * group + rows % group
        q_lo, q_hi = (pid_m * BLOCK_M) // group, (pid_m * BLOCK_M + BLOCK_M - 1) // group
    else:
        b = tl.program_id(1) // n_heads
        h = tl.program_id(1) % n_heads
        kvh = h // group
        q_pos = rows
        head = h + 0 * rows
        q_lo, q_hi = pid_m * BLOCK_M, pid_m * BLOCK_M + BLOCK_M - 1
    b, kvh, head = b.to(tl.int64), kvh.to(tl.int64), head.to(tl.int64)
    row_ok = q_pos < q_len
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + q_pos[:, None] * stride_qm
                + offs_d[None, :], mask=q_ok, other=0.0)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    mask_rows = mask_ptr + b * stride_mb + head * stride_mh + q_pos * stride_mm
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = kv_len - q_len  # causal: query i sees keys <= i + diag
    if CAUSAL:
        # key tiles visible to every row of this query tile need no mask; the band up to the last row's
        # diagonal does; tiles past it are skipped
        full_hi = tl.maximum((q_lo + diag + 1) // BLOCK_N * BLOCK_N, 0)
        band_hi = tl.minimum(q_hi + 1 + diag, kv_len)
    else:
        full_hi = kv_len // BLOCK_N * BLOCK_N
        band_hi = kv_len
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_base, v_base, mask_rows, stride_kn, stride_vn, stride_mn,
                                q_pos, row_ok, offs_d, 0, full_hi, kv_len, diag, qk_scale,
                                False, False, HAS_MASK, HEAD_DIM, BLOCK_N, PRECISION)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_base, v_base, mask_rows, stride_kn, stride_vn, stride_mn,
                                q_pos, row_ok, offs_d, full_hi, band_hi, kv_len, diag, qk_scale,
                                CAUSAL, True, HAS_MASK, HEAD_DIM, BLOCK_N, PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that attended to nothing has acc == 0: output zeros
    out = acc / l_safe[:, None]
    tl.store(o_ptr + b * stride_ob + head[:, None] * stride_oh + q_pos[:, None] * stride_om + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_ok)


def _configs() -> list:
    # Hopper: 128-row query tiles with 8 warps keep two warpgroups busy on wgmma; 64-key tiles and 3-4 stages
    # fit the shared memory of d=128 in bf16. Small tiles stay in the list for short sequences and decode.
    # (a short list: every config is compiled once when a new size is first seen)
    cfgs = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (16, 128, 4, 3), (16, 64, 4, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in cfgs]


def _prune(configs, named_args, **kwargs):
    """Drop query tiles much taller than the query (decode, short prompts): they are all padding."""
    s = named_args["S_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, s)]
    return kept or configs


_flash_fwd_tuned = triton.autotune(
    configs=_configs(), key=["S_BUCKET", "T_BUCKET", "HEAD_DIM", "CAUSAL", "HAS_MASK", "PACK_GQA"],
    prune_configs_by={"early_config_prune": _prune})(_flash_fwd)

CPU_BLOCK_M, CPU_BLOCK_N = 32, 32  # the interpreter: no autotuning, small tiles
PACK_GQA_MAX_ROWS = 128  # stack a KV head's query heads into one tile when S * group fits in this many rows


def _check_mask(attn_mask: torch.Tensor, b: int, h: int, s: int, t: int,
                device: torch.device) -> torch.Tensor:
    check_tensor("attn_mask", attn_mask, (torch.bool,), dim=4, device=device)
    names = ("batch", "heads", "queries", "keys")
    for size, full, what in zip(attn_mask.shape, (b, h, s, t), names, strict=True):
        if size not in (1, full):
            raise ValueError(f"attn_mask {tuple(attn_mask.shape)} must broadcast to [B, H, S, T] = "
                             f"[{b}, {h}, {s}, {t}]: its {what} dim is {size}, allowed 1 or {full}")
    # stride 0 on broadcast dims (no copy); read as bytes: Triton loads uint8 everywhere, i1 pointers vary
    return attn_mask.expand(b, h, s, t).view(torch.uint8)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention ``softmax(q k^T * scale) v`` without materialising the scores.

    ``q``: ``[B, H, S, D]``; ``k``, ``v``: ``[B, H_kv, T, D]`` with ``H % H_kv == 0`` (grouped-query
    attention; query head ``h`` reads KV head ``h // (H / H_kv)``). Last dim contiguous; other strides free
    (Hugging Face's transposed views are read in place). dtypes: float16, bfloat16 (CUDA only), float32
    (exact fp32 dots). ``causal``: bottom-right aligned (needs ``S <= T``). ``scale`` defaults to
    ``D ** -0.5``. ``attn_mask``: bool, broadcastable to ``[B, H, S, T]``, ``True`` = may attend.
    Returns ``[B, H, S, D]`` in ``q``'s dtype, a view of a contiguous ``[B, S, H, D]`` buffer (the layout
    the output projection wants).
    """
    check_tensor("q", q, FLOAT_DTYPES, dim=4)
    check_tensor("k", k, (q.dtype,), dim=4, device=q.device)
    check_tensor("v", v, (q.dtype,), dim=4, device=q.device)
    refuse_bf16_dot_on_cpu("q", q)
    b, h, s, d = q.shape
    t = k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B, H_kv, T, D] with "
                         f"B={b} and D={d} from q {tuple(q.shape)}")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"q's {h} heads must be a multiple of k's {k.shape[1]} heads")
    if d > 256 or d < 8:
        raise ValueError(f"head_dim={d} is outside what this kernel tiles; allowed 8 ... 256")
    if causal and s > t:
        raise ValueError(f"causal=True needs at least as many keys as queries (bottom-right alignment); "
                         f"got S={s}, T={t}")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    scale = d ** -0.5 if scale is None else float(scale)
    out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
    if attn_mask is not None:
        mask = _check_mask(attn_mask, b, h, s, t, q.device)
        ms = mask.stride()
    else:
        mask, ms = out, (0, 0, 0, 0)  # never read: HAS_MASK=False
    if out.numel() == 0:
        return out.transpose(1, 2)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; 16-bit dots ignore it
    args = (q, k, v, out, mask, scale * LOG2E, s, t, h, h // k.shape[1])
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], out.stride(0), out.stride(2), out.stride(1),
               *ms)
    group = h // k.shape[1]
    pack = group > 1 and s * group <= PACK_GQA_MAX_ROWS
    rows, programs = (s * group, b * k.shape[1]) if pack else (s, b * h)
    meta = dict(CAUSAL=bool(causal), HAS_MASK=attn_mask is not None, PACK_GQA=pack, HEAD_DIM=d,
                BLOCK_D=max(16, next_pow2(d)), PRECISION=precision)
    buckets = (next_pow2(rows), next_pow2(t))  # autotune once per power-of-two size, not per decode step
    if q.device.type == "cuda":
        grid = lambda META: (triton.cdiv(rows, META["BLOCK_M"]), programs)  # noqa: E731
        _flash_fwd_tuned[grid](*args, *strides, *buckets, **meta)
    else:
        grid = (triton.cdiv(rows, CPU_BLOCK_M), programs)
        _flash_fwd[grid](*args, *strides, *buckets, BLOCK_M=CPU_BLOCK_M, BLOCK_N=CPU_BLOCK_N, **meta)
    return out.transpose(1, 2)
