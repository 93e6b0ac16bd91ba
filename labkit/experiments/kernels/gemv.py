"""Notebook 03's GEMV case: every implementation of ``x @ W.T`` at a decode shape -- bf16 (cuBLAS), labkit's int8 and
int4 kernels, dequantise-then-matmul, bitsandbytes -- and a kernel that only reads as many bytes as each format's
weights (``stream_read``), each cycling through weight sets so that every one reads its weights from HBM."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.bench import Timing
from labkit.evaluate import relative_error
from labkit.experiments.kernels.cases import _randn, _row, _time_all
from labkit.experiments.kernels.stream_read import READ_TILES, stream_read, stream_read_ref
from labkit.kernels.quantized_matmul import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    w4a16_matmul,
    w4a16_matmul_ref,
    w8a16_matmul,
    w8a16_matmul_ref,
)
from labkit.kernels.quantized_matmul.stationary import w8_gemv_xs
from labkit.kernels.quantized_matmul.tuning import sms_of, stationary_plan, tuning_for


def w8_stationary_gemv(x: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The stationary int8 GEMV (the one the engine's fused int8 layers run) on a bare product of one row, launched
    with the device's tuning: ``w8a16_matmul`` gives a bare product the split-K GEMV and this one only with
    neighbours."""
    (n, k), t = q8.shape, tuning_for(x.device)
    plan = stationary_plan(n, k, 4, t.w8_stationary, sms_of(t, x.device))
    return w8_gemv_xs(x.reshape(1, k), q8.view(torch.int32), scale, plan).view(*x.shape[:-1], n)


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
    m, k, n = shape
    x = _randn(m, k, dtype=dtype, device=device)
    sets = _weight_sets(n, k, dtype, device, group_size)
    fns = {"bf16" if dtype == torch.bfloat16 else "dense": lambda s: F.linear(x, s["w"]),
           "w8_triton": lambda s: w8a16_matmul(x, s["q8"], s["scale"]),
           # the stationary int8 GEMV the engine's fused int8 layers use, beside the split-K one above
           "w8_triton_stationary": lambda s: w8_stationary_gemv(x, s["q8"], s["scale"]),
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
            "w8_triton_stationary": relative_error(w8_stationary_gemv(x, s0["q8"], s0["scale"]), w8_ref),
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
