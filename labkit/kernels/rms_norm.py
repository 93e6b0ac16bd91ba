"""RMSNorm, optionally fused with the residual add that precedes it in a Llama decoder layer.

    out = weight * (x / sqrt(mean(x^2) + eps))                          (plain)
    residual_out = x + residual;  out = rms_norm(residual_out)           (fused, ``residual`` given)

Memory-bound: the plain kernel reads ``x`` once and writes ``out`` once (``2 * rows * cols * bytes``);
eager torch makes about five passes (cast, square, mean, multiply, multiply by the weight). The fused form
replaces the separate add (read 2, write 1) and norm (read 1, write 1) with one pass (read 2, write 2).

One pass, ``ROWS`` whole rows per program held in registers (16-byte loads and stores along the row, ``x`` loaded
evict-first). Each program pays a fixed cost -- launch, a block-wide reduction with its barrier, and the weight,
re-read from L2 -- so two or four rows per program halve or quarter it per byte, the weight loaded once for all of
them (first, so it is in flight with ``x``). ``out`` may be stored with streaming stores (``STORE_CACHE=".cs"``:
this kernel never reads it back). On CUDA, from ``TUNE_MIN_ROWS`` rows up, rows per program (1, 2, 4, 8), warps
(4-32) and the store policy are autotuned per (hidden size, dtypes, residual, power-of-two row count), each
candidate timed as CUDA-graph replays (``graph_bench``), on the first call -- a warm-up, outside any CUDA-graph
capture. What each choice measured: research/README.md (``rmsnorm_study.py``) and notebook 03's record.
Fewer rows (decode batches) take one row per program with the warps set by the row length
and never autotune, so capturing a decode step needs no warm-up for this kernel.

Rounding follows Hugging Face's ``LlamaRMSNorm`` exactly: statistics in float32, the normalised value cast to
the input dtype before it is multiplied by the weight, and the residual sum rounded to the input dtype before
it is normalised (as ``residual + hidden_states`` is in the model).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import FLOAT_DTYPES, check_same_shape, check_tensor, graph_bench, next_pow2, rows_view

MAX_COLS = 65536  # whole rows held in registers in one pass
TUNE_MIN_ROWS = 1024  # CUDA calls with at least this many rows autotune rows-per-program and warps


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 residual: torch.Tensor | None = None):
    """Torch reference (Hugging Face's ``LlamaRMSNorm``); with ``residual``: ``(out, x + residual)``."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return (out, x) if residual is not None else out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_cols, stride_x, stride_res,
                     stride_out, stride_res_out, eps, ROWS_KEY, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, STORE_CACHE: tl.constexpr = ""):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # first: in flight with x; once per ROWS
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first")
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the model rounds the sum to its dtype
        tl.store(res_out_ptr + r64 * stride_res_out + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]  # cast before the weight, as HF does
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask,
             cache_modifier=STORE_CACHE)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 8192 else 16


def _prune(configs, named_args, **kwargs):
    """Keep 8 to 64 elements per thread (one 16-byte load at least, no more than registers hold); short rows
    keep the configs with the most elements per thread."""
    block = kwargs["BLOCK"]

    def per_thread(c):
        return c.kwargs["ROWS"] * block // (32 * c.num_warps)
    fits = [c for c in configs if per_thread(c) <= 64]
    kept = [c for c in fits if per_thread(c) >= 8]
    if not kept and fits:
        most = max(per_thread(c) for c in fits)
        kept = [c for c in fits if per_thread(c) == most]
    return kept or [triton.Config({"ROWS": 1}, num_warps=_num_warps(block))]


_CONFIGS = [triton.Config({"ROWS": r}, num_warps=w)
            for r, w in ((1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16), (8, 16), (4, 32))]
# streaming stores (st.global.cs) for the best plain configs, faster plain and slower fused
# (research/records/h200/rmsnorm_study_ded9987.json), so the autotuner, keyed on the residual, has both
_CONFIGS += [triton.Config({"ROWS": r, "STORE_CACHE": ".cs"}, num_warps=w) for r, w in ((1, 8), (4, 16), (4, 32))]


def _grid(n_rows: int):
    """One program per ``ROWS`` rows of a config."""
    return lambda c: (triton.cdiv(n_rows, c["ROWS"]),)


_rms_norm_tuned = triton.autotune(_CONFIGS, key=["n_cols", "ROWS_KEY", "HAS_RESIDUAL"], do_bench=graph_bench,
                                  prune_configs_by={"early_config_prune": _prune})(_rms_norm_kernel)


def _launch(x2, r2, w, out, res_out, eps, has_residual: bool, rows_per_program: int | None) -> None:
    n_rows, n_cols = x2.shape
    if not n_rows:
        return
    block = next_pow2(n_cols)
    args = (x2, r2, w, out, res_out, n_rows, n_cols, x2.stride(0), r2.stride(0) if has_residual else 0,
            out.stride(0), res_out.stride(0) if has_residual else 0, eps, min(next_pow2(n_rows), 1 << 20))
    if rows_per_program is None and x2.device.type == "cuda" and n_rows >= TUNE_MIN_ROWS:
        _rms_norm_tuned[_grid(n_rows)](*args, HAS_RESIDUAL=has_residual, BLOCK=block)
        return
    rows = rows_per_program or 1
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](*args, HAS_RESIDUAL=has_residual, BLOCK=block, ROWS=rows,
                                                   num_warps=_num_warps(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
             rows_per_program: int | None = None):
    """RMSNorm over the last dimension of ``x`` ``[..., hidden]`` with ``weight`` ``[hidden]``.

    Without ``residual`` returns ``out`` (shape and dtype of ``x``). With ``residual`` (same shape and dtype
    as ``x``) returns ``(out, residual_out)`` where ``residual_out = x + residual`` and
    ``out = rms_norm(residual_out)``.
    dtypes: float32, float16, bfloat16; the weight may be any of them (the output takes ``x``'s dtype).
    ``rows_per_program`` (a power of two): the one-pass kernel with that many rows a program, warps by the row
    length; None: one row a program, or on CUDA from ``TUNE_MIN_ROWS`` rows up the autotuner's pick.
    """
    if rows_per_program is not None and (not isinstance(rows_per_program, int) or rows_per_program < 1
                                         or rows_per_program & (rows_per_program - 1)):
        raise ValueError(f"rows_per_program={rows_per_program!r} must be a power of two or None")
    check_tensor("x", x, FLOAT_DTYPES)
    check_tensor("weight", weight, FLOAT_DTYPES, dim=1, device=x.device)
    if x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [hidden] with hidden = x.shape[-1] of x "
                         f"{tuple(x.shape)}")
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"hidden size {x.shape[-1]} is larger than this one-pass kernel holds; "
                         f"allowed <= {MAX_COLS}")
    if not eps > 0:
        raise ValueError(f"eps={eps} must be > 0")
    if residual is not None:
        check_tensor("residual", residual, (x.dtype,), device=x.device)
        check_same_shape("x", x, "residual", residual)
    x2 = rows_view(x, "x")
    out = torch.empty_like(x2)
    w = weight.contiguous()
    if residual is None:
        _launch(x2, x2, w, out, out, eps, False, rows_per_program)
        return out.view(x.shape)
    r2 = rows_view(residual, "residual")
    res_out = torch.empty_like(x2)
    _launch(x2, r2, w, out, res_out, eps, True, rows_per_program)
    return out.view(x.shape), res_out.view(x.shape)
