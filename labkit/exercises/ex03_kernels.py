"""Notebook 03 (kernels): RMSNorm, SwiGLU (``silu(gate) * up``) and softmax Triton kernels, written from skeletons;
and the int8 KV cache's attention speed-up predicted from bytes, then set against the measured kernels.

The learner passes a ``@triton.jit`` kernel with the signature the task gives; the checker launches it (one program
per row for RMSNorm, blocks of ``BLOCK`` elements for SwiGLU) on irregular sizes, outputs filled with NaN first, so
an element never written shows. A plain function ``fn(x, weight, eps)`` / ``fn(gate, up)`` is accepted too: that is
how labkit's own kernels (``labkit.kernels.rms_norm`` and ``silu_and_mul``, the solutions) are checked. On a CPU
the kernels run through Triton's interpreter (fp32, small sizes: seconds).
"""

from __future__ import annotations

import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU-only host)
from labkit.device import default_device
from labkit.exercises.core import Case, Exercise, Measurement, Prediction, register, tensor_diff
from labkit.exercises.measured import NoMeasurement, committed_record, figure
from labkit.kernels.rms_norm import rms_norm
from labkit.kernels.silu_and_mul import silu_and_mul
from labkit.kernels.softmax import softmax


def _is_kernel(fn) -> bool:
    import triton

    return isinstance(fn, triton.runtime.jit.KernelInterface)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rms_cases() -> list[Case]:
    sizes = [(1, 8, 1e-6), (3, 33, 1e-6), (5, 100, 1e-5), (2, 257, 1e-6), (4, 64, 0.5), (7, 1000, 1e-6)]
    return [Case(f"x [{r}, {c}] float32, eps={e:g}", (r, c, e)) for r, c, e in sizes]


def _run_rms(fn, data):
    rows, cols, eps = data
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    dev = default_device()
    x = (torch.randn(rows, cols, generator=g) * 3 + 0.5).to(dev)
    w = (torch.rand(cols, generator=g) + 0.5).to(dev)
    if not _is_kernel(fn):
        return fn(x, w, eps)
    out = torch.full_like(x, float("nan"))
    fn[(rows,)](x, w, out, cols, eps, BLOCK=_next_pow2(cols))
    return out


def _compare_fp32(expected, actual):
    return tensor_diff(expected, actual, rtol=1e-4, atol=1e-5)


register(Exercise(
    "03.rms_norm", "RMSNorm Triton kernel: out = x / sqrt(mean(x^2) + eps) * w, one program per row",
    rms_norm, _rms_cases, _run_rms, _compare_fp32,
    hint="mask the columns >= n_cols (other=0.0) on load and store; the mean divides by n_cols, not BLOCK"))

BLOCK_SWIGLU = 128


def _swiglu_cases() -> list[Case]:
    shapes = [(1,), (100,), (128,), (3, 43), (2, 5, 129), (4099,)]
    return [Case(f"gate, up {list(s)} float32 ({torch.Size(s).numel()} elements, BLOCK={BLOCK_SWIGLU})", s)
            for s in shapes]


def _run_swiglu(fn, shape):
    g = torch.Generator().manual_seed(sum(shape))
    dev = default_device()
    gate, up = (torch.randn(*shape, generator=g) * 4).to(dev), torch.randn(*shape, generator=g).to(dev)
    if not _is_kernel(fn):
        return fn(gate, up)
    out = torch.full_like(gate, float("nan"))
    n = gate.numel()
    fn[(-(-n // BLOCK_SWIGLU),)](gate, up, out, n, BLOCK=BLOCK_SWIGLU)
    return out


register(Exercise(
    "03.silu_and_mul", "SwiGLU activation kernel: out = silu(gate) * up, elementwise in blocks", silu_and_mul,
    _swiglu_cases, _run_swiglu, _compare_fp32,
    hint="silu(g) = g * sigmoid(g) = g / (1 + exp(-g)); the last block is partial: mask offsets >= n_elements"))


def _softmax_cases() -> list[Case]:
    sizes = [(2, 16, 1.0), (3, 37, 1.0), (4, 100, 30.0), (1, 1, 1.0), (5, 513, 60.0)]
    return [Case(f"x [{r}, {c}] float32, values up to about {int(4 * m)} in size", (r, c, m)) for r, c, m in sizes]


def _run_softmax(fn, data):
    rows, cols, scale = data
    g = torch.Generator().manual_seed(rows * 100 + cols)
    x = (torch.randn(rows, cols, generator=g) * scale).to(default_device())
    if not _is_kernel(fn):
        return fn(x)
    out = torch.full_like(x, float("nan"))
    fn[(rows,)](x, out, cols, BLOCK=_next_pow2(cols))
    return out


register(Exercise(
    "03.softmax", "row-wise softmax Triton kernel, safe from overflow", softmax, _softmax_cases, _run_softmax,
    _compare_fp32,
    hint="padding columns must not count: load them as -inf, not 0; subtract the row maximum before exp, or "
         "large values overflow to inf"))


def int8_kv_attention(seqs: int, heads: int, kv_heads: int, head_dim: int, context: int,
                      scale_bytes: int = 4) -> dict:
    """Solution: bytes one decode step of paged attention moves with the KV cache in bf16 and in int8 (one
    ``scale_bytes`` scale per token, KV head and tensor), and the speed-up the bytes predict for a kernel that
    stays bandwidth-bound. Both read the bf16 query and write the bf16 output (``seqs x heads x head_dim`` each)."""
    qo = 2 * seqs * heads * head_dim * 2
    tokens = seqs * context * kv_heads  # (token, KV head) pairs, for K and for V
    bf16 = 2 * tokens * head_dim * 2 + qo
    int8 = 2 * tokens * (head_dim + scale_bytes) + qo
    return {"bf16_bytes": bf16, "int8_bytes": int8, "speedup": bf16 / int8}


def _int8_kv_cases() -> list[Case]:
    rows = [(16, 32, 8, 128, 4096, 4, "Llama-3-8B shape, batch 16, context 4096 (the notebook's GPU shape)"),
            (1, 32, 8, 128, 1, 4, "one token of context: the query and output weigh as much as the cache"),
            (3, 4, 2, 64, 100, 4, "the ci shape: 3 x 4 heads, 2 KV heads, dim 64, context 100"),
            (7, 64, 8, 128, 777, 2, "70B-like GQA 8:1, bf16 scales"), (2, 12, 12, 96, 333, 4, "MHA, head dim 96"),
            (32, 96, 96, 128, 2048, 4, "GPT-3 175B shape: 96 heads, no GQA")]
    return [Case(f"{label}: seqs={s}, heads={h}, kv_heads={k}, head_dim={d}, context={c}, scale {b} B",
                 (s, h, k, d, c, b)) for s, h, k, d, c, b, label in rows]


GPU_KV_HEADS = {"heads": 32, "kv_heads": 8, "head_dim": 128}  # the GPU shape of notebook 03 (INT8_ATTN_SHAPE)


def _int8_kv_measure() -> list[Measurement]:
    try:  # recorded only by a gpu-profile run: the CPU times Triton's interpreter, not the kernel
        _, rec, source = figure("kvcache.int8_attn_speedup_ctx4k_b16")
        data = rec["data"]
        shape, shape_from = data["kv_shape"], "this run's shape"
    except (NoMeasurement, KeyError, TypeError):
        rec, source = committed_record("results/h200/records/03_kernels.json")
        data = rec["data"]
        shape, shape_from = data.get("kv_shape"), "the record's shape"
    rows = {r["attention"]: r for r in data["kv_quant_attention"]}
    bf, i8 = rows["bf16 cache"], rows["int8 cache, dequantised in the kernel"]
    if shape is None:  # an older record without its shape: the GPU head layout, tokens from the bf16 bytes read
        tokens = bf["cache MB read"] * 1e6 / (2 * GPU_KV_HEADS["kv_heads"] * GPU_KV_HEADS["head_dim"] * 2)
        shape = dict(GPU_KV_HEADS, seqs=round(tokens / 4096), context=4096)
        shape_from = "the shape inferred from the record's bf16 bytes (32 / 8 heads, dim 128, context 4096)"
    args = tuple(shape[k] for k in ("seqs", "heads", "kv_heads", "head_dim", "context"))

    def explain(pred, meas):
        if i8["GB/s"] > 0.8 * bf["GB/s"]:
            how = "both stay near the bandwidth, so the bytes are the time"
        else:
            how = ("the int8 kernel is no longer bandwidth-bound: dequantising (a multiply per element, a scale load "
                   "per token and head, more registers per program) takes the time the bytes saved")
        return (f"the bf16 kernel read its cache at {bf['GB/s']:,.0f} GB/s and the int8 one at {i8['GB/s']:,.0f} "
                f"GB/s: {how}. Halving the bytes halves the floor; only a kernel that reaches the floor gets the "
                f"speed-up")
    shown = ", ".join(f"{k}={shape[k]}" for k in ("seqs", "heads", "kv_heads", "head_dim", "context"))
    return [Measurement(f"int8 KV decode attention speed-up over bf16 ({shown}; {shape_from})", args,
                        bf["us"] / i8["us"], "x", source, 0.25, explain, pick=lambda obs: obs["speedup"])]


register(Prediction(
    "03.int8_kv_speedup", "predict the int8 KV cache's decode-attention speed-up over bf16 from the bytes moved",
    int8_kv_attention, _int8_kv_cases, lambda fn, c: fn(*c), measure=_int8_kv_measure,
    hint="K and V: seqs x context x kv_heads x head_dim each, 2 bytes in bf16, 1 in int8 plus one scale per "
         "(token, KV head) for K and for V; the query and output: seqs x heads x head_dim x 2 bytes each, both sides"))
