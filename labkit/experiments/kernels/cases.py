"""Notebook 03's benchmark cases for the memory-bound kernels and attention: labkit's Triton kernel against torch
eager, ``torch.compile`` and SDPA on the same inputs, each timed the same way (``labkit.bench.time_fn``: CUDA-event
medians with L2 flushed, or CUDA-graph replays for launches of tens of microseconds, on both sides). Each returns
rows of ``_row``: time, bytes or FLOPs, and the kernel's error against a float64 reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.bench import Timing, time_fn
from labkit.evaluate import relative_error
from labkit.kernels.flash_attention import flash_attention
from labkit.kernels.paged_attention import paged_attention
from labkit.kernels.rms_norm import rms_norm
from labkit.kernels.rope import apply_rope
from labkit.kernels.silu_and_mul import silu_and_mul
from labkit.kernels.softmax import softmax


def _randn(*shape, dtype, device, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _row(kernel: str, impl: str, shape: tuple, dtype: torch.dtype, t: Timing, nbytes: float = 0.0,
         flops: float = 0.0, err: float | None = None) -> dict:
    return {"kernel": kernel, "impl": impl, "shape": "x".join(map(str, shape)), "dtype": str(dtype)[6:],
            "median_us": t.median_us, "p10_us": 1e6 * t.quantile_s(0.1), "p90_us": 1e6 * t.quantile_s(0.9),
            "bytes": nbytes, "flops": flops, "gb_s": nbytes / t.median_s / 1e9,
            "tflop_s": flops / t.median_s / 1e12, "method": t.method, "rel_err": err}


def _time_all(fns: dict[str, Callable], device, iters: int, cuda_graph: bool) -> dict[str, Timing]:
    """Time each implementation the same way; if one cannot be graph-captured, time them all with events."""
    warmup = 3 if device.type == "cuda" else 1  # the interpreter's first call is the slow one
    if cuda_graph and device.type == "cuda":
        try:
            return {k: time_fn(f, device, warmup=warmup, iters=iters, cuda_graph=True) for k, f in fns.items()}
        except Exception as e:  # noqa: BLE001 - any capture failure: fall back for every side alike
            print(f"CUDA-graph timing failed ({type(e).__name__}: {str(e)[:80]}); timing all with CUDA events")
            torch.cuda.synchronize()
    return {k: time_fn(f, device, warmup=warmup, iters=iters) for k, f in fns.items()}


def _maybe_compile(fn: Callable, compile_: bool, device) -> Callable | None:
    return torch.compile(fn, dynamic=False) if compile_ and device.type == "cuda" else None


# --- memory-bound kernels ------------------------------------------------------------------------------------
def _hf_rms_norm(x, w, eps=1e-5):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def bench_rmsnorm(shape, dtype, device, iters=20, compile_=False) -> list[dict]:
    rows, cols = shape
    x, w = _randn(rows, cols, dtype=dtype, device=device), _randn(cols, dtype=dtype, device=device, seed=1)
    r = _randn(rows, cols, dtype=dtype, device=device, seed=2)
    fns = {"triton": lambda: rms_norm(x, w, 1e-5), "eager": lambda: _hf_rms_norm(x, w),
           "triton_fused_residual": lambda: rms_norm(x, w, 1e-5, residual=r),
           "eager_add_then_norm": lambda: _hf_rms_norm(x + r, w)}
    compiled = _maybe_compile(_hf_rms_norm, compile_, device)
    if compiled is not None:
        fns["torch_compile"] = lambda: compiled(x, w)
    times = _time_all(fns, device, iters, cuda_graph=True)
    err = relative_error(rms_norm(x, w, 1e-5), _hf_rms_norm(x.double(), w.double()))
    b = x.element_size()
    nb = {k: (4 if "residual" in k or "add" in k else 2) * rows * cols * b + cols * b for k in fns}
    return [_row("rmsnorm", k, shape, dtype, t, nb[k], err=err if k == "triton" else None)
            for k, t in times.items()]


def bench_swiglu(shape, dtype, device, iters=20, compile_=False) -> list[dict]:
    rows, d = shape
    x = _randn(rows, 2 * d, dtype=dtype, device=device, scale=2.0)

    def eager():
        return F.silu(x[:, :d]) * x[:, d:]
    fns = {"triton": lambda: silu_and_mul(x), "eager": eager}
    compiled = _maybe_compile(eager, compile_, device)
    if compiled is not None:
        fns["torch_compile"] = compiled
    times = _time_all(fns, device, iters, cuda_graph=True)
    err = relative_error(silu_and_mul(x), F.silu(x[:, :d].double()) * x[:, d:].double())
    nb = 3 * rows * d * x.element_size()
    return [_row("swiglu", k, shape, dtype, t, nb, err=err if k == "triton" else None) for k, t in times.items()]


def bench_rope(shape, dtype, device, iters=20, compile_=False) -> list[dict]:
    tokens, hq, hk, d = shape
    q, k = _randn(tokens, hq, d, dtype=dtype, device=device), _randn(tokens, hk, d, dtype=dtype, device=device)
    ang = _randn(tokens, d // 2, dtype=torch.float32, device=device, seed=3, scale=3.0)
    cos, sin = ang.cos(), ang.sin()
    cos_full, sin_full = torch.cat([cos, cos], -1)[:, None].to(dtype), torch.cat([sin, sin], -1)[:, None].to(dtype)

    def rot(x):
        return torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)

    def eager():  # Hugging Face's apply_rotary_pos_emb
        return q * cos_full + rot(q) * sin_full, k * cos_full + rot(k) * sin_full
    fns = {"triton": lambda: apply_rope(q, k, cos, sin), "eager": eager}
    compiled = _maybe_compile(eager, compile_, device)
    if compiled is not None:
        fns["torch_compile"] = compiled
    times = _time_all(fns, device, iters, cuda_graph=True)
    err = relative_error(apply_rope(q, k, cos, sin)[0], eager()[0])
    nb = 2 * tokens * (hq + hk) * d * q.element_size() + 2 * tokens * (d // 2) * 4
    return [_row("rope", k_, shape, dtype, t, nb, err=err if k_ == "triton" else None) for k_, t in times.items()]


def bench_softmax(shape, dtype, device, iters=20, compile_=False) -> list[dict]:
    rows, cols = shape
    x = _randn(rows, cols, dtype=dtype, device=device, scale=4.0)
    fns = {"triton": lambda: softmax(x), "eager": lambda: torch.softmax(x, -1)}
    times = _time_all(fns, device, iters, cuda_graph=True)
    err = relative_error(softmax(x), torch.softmax(x.double(), -1))
    nb = 2 * rows * cols * x.element_size()
    return [_row("softmax", k, shape, dtype, t, nb, err=err if k == "triton" else None) for k, t in times.items()]


# --- attention -----------------------------------------------------------------------------------------------
def bench_flash(shape, dtype, device, iters=10, compile_=False) -> list[dict]:
    b, h, hk, s, d = shape
    q = _randn(b, h, s, d, dtype=dtype, device=device)
    k, v = (_randn(b, hk, s, d, dtype=dtype, device=device, seed=i) for i in (1, 2))
    fns = {"triton": lambda: flash_attention(q, k, v, causal=True)}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # SDPA backends that do not take GQA get K/V expanded to every query head beforehand (not timed)
        k_x, v_x = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            for kk, vv, gqa in ((k, v, True), (k_x, v_x, False)):
                def run(backend=backend, kk=kk, vv=vv, gqa=gqa):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                try:
                    run()
                    fns[name] = run
                    break
                except RuntimeError as e:
                    print(f"{name} (enable_gqa={gqa}) unavailable here: {str(e)[:100]}")
    else:
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    times = _time_all(fns, device, iters, cuda_graph=False)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    err = relative_error(flash_attention(q, k, v, causal=True), ref)
    flops = 4 * b * h * s * s * d / 2  # causal: half the square (the FlashAttention papers' convention)
    return [_row("flash", name, shape, dtype, t, flops=flops, err=err if name == "triton" else None)
            for name, t in times.items()]


def _paged_inputs(shape, dtype, device):
    seqs, h, hk, d, block, ctx = shape
    blocks_per_seq = -(-ctx // block)
    q = _randn(seqs, h, d, dtype=dtype, device=device)
    k_cache = _randn(seqs * blocks_per_seq, block, hk, d, dtype=dtype, device=device, seed=1)
    v_cache = _randn(seqs * blocks_per_seq, block, hk, d, dtype=dtype, device=device, seed=2)
    g = torch.Generator().manual_seed(3)  # physical blocks in random order: a real cache is fragmented
    tables = torch.randperm(seqs * blocks_per_seq, generator=g).view(seqs, blocks_per_seq).int().to(device)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, lens


def bench_paged(shape, dtype, device, iters=20, compile_=False) -> list[dict]:
    seqs, h, hk, d, block, ctx = shape
    q, k_cache, v_cache, tables, lens = _paged_inputs(shape, dtype, device)
    # the same K/V contiguous per sequence, for SDPA's decode over a contiguous cache
    k_c = k_cache[tables.long()].reshape(seqs, -1, hk, d)[:, :ctx].transpose(1, 2).contiguous()
    v_c = v_cache[tables.long()].reshape(seqs, -1, hk, d)[:, :ctx].transpose(1, 2).contiguous()
    fns = {"triton": lambda: paged_attention(q, k_cache, v_cache, tables, lens),
           "triton_no_split": lambda: paged_attention(q, k_cache, v_cache, tables, lens, num_splits=1),
           "sdpa_contiguous": lambda: F.scaled_dot_product_attention(q[:, :, None], k_c, v_c, enable_gqa=True)}
    times = _time_all(fns, device, iters, cuda_graph=True)
    ref = F.scaled_dot_product_attention(q[:, :, None].float(), k_c.float(), v_c.float(), enable_gqa=True)
    err = relative_error(paged_attention(q, k_cache, v_cache, tables, lens), ref[:, :, 0])
    nb = 2 * seqs * ctx * hk * d * q.element_size() + 2 * q.numel() * q.element_size() + tables.numel() * 4
    return [_row("paged", k, shape, dtype, t, nb, err=err if k == "triton" else None) for k, t in times.items()]
