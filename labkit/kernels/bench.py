"""Benchmarks of labkit's Triton kernels against torch eager, ``torch.compile``, SDPA and bitsandbytes.

Each case times every implementation on the same inputs, the same way (``labkit.bench.time_fn``: CUDA-event
medians with L2 flushed, or CUDA-graph replays for launches of tens of microseconds, on both sides; the GEMVs
cycle through several weight sets so that no implementation is timed out of the L2 cache), and
reports achieved bandwidth (memory-bound kernels) or FLOP/s (attention) as a fraction of the ceilings
measured on the same device. ``headline_figures`` turns the rows at the issue's sizes into the
``kernels.*`` figures. ``python -m labkit bench kernels`` runs ``main``; on the CPU the kernels run through
Triton's interpreter, so the numbers there time Python, not the kernels -- the sweep still checks every path.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from labkit.bench import Timing, time_fn, write_record
from labkit.evaluate import relative_error
from labkit.kernels.flash_attention import flash_attention
from labkit.kernels.paged_attention import paged_attention
from labkit.kernels.quantized_matmul import w4a16_matmul, w4a16_matmul_ref, w8a16_matmul, w8a16_matmul_ref
from labkit.kernels.rms_norm import rms_norm
from labkit.kernels.rope import apply_rope
from labkit.kernels.silu_and_mul import silu_and_mul
from labkit.kernels.softmax import softmax
from labkit.kernels.stream_read import READ_TILES, stream_read, stream_read_ref

KERNELS = ("rmsnorm", "swiglu", "rope", "softmax", "flash", "paged", "gemv")
# (shape tuples per kernel): rmsnorm/softmax (rows, cols); swiglu (rows, d); rope (tokens, heads, kv_heads,
# head_dim); flash (batch, heads, kv_heads, seq, head_dim); paged (seqs, heads, kv_heads, head_dim, block,
# context); gemv (rows, in K, out N). The first gpu entry of each is the headline size.
SIZES = {
    "ci": dict(rmsnorm=[(37, 256)], swiglu=[(37, 192)], rope=[(29, 4, 2, 64)], softmax=[(37, 300)],
               flash=[(1, 4, 2, 64, 64)], paged=[(3, 4, 2, 64, 16, 100)], gemv=[(1, 256, 384)]),
    "cpu": dict(rmsnorm=[(256, 1024), (1024, 1024)], swiglu=[(256, 1024)], rope=[(256, 8, 2, 64)],
                softmax=[(256, 1024), (64, 10000)], flash=[(1, 4, 2, 256, 64)], paged=[(4, 8, 2, 64, 16, 512)],
                gemv=[(1, 1024, 2048), (8, 1024, 2048)]),
    "gpu": dict(rmsnorm=[(16384, 4096), (4096, 4096), (1024, 4096), (16384, 8192)],
                swiglu=[(4096, 14336), (1024, 14336), (16384, 14336)],
                rope=[(16384, 32, 8, 128), (4096, 32, 8, 128), (1024, 32, 8, 128)],
                softmax=[(4096, 4096), (4096, 16384), (1024, 65536)],
                flash=[(4, 32, 8, 4096, 128), (4, 32, 8, 1024, 128), (4, 32, 8, 2048, 128)],
                paged=[(32, 32, 8, 128, 16, 4096), (32, 32, 8, 128, 16, 1024), (1, 32, 8, 128, 16, 32768)],
                gemv=[(1, 4096, 14336), (1, 14336, 4096), (1, 4096, 4096), (16, 4096, 14336)]),
}
BARS = {"kernels.rmsnorm_bw_frac": ">= 0.90", "kernels.rmsnorm_speedup_vs_eager": ">= 5",
        "kernels.swiglu_bw_frac": ">= 0.85", "kernels.rope_bw_frac": ">= 0.80",
        "kernels.flash_attn_vs_sdpa": ">= 0.80", "kernels.paged_attn_bw_frac": ">= 0.75",
        "kernels.w8_gemv_speedup_vs_bf16": ">= 1.7", "kernels.w4_gemv_speedup_vs_bf16": ">= 2.5",
        "kernels.w8_vs_bnb_int8": ">= 3", "kernels.w4_vs_bnb_nf4": ">= 3",
        # no bar: the most the bitsandbytes ratios can reach, labkit's GEMV reading its bytes at copy bandwidth
        "kernels.w8_vs_bnb_int8_at_copy_bw": None, "kernels.w4_vs_bnb_nf4_at_copy_bw": None,
        # no bar: the same at the datasheet's peak bandwidth, a bound no kernel on the part can pass
        "kernels.w8_vs_bnb_int8_at_datasheet_bw": None, "kernels.w4_vs_bnb_nf4_at_datasheet_bw": None,
        # no bar: the stationary int8 GEMV (the engine's fused int8 layers) against bf16, beside the split-K one
        "kernels.w8_stationary_gemv_speedup_vs_bf16": None,
        # no bar: against a kernel that only reads the same bytes (stream_read: launch, latency and tail
        # included), the int4 GEMV's time as a fraction, and the bitsandbytes ratios a GEMV that fast would reach
        "kernels.w4_gemv_frac_of_read_floor": None, "kernels.w8_vs_bnb_int8_at_read_floor": None,
        "kernels.w4_vs_bnb_nf4_at_read_floor": None}


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


# --- weight-only quantised GEMV ------------------------------------------------------------------------------
def _bnb_linears(w: torch.Tensor):
    """bitsandbytes LLM.int8 and NF4 layers holding ``w`` (CUDA only), or {} when bitsandbytes is missing."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        print(f"bitsandbytes not importable ({e}); its rows are skipped")
        return {}
    n, k = w.shape
    l8 = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=0.0)
    l8.weight = bnb.nn.Int8Params(w.detach().cpu().half(), requires_grad=False, has_fp16_weights=False)
    l4 = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=w.dtype, quant_type="nf4")
    l4.weight = bnb.nn.Params4bit(w.detach().cpu(), requires_grad=False, quant_type="nf4")
    return {"bnb_int8": l8.to(w.device), "bnb_nf4": l4.to(w.device)}


def _gemv_weights(n: int, k: int, dtype, device, seed: int, group_size: int) -> dict:
    """One random ``[n, k]`` weight and its int8 (per-channel) and int4 (group-wise) quantisations."""
    from labkit.quant.packing import pack_int4

    w = _randn(n, k, dtype=dtype, device=device, seed=seed, scale=0.02)
    scale = (w.float().abs().amax(1) / 127).to(dtype)
    q8 = (w.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    wg = w.float().view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s4 = ((hi - lo) / 15).clamp(min=1e-8)
    z4 = -lo / s4
    q4 = (wg / s4[..., None] + z4[..., None]).round().clamp(0, 15).view(n, k)
    w8_words, w4_words = (math.ceil(b / 4) for b in _quantised_bytes(n, k, group_size, w.element_size()))
    return {"w": w, "q8": q8, "scale": scale, "packed": pack_int4(q4.to(torch.uint8)), "s4": s4.to(dtype),
            "z4": z4.to(dtype),  # and as many bytes as each format's weights, for a kernel that only reads
            "w8_words": torch.randint(-2**31, 2**31 - 1, (w8_words,), dtype=torch.int32, device=device),
            "w4_words": torch.randint(-2**31, 2**31 - 1, (w4_words,), dtype=torch.int32, device=device)}


def _quantised_bytes(n: int, k: int, group_size: int, itemsize: int = 2) -> tuple[int, int]:
    """Bytes of ``[n, k]`` weights in int8 (per-row scales) and int4 (group-wise scales and zeros)."""
    return n * k + itemsize * n, n * k // 2 + 2 * itemsize * n * k // group_size


def _weight_sets(n: int, k: int, dtype, device, group_size: int) -> list[dict]:
    """Enough independent weight sets that cycling through them reads 4x the L2 before any repeats (the int4
    weights of 4096 x 14336, 31 MB, would otherwise sit in the H200's 50 MB L2 between graph replays and time
    the cache, not HBM); one on the CPU."""
    copies = 1
    if device.type == "cuda":
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        copies = max(1, min(16, math.ceil(4 * l2 / (n * k // 2))))
    return [_gemv_weights(n, k, dtype, device, 1 + i, group_size) for i in range(copies)]


def _cycling(fn: Callable, sets: list) -> Callable[[], object]:
    """``fn(set)`` over ``sets`` in turn, one per call (a captured graph keeps each call's set)."""
    turn = itertools.cycle(sets)
    return lambda: fn(next(turn))


def bench_gemv(shape, dtype, device, iters=50, compile_=False, group_size=128, bnb=True) -> list[dict]:
    """Every implementation of ``x @ W.T`` at ``shape = (rows, K, N)``, each cycling through the same number of
    weight sets (``_weight_sets``) so that every one of them reads its weights from HBM, as in a decode step."""
    from labkit.quant.packing import dequantize_int4, dequantize_int8

    m, k, n = shape
    x = _randn(m, k, dtype=dtype, device=device)
    sets = _weight_sets(n, k, dtype, device, group_size)
    fns = {"bf16" if dtype == torch.bfloat16 else "dense": lambda s: F.linear(x, s["w"]),
           "w8_triton": lambda s: w8a16_matmul(x, s["q8"], s["scale"]),
           # the stationary int8 GEMV the engine's fused int8 layers use, beside the split-K one above
           "w8_triton_stationary": lambda s: w8a16_matmul(x, s["q8"], s["scale"], stationary=True),
           "w4_triton": lambda s: w4a16_matmul(x, s["packed"], s["s4"], s["z4"], group_size),
           "w8_dequant_then_matmul": lambda s: F.linear(x, dequantize_int8(s["q8"], s["scale"], dtype)),
           "w4_dequant_then_matmul": lambda s: F.linear(x, dequantize_int4(s["packed"], s["s4"], s["z4"],
                                                                             group_size, dtype))}
    times = _time_all({name: _cycling(f, sets) for name, f in fns.items()}, device, iters, cuda_graph=True)
    times.update(_read_floors(sets, device, iters))
    layers = [_bnb_linears(s["w"]) for s in sets] if bnb and device.type == "cuda" else []
    if layers and layers[0]:
        # bitsandbytes beside our kernels, timed together the same way (graph replays if bnb captures,
        # else CUDA events for all four): the *_vs_bnb rows are the pairs the bnb ratios use
        pair = {name: _cycling(lambda layer: layer(x), [ls[name] for ls in layers]) for name in layers[0]}
        pair.update({"w8_triton_vs_bnb": _cycling(fns["w8_triton"], sets),
                     "w4_triton_vs_bnb": _cycling(fns["w4_triton"], sets)})
        times.update(_time_all(pair, device, iters, cuda_graph=True))
    act = (m * k + m * n) * x.element_size()
    w8_bytes, w4_bytes = _quantised_bytes(n, k, group_size, x.element_size())
    nbytes = {"bf16": 2 * n * k, "dense": n * k * x.element_size(), "w8_triton": w8_bytes,
              "w8_bytes_read": 4 * sets[0]["w8_words"].numel(), "w4_bytes_read": 4 * sets[0]["w4_words"].numel(),
              "w8_triton_stationary": w8_bytes,
              "w4_triton": w4_bytes, "w8_triton_vs_bnb": w8_bytes, "w4_triton_vs_bnb": w4_bytes,
              "bnb_int8": n * k + 4 * n, "bnb_nf4": n * k // 2 + 4 * n * k // 64}
    # the kernels against the same quantised weights dequantised (their error, not the quantisation's)
    s0 = sets[0]
    w4_args = (s0["packed"], s0["s4"], s0["z4"], group_size)
    w8_ref = w8a16_matmul_ref(x.double(), s0["q8"], s0["scale"])
    errs = {"w8_triton": relative_error(w8a16_matmul(x, s0["q8"], s0["scale"]), w8_ref),
            "w8_triton_stationary": relative_error(w8a16_matmul(x, s0["q8"], s0["scale"], stationary=True),
                                                   w8_ref),
            "w4_triton": relative_error(w4a16_matmul(x, *w4_args), w4a16_matmul_ref(x.double(), *w4_args))}
    rows = [_row("gemv", name, shape, dtype, t, nbytes.get(name, n * k) + act, flops=2 * m * n * k,
                 err=errs.get(name)) for name, t in times.items()]
    for r in rows:
        r["weight_sets"] = len(sets)
    return rows


def _read_floors(sets: list, device, iters: int) -> dict[str, Timing]:
    """``w8_bytes_read`` / ``w4_bytes_read``: ``stream_read`` over as many bytes as each format's weights, cycling
    through the sets like the GEMVs, the fastest of ``READ_TILES`` (each checked to have read every word; under
    the interpreter only the largest, whose few programs keep the check quick: its time is Python's anyway)."""
    out = {}
    shapes = READ_TILES if device.type == "cuda" else READ_TILES[-1:]
    for fmt in ("w8", "w4"):
        key = f"{fmt}_words"
        words = sets[0][key]
        for tile in shapes:
            if stream_read_ref(stream_read(words, *tile)) != stream_read_ref(words):
                raise RuntimeError(f"stream_read{tile} did not read every word")
        tiles = {tile: _cycling(lambda s, t=tile, key=key: stream_read(s[key], *t), sets) for tile in shapes}
        out[f"{fmt}_bytes_read"] = min(_time_all(tiles, device, iters, cuda_graph=True).values(),
                                       key=lambda t: t.median_s)
    return out


BENCHES = {"rmsnorm": bench_rmsnorm, "swiglu": bench_swiglu, "rope": bench_rope, "softmax": bench_softmax,
           "flash": bench_flash, "paged": bench_paged, "gemv": bench_gemv}


def add_fractions(rows: list[dict], ceilings: dict) -> list[dict]:
    """Fraction of the measured ceiling: bandwidth for memory-bound rows, matmul FLOP/s for attention; memory-bound
    rows also get ``frac_of_datasheet_bw`` where ``ceilings`` holds the datasheet's peak bandwidth."""
    for r in rows:
        if r["kernel"] == "flash":
            r["frac_of_ceiling"] = 1e12 * r["tflop_s"] / ceilings["matmul_flops"]
        else:
            r["frac_of_ceiling"] = 1e9 * r["gb_s"] / ceilings["copy_bytes_per_s"]
            if ceilings.get("datasheet_bytes_per_s"):
                r["frac_of_datasheet_bw"] = 1e9 * r["gb_s"] / ceilings["datasheet_bytes_per_s"]
    return rows


def run_sweep(profile: str, kernels=KERNELS, dtype: torch.dtype | None = None, compile_: bool = False,
              device=None, iters: int | None = None) -> list[dict]:
    """Every size of ``SIZES[profile]`` for the chosen kernels; bfloat16 on CUDA, float16 on the CPU."""
    from tqdm.auto import tqdm

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float16)
    jobs = [(kname, shape) for kname in kernels for shape in SIZES[profile][kname]]
    rows = []
    for kname, shape in tqdm(jobs, desc="kernels", unit="case"):
        kw = {"iters": iters} if iters else {}
        rows += BENCHES[kname](shape, dtype, device, compile_=compile_, **kw)
    return rows


def pick_row(rows: list[dict], kernel: str, impl: str, shape: str | None = None) -> dict | None:
    """The first row of ``kernel`` / ``impl`` (at ``shape``, written like ``16384x4096``), or None."""
    for r in rows:
        if r["kernel"] == kernel and r["impl"] == impl and (shape is None or r["shape"] == shape):
            return r
    return None


def headline_figures(rows: list[dict], profile: str) -> dict[str, float]:
    """The issue's ``kernels.*`` figures from rows at the first (headline) size of each kernel."""
    head = {k: "x".join(map(str, v[0])) for k, v in SIZES[profile].items()}
    figs = {}

    def ratio(kernel, slow, fast):
        a, b = pick_row(rows, kernel, slow, head[kernel]), pick_row(rows, kernel, fast, head[kernel])
        return a["median_us"] / b["median_us"] if a and b else math.nan

    def frac(kernel, impl="triton", key="frac_of_ceiling"):
        r = pick_row(rows, kernel, impl, head[kernel])
        return r.get(key, math.nan) if r else math.nan

    figs["kernels.rmsnorm_bw_frac"] = frac("rmsnorm")
    figs["kernels.rmsnorm_speedup_vs_eager"] = ratio("rmsnorm", "eager", "triton")
    figs["kernels.swiglu_bw_frac"] = frac("swiglu")
    figs["kernels.rope_bw_frac"] = frac("rope")
    figs["kernels.flash_attn_vs_sdpa"] = ratio("flash", "sdpa_flash" if profile == "gpu" else "sdpa", "triton")
    figs["kernels.paged_attn_bw_frac"] = frac("paged")
    dense = "bf16" if profile == "gpu" else "dense"
    figs["kernels.w8_gemv_speedup_vs_bf16"] = ratio("gemv", dense, "w8_triton")
    figs["kernels.w4_gemv_speedup_vs_bf16"] = ratio("gemv", dense, "w4_triton")
    figs["kernels.w8_stationary_gemv_speedup_vs_bf16"] = ratio("gemv", dense, "w8_triton_stationary")
    figs["kernels.w8_vs_bnb_int8"] = ratio("gemv", "bnb_int8", "w8_triton_vs_bnb")
    figs["kernels.w4_vs_bnb_nf4"] = ratio("gemv", "bnb_nf4", "w4_triton_vs_bnb")
    # bitsandbytes' time over the time labkit's GEMV would take at the copy ceiling (its bytes / bandwidth): a
    # ratio above this needs a GEMV faster than the bandwidth it must read its weights at
    figs["kernels.w8_vs_bnb_int8_at_copy_bw"] = figs["kernels.w8_vs_bnb_int8"] / frac("gemv", "w8_triton_vs_bnb")
    figs["kernels.w4_vs_bnb_nf4_at_copy_bw"] = figs["kernels.w4_vs_bnb_nf4"] / frac("gemv", "w4_triton_vs_bnb")
    # and at the vendor's peak bandwidth, which no kernel on this part exceeds
    figs["kernels.w8_vs_bnb_int8_at_datasheet_bw"] = (figs["kernels.w8_vs_bnb_int8"]
                                                      / frac("gemv", "w8_triton_vs_bnb", "frac_of_datasheet_bw"))
    figs["kernels.w4_vs_bnb_nf4_at_datasheet_bw"] = (figs["kernels.w4_vs_bnb_nf4"]
                                                     / frac("gemv", "w4_triton_vs_bnb", "frac_of_datasheet_bw"))
    # and at the time a kernel that only reads those bytes takes here, launch and tail included
    figs["kernels.w4_gemv_frac_of_read_floor"] = ratio("gemv", "w4_bytes_read", "w4_triton")
    figs["kernels.w8_vs_bnb_int8_at_read_floor"] = ratio("gemv", "bnb_int8", "w8_bytes_read")
    figs["kernels.w4_vs_bnb_nf4_at_read_floor"] = ratio("gemv", "bnb_nf4", "w4_bytes_read")
    return figs


def plot_rows(rows: list[dict], out_dir: Path | None = None, show: bool = False) -> list[Path]:
    """One panel per kernel: GB/s (TFLOP/s for attention) per implementation and size, perf_report style."""
    import matplotlib

    if not show:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    fig, axes = plt.subplots(1, len(kernels), figsize=(3.2 * len(kernels), 3.2), squeeze=False)
    for ax, kname in zip(axes[0], kernels, strict=True):
        sub = [r for r in rows if r["kernel"] == kname]
        metric = "tflop_s" if kname == "flash" else "gb_s"
        shapes = list(dict.fromkeys(r["shape"] for r in sub))
        for impl in dict.fromkeys(r["impl"] for r in sub):
            ys = [next((r[metric] for r in sub if r["impl"] == impl and r["shape"] == s), math.nan) for s in shapes]
            ax.plot(range(len(shapes)), ys, marker="o", label=impl)
        ax.set_xticks(range(len(shapes)), shapes, rotation=45, ha="right", fontsize=6)
        ax.set_title(kname)
        ax.set_ylabel("TFLOP/s" if metric == "tflop_s" else "GB/s")
        ax.legend(fontsize=6)
    fig.tight_layout()
    paths = []
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        paths.append(Path(out_dir) / "kernels_bench.png")
        fig.savefig(paths[0], dpi=120)
    if show:
        plt.show()
    plt.close(fig)
    return paths


def write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for r in rows for key in r)))  # every row's keys
        w.writeheader()
        w.writerows(rows)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit bench kernels [--profile ...] [--only rmsnorm flash ...] [--compile] [--out DIR]``."""
    from labkit.bench import output_dir
    from labkit.hardware import measure_ceilings
    from labkit.workbook import resolve_profile

    ap = argparse.ArgumentParser(prog="python -m labkit bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="auto", help="ci, cpu, gpu or auto (sizes of SIZES[profile])")
    ap.add_argument("--only", nargs="*", default=None, help=f"kernels to run; allowed: {' '.join(KERNELS)}")
    ap.add_argument("--compile", action="store_true", help="add torch.compile rows (CUDA only)")
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions per implementation")
    ap.add_argument("--out", default=None, help="output folder (default $LABKIT_OUT or out/local)")
    args = ap.parse_args(argv)
    profile = resolve_profile(args.profile)
    kernels = tuple(args.only or KERNELS)
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        ap.error(f"--only {unknown} unknown; allowed: {list(KERNELS)}")
    out = Path(args.out) if args.out else output_dir()
    t0 = time.perf_counter()
    ceilings = measure_ceilings()
    rows = add_fractions(run_sweep(profile, kernels, compile_=args.compile, iters=args.iters), ceilings)
    figures = headline_figures(rows, profile) if set(kernels) == set(KERNELS) else {}
    csv_path = write_csv(rows, out / "records" / "kernels_bench.csv")
    rec = write_record("kernels_bench", {"profile": profile, "ceilings": ceilings, "rows": rows,
                                         "figures": figures, "bars": BARS, "csv": csv_path,
                                         "seconds": time.perf_counter() - t0}, out_dir=out)
    plot_rows(rows, out / "plots")
    for r in rows:
        print(f"{r['kernel']:8s} {r['impl']:24s} {r['shape']:22s} {r['median_us']:10.1f} us "
              f"{r['gb_s']:8.1f} GB/s {r['tflop_s']:7.1f} TFLOP/s  {r['frac_of_ceiling']:.2f} of ceiling")
    for name, v in figures.items():
        print(f"{name:36s} {v:8.3f}   bar {BARS[name] or '-'}")
    print(f"wrote {rec} and {csv_path}")
    return 0
