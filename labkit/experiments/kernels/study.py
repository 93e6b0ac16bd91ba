"""The arithmetic and the experiments of notebook 03 (custom kernels), kept here so they are tested.

* ``operator_costs``: FLOPs and bytes of each transformer operator at a given size, its arithmetic intensity
  against the ridge point, and the time the binding ceiling implies (hint 1: memory- vs compute-bound).
* ``FUSION_BYTES``: bytes per element that eager torch moves for the elementwise operators against one fused
  pass, counted pass by pass from the Hugging Face expressions -- the predicted speed-up of fusing them.
* ``matmul_rates``: the same matmul in float32 on CUDA cores, TF32 and bfloat16 on Tensor Cores.
* ``kv_quant_attention``: one layer's decode attention over a paged cache in bf16, int8 dequantised inside
  the kernel, int8 dequantised to bf16 first (the algorithmic change without a kernel for it), and fp8 (e4m3)
  dequantised inside the kernel; ``kv_quant_attention_sweep`` / ``plot_kv_quant_sweep``: bf16, int8 and fp8 over
  contexts, against each format's bytes floor.
* ``decode_steps``: one decode step of a Hugging Face model as CUDA-graph replays: patched with labkit's kernels,
  against the same step with SDPA called with ``enable_gqa`` (``sdpa_gqa``: each KV head read once, the strong
  baseline) and against HF's own SDPA path (which may copy K/V once per query group over a static cache).
* ``norm_sweep`` / ``plot_bandwidth``: the fused add + RMSNorm against eager torch over row counts, in GB/s
  against the copy bandwidth (the kernel notebook 03 reads line by line).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from labkit.bench import time_fn
from labkit.model import get_config

# Bytes per element, bf16 activations, float32 statistics, counted pass by pass (read + write):
FUSION_BYTES = {
    # x.float() 2+4, pow(2) 4+4, mean 4, x * rsqrt 4+4, .to(bf16) 4+2, weight * 2+2   vs  read 2 + write 2
    "rmsnorm": {"eager": 36, "fused": 4, "eager_passes": 6},
    # residual add 2+2+2, then the norm's 36                                          vs  read 4 + write 4
    "add_rmsnorm": {"eager": 42, "fused": 8, "eager_passes": 7},
    # per output element: silu(gate) 2+2, silu * up 2+2+2                            vs  read 4 + write 2
    "swiglu": {"eager": 10, "fused": 6, "eager_passes": 2},
    # q * cos 2+2, -x2 (half) 1+1, cat 2+2, * sin 2+2, + 2+2+2 (cos/sin from L2)      vs  read 2 + write 2
    "rope": {"eager": 20, "fused": 4, "eager_passes": 5},
    # torch.softmax is already one fused kernel: read 2 + write 2                     vs  read 2 + write 2
    "softmax": {"eager": 4, "fused": 4, "eager_passes": 1},
}


def operator_costs(spec="llama-3-8b", tokens: int = 16384, batch: int = 32, context: int = 4096,
                   seq: int = 4096, bandwidth: float = 4.27e12, peak_flops: float = 799e12,
                   dtype_bytes: int = 2) -> list[dict]:
    """One row per operator of one layer of ``spec``: FLOPs, bytes, FLOP/byte and the bound it implies.

    Elementwise ops run on ``tokens`` rows; prefill attention on 4 sequences of ``seq`` (causal); decode
    attention on ``batch`` sequences of ``context``; linears at batch 1 (GEMV) and at ``tokens`` rows (GEMM).
    """
    s = get_config(spec)
    h, i, d, b = s.hidden_size, s.intermediate_size, s.head_dim, dtype_bytes
    qkv = (s.num_heads + s.num_kv_heads) * d
    rows = [
        ("RMSNorm", tokens * h * 4, 2 * tokens * h * b),
        ("SwiGLU activation", tokens * i * 4, 3 * tokens * i * b),
        ("RoPE", tokens * qkv * 3, 2 * tokens * qkv * b),
        ("softmax (unfused attention)", 4 * s.num_heads * seq * seq * 4, 2 * 4 * s.num_heads * seq * seq * b),
        ("attention prefill (flash)", 4 * 4 * s.num_heads * seq * seq * d / 2,
         4 * seq * (2 * s.num_heads + 2 * s.num_kv_heads) * d * b),
        ("attention decode (paged)", 4 * batch * s.num_heads * context * d,
         2 * batch * context * s.num_kv_heads * d * b),
        ("linear 4096x14336, batch 1 (bf16)", 2 * h * i, h * i * b),
        ("linear 4096x14336, batch 1 (int4)", 2 * h * i, h * i // 2),
        (f"linear 4096x14336, {tokens} tokens", 2 * tokens * h * i, (h * i + tokens * (h + i)) * b),
    ]
    ridge = peak_flops / bandwidth
    out = []
    for name, flops, nbytes in rows:
        t_mem, t_flop = nbytes / bandwidth, flops / peak_flops
        out.append({"operator": name, "GFLOP": flops / 1e9, "MB": nbytes / 1e6, "FLOP/byte": flops / nbytes,
                    "bound": "memory" if flops / nbytes < ridge else "compute",
                    "predicted_us": 1e6 * max(t_mem, t_flop)})
    return out


def matmul_rates(n: int | None = None, device=None, iters: int = 10) -> list[dict]:
    """TFLOP/s of one ``n^3`` matmul: float32 on CUDA cores (TF32 off), TF32 and bfloat16 on Tensor Cores."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = n or (8192 if dev.type == "cuda" else 512)
    cases = [("fp32 (CUDA cores)", torch.float32, False), ("tf32 (Tensor Cores)", torch.float32, True),
             ("bf16 (Tensor Cores)", torch.bfloat16, True)]
    if dev.type != "cuda":
        cases = [cases[0], cases[2]]  # no TF32 on the CPU
    rows = []
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, tf32 in cases:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.randn(n, n, device=dev).to(dtype)
            bm = torch.randn(n, n, device=dev).to(dtype)
            t = time_fn(lambda a=a, bm=bm: a @ bm, dev, warmup=2, iters=iters)
            rows.append({"matmul": name, "n": n, "ms": t.median_ms, "TFLOP/s": 2 * n**3 / t.median_s / 1e12})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return rows


# The quantised-KV attention figures' one shape (issue 30/33): batch 16, context 4096, 32 query / 8 KV heads, d 128
INT8_ATTN_SHAPE = {"seqs": 16, "heads": 32, "kv_heads": 8, "head_dim": 128, "context": 4096}
INT8_ATTN_FIGURE = "kvcache.int8_attn_speedup_ctx4k_b16"
FP8_ATTN_FIGURE = "kvcache.fp8_attn_speedup_ctx4k_b16"
KV_ATTN_ROWS = {"bf16": "bf16 cache", "int8": "int8 cache, dequantised in the kernel",
                "int8 first": "int8 cache, dequantised first", "fp8": "fp8 cache, dequantised in the kernel"}
"""``kv_quant_attention``'s row names (its ``attention`` column) by short name; other code reads them by name."""
KV_SWEEP_FORMATS = ("bf16", "int8", "fp8")
"""The caches ``kv_quant_attention_sweep`` times, each read by the kernel as stored (``labkit.kvcache.quant`` names;
"bf16" is the unquantised cache in the sweep's ``dtype``)."""
KV_ROUNDING_BOUND = {"int8": 2e-2, "fp8": 2**-4}
"""The bound on a quantised cache's attention output against the unquantised cache's (relative error): int8 weights'
2e-2 of the house table, and e4m3's unit roundoff (3 mantissa bits: each element within 2^-4 of itself) for fp8."""
FLOOR = "floor us (measured copy bw)"
"""The sweep's floor column, after the format's name: its bytes over the copy bandwidth measured on the device."""


def int8_attention_speedup(rows: list[dict]) -> float:
    """bf16-cache time over int8-cache-read-in-the-kernel time, from ``kv_quant_attention`` rows (> 1: int8 wins)."""
    by = {r["attention"]: r["us"] for r in rows}
    return by[KV_ATTN_ROWS["bf16"]] / by[KV_ATTN_ROWS["int8"]]


def fp8_attention_speedup(rows: list[dict]) -> float:
    """bf16-cache time over fp8-cache-read-in-the-kernel time, from ``kv_quant_attention`` rows (> 1: fp8 wins)."""
    by = {r["attention"]: r["us"] for r in rows}
    return by[KV_ATTN_ROWS["bf16"]] / by[KV_ATTN_ROWS["fp8"]]


def _kv_cache_bytes(seqs: int, context: int, kv_heads: int, head_dim: int, elem_bytes: int, scales: bool) -> int:
    """Bytes of K and V of ``seqs`` sequences of ``context`` tokens, with one float32 scale per token and KV head
    each where ``scales``."""
    elems = 2 * seqs * context * kv_heads * head_dim
    return elems * elem_bytes + (elems // head_dim * 4 if scales else 0)


def _kv_attention_calls(q, k, v, tables, lens, names) -> dict:
    """``paged_attention`` over the same K/V stored each way of ``names`` (keys of ``KV_ATTN_ROWS``): name -> a
    call of no arguments. The quantised copies are made once, here (``labkit.kvcache.quant``'s per token and head
    scales)."""
    from labkit.kernels.paged_attention import paged_attention
    from labkit.kvcache.quant import dequantize_kv, kv_format, quantize_kv

    calls = {}
    for name in names:
        if name == "bf16":
            calls[name] = lambda: paged_attention(q, k, v, tables, lens)
            continue
        fmt = kv_format(name.split()[0])
        (kq, ks), (vq, vs) = quantize_kv(k, fmt), quantize_kv(v, fmt)
        if name.endswith("first"):
            calls[name] = lambda kq=kq, ks=ks, vq=vq, vs=vs: paged_attention(
                q, dequantize_kv(kq, ks, q.dtype), dequantize_kv(vq, vs, q.dtype), tables, lens)
        else:
            calls[name] = lambda kq=kq, ks=ks, vq=vq, vs=vs: paged_attention(q, kq, vq, tables, lens,
                                                                              k_scale=ks, v_scale=vs)
    return calls


def _device_dtype(device, dtype) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float16)


def kv_quant_attention(seqs: int, heads: int, kv_heads: int, head_dim: int, context: int, block_size: int = 16,
                       dtype: torch.dtype | None = None, device=None, iters: int = 20) -> list[dict]:
    """One layer's paged decode attention with the cache in bf16, int8 read by the kernel, int8 dequantised to bf16
    before a bf16 kernel, and fp8 (e4m3) read by the kernel (rows named by ``KV_ATTN_ROWS``, in that order). Rows
    carry time, cache bytes and the error against bf16."""
    from labkit.evaluate import relative_error
    from labkit.experiments.kernels.cases import _paged_inputs

    dev, dtype = _device_dtype(device, dtype)
    q, k, v, tables, lens = _paged_inputs((seqs, heads, kv_heads, head_dim, block_size, context), dtype, dev)
    fns = _kv_attention_calls(q, k, v, tables, lens, KV_ATTN_ROWS)
    one = _kv_cache_bytes(seqs, context, kv_heads, head_dim, 1, True)  # int8 or fp8, scales included
    two = _kv_cache_bytes(seqs, context, kv_heads, head_dim, torch.finfo(dtype).bits // 8, False)
    nbytes = {"bf16": two, "int8": one, "int8 first": one + 2 * two, "fp8": one}  # first: + write, re-read bf16
    warm = 3 if dev.type == "cuda" else 0  # the interpreter compiles nothing; the output's call warms it
    rows, ref = [], None
    for name, fn in fns.items():
        out = fn()
        ref = out if ref is None else ref  # the bf16 cache's, the first
        t = time_fn(fn, dev, warmup=warm, iters=iters, cuda_graph=dev.type == "cuda")
        rows.append({"attention": KV_ATTN_ROWS[name], "us": t.median_us, "cache MB read": nbytes[name] / 1e6,
                     "GB/s": nbytes[name] / t.median_s / 1e9, "rel_err vs bf16": relative_error(out, ref)})
    return rows


def kv_quant_attention_sweep(contexts=(1024, 2048, 4096, 8192, 16384, 32768), seqs: int = 16, heads: int = 32,
                             kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
                             dtype: torch.dtype | None = None, device=None, iters: int = 20,
                             copy_bandwidth: float | None = None, progress: bool = True) -> list[dict]:
    """One layer's paged decode attention at each context of ``contexts``, the cache in bf16 and in int8 and fp8
    read by the kernel (``KV_SWEEP_FORMATS``): one row per context with, per format, ``{fmt} us`` (median),
    ``{fmt} MB`` (K/V, their scales, q and the output: the bytes one call must move), ``{fmt} GB/s``, ``{fmt}
    floor us (measured copy bw)`` (those bytes over ``copy_bandwidth``) and, for int8 and fp8, ``{fmt} speed-up``
    (bf16 time over theirs) and ``{fmt} rel_err`` (against the bf16 cache's output).

    ``copy_bandwidth``: bytes/s of a device-to-device copy measured on this device (``measure_ceilings``'s
    ``copy_bytes_per_s``); None measures it now. ``dtype``: the unquantised cache's (bf16 on CUDA, float16 on the CPU,
    where the interpreter's bf16 ``tl.dot`` is wrong). One context's caches live at a time (at batch 16, context
    32768, 8 KV heads, d 128: 2.1 GB of bf16 K/V and half that per 8-bit copy); a progress bar counts the contexts.
    """
    from tqdm.auto import tqdm

    from labkit.evaluate import relative_error
    from labkit.experiments.kernels.cases import _paged_inputs
    from labkit.hardware import measure_copy_bandwidth

    dev, dtype = _device_dtype(device, dtype)
    bw = copy_bandwidth if copy_bandwidth is not None else measure_copy_bandwidth(dev)
    act = 2 * seqs * heads * head_dim * (torch.finfo(dtype).bits // 8)  # q read, output written
    warm = 3 if dev.type == "cuda" else 0  # the interpreter compiles nothing; the output's call warms it
    rows = []
    for context in tqdm(list(contexts), desc="KV attention sweep", unit="context", disable=not progress):
        q, k, v, tables, lens = _paged_inputs((seqs, heads, kv_heads, head_dim, block_size, context), dtype, dev)
        fns = _kv_attention_calls(q, k, v, tables, lens, KV_SWEEP_FORMATS)
        del k, v  # the calls hold what they read
        row = {"context": context, "seqs": seqs, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
               "dtype": str(dtype).replace("torch.", ""), "copy GB/s (measured)": bw / 1e9}
        ref = None
        for name, fn in fns.items():
            out = fn()
            ref = out if ref is None else ref
            elem = torch.finfo(dtype).bits // 8 if name == "bf16" else 1
            nbytes = _kv_cache_bytes(seqs, context, kv_heads, head_dim, elem, name != "bf16") + act + tables.numel() * 4
            t = time_fn(fn, dev, warmup=warm, iters=iters, cuda_graph=dev.type == "cuda")
            row.update({f"{name} us": t.median_us, f"{name} MB": nbytes / 1e6,
                        f"{name} GB/s": nbytes / t.median_s / 1e9, f"{name} {FLOOR}": 1e6 * nbytes / bw})
            if name != "bf16":
                row[f"{name} rel_err"] = relative_error(out, ref)
        for name in KV_SWEEP_FORMATS[1:]:
            row[f"{name} speed-up"] = row["bf16 us"] / row[f"{name} us"]
        rows.append(row)
        del fns, ref, out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot_kv_quant_sweep(rows: list[dict], ax=None):
    """Time per call against context (log-log) for each format of ``kv_quant_attention_sweep``'s rows, solid, with
    its bytes floor (bytes over the measured copy bandwidth) dashed in the same colour. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    ax = ax if ax is not None else plt.subplots(figsize=(7, 4.2))[1]
    rows = sorted(rows, key=lambda r: r["context"])
    ctx = [r["context"] for r in rows]
    r0, bw = rows[0], rows[0]["copy GB/s (measured)"]
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(r0["dtype"], r0["dtype"])
    names = {"bf16": short, "int8": "int8", "fp8": "fp8 e4m3"}
    # int8 and fp8 move the same bytes: their floors coincide, so their dashes interleave (both stay visible)
    dashes = {"bf16": (0, (5, 3)), "int8": (0, (4, 4)), "fp8": (4, (4, 4))}
    for i, name in enumerate(KV_SWEEP_FORMATS):  # measured first, floors after: the legend's two columns
        ax.plot(ctx, [r[f"{name} us"] for r in rows], "o-", color=f"C{i}", lw=2, label=f"{names[name]}: measured")
    for i, name in enumerate(KV_SWEEP_FORMATS):
        ax.plot(ctx, [r[f"{name} {FLOOR}"] for r in rows], color=f"C{i}", lw=1.5, ls=dashes[name],
                label=f"{names[name]}: bytes floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ctx))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{c // 1024}k" if c >= 1024 and c % 1024 == 0 else str(c) for c in ctx])
    ax.set(xlabel="context (tokens per sequence)", ylabel="time per call (µs)",
           title=f"paged decode attention, one layer: batch {r0['seqs']}, {r0['heads']} query / {r0['kv_heads']} KV "
                 f"heads, d {r0['head_dim']}\nint8 / fp8 read by the kernel; floor = bytes / measured copy bandwidth "
                 f"({f'{bw / 1e3:.2f} TB/s' if bw >= 1e3 else f'{bw:.1f} GB/s'})")
    ax.title.set_fontsize(10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="best")
    return ax


SDPA_GQA = "labkit_sdpa_gqa"
"""The attention implementation name ``sdpa_gqa`` registers with transformers."""


def sdpa_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-interface function: SDPA on ``query`` ``[B, H, S, D]`` and ``key``/``value``
    ``[B, H_kv, T, D]`` as the cache holds them, never copied once per query group (no ``repeat_kv``), with the mask
    of transformers' sdpa builder (``None``: plain causal, or a decode step that sees every cached token).

    ``enable_gqa=True`` does it where the mask is ``None`` (CUDA's flash backend takes grouped heads, not masks).
    A masked decode step (one query) packs each KV head's query group as its rows instead, ``[B, H_kv, H / H_kv,
    D]``, so SDPA's masked backends read every KV head once without the flag (on CUDA they refuse grouped heads and
    SDPA would fall back to its math path, which copies K/V). Returns ``[B, S, H, D]`` and no weights."""
    b, h, s, d = query.shape
    drop = dropout if module.training else 0.0
    if attention_mask is not None and s == 1 and key.shape[1] < h:
        q = query.reshape(b, key.shape[1], h // key.shape[1], d)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=drop, scale=scaling)
        return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None
    causal = attention_mask is None and s > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=drop,
                                         is_causal=causal, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def sdpa_gqa(model: torch.nn.Module):
    """Run ``model`` (a Hugging Face causal LM) with ``sdpa_gqa_attention_forward`` inside the block; its previous
    attention implementation comes back after it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention_forward)
    AttentionMaskInterface.register(SDPA_GQA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    prev = getattr(model.config, "_attn_implementation", None) or "sdpa"
    model.set_attn_implementation(SDPA_GQA)
    try:
        yield model
    finally:
        model.set_attn_implementation(prev)


def decode_steps(model: torch.nn.Module, batch_sizes: list[int], context: int, iters: int = 20) -> list[dict]:
    """One decode step of ``model`` (HF StaticCache) per batch size, three ways: HF's own attention path (``hf
    sdpa ms``), SDPA with ``enable_gqa`` (``sdpa_gqa ms``, the baseline a user would pick: K/V read once per KV
    head) and patched with labkit's kernels (``patched ms``). ``speed-up`` is over ``sdpa_gqa``; ``speed-up vs hf
    sdpa`` over HF's path (a footnote).

    On CUDA each step is captured once and its replays timed, so launch overhead does not hide the kernels.
    Leaves the model unpatched, with its attention implementation.
    """
    from labkit.experiments.decode_step import time_decode_step
    from labkit.kernels.patch import patch_model, unpatch

    rows = []
    for bs in batch_sizes:
        plain = time_decode_step(model, bs, context, iters=iters)
        with sdpa_gqa(model):
            gqa = time_decode_step(model, bs, context, iters=iters)
        patch_model(model)
        try:
            patched = time_decode_step(model, bs, context, iters=iters)
        finally:
            unpatch(model)
        rows.append({"batch": bs, "context": context, "hf sdpa ms": plain.median_ms, "sdpa_gqa ms": gqa.median_ms,
                     "patched ms": patched.median_ms, "speed-up": gqa.median_s / patched.median_s,
                     "speed-up vs hf sdpa": plain.median_s / patched.median_s, "method": patched.method})
    return rows


def decode_step_figures(rows: list[dict]) -> dict[str, float]:
    """``kernels.patched_step_speedup`` (over SDPA with ``enable_gqa``, the headline) and
    ``kernels.patched_step_speedup_vs_hf_sdpa`` (the footnote) at the largest batch of ``decode_steps``' rows."""
    if not rows:
        return {}
    r = max(rows, key=lambda r: r["batch"])
    return {"kernels.patched_step_speedup": r["speed-up"], "kernels.patched_step_speedup_vs_hf_sdpa":
            r["speed-up vs hf sdpa"]}


def norm_sweep(row_counts: list[int], hidden: int, dtype: torch.dtype, device, iters: int = 20,
               compile_: bool = False) -> list[dict]:
    """``bench_rmsnorm`` rows (fused add + RMSNorm and its eager form, plain RMSNorm and its eager form) at each
    row count of ``[rows, hidden]``: time, bytes, GB/s and the kernel's error against float64."""
    from labkit.experiments.kernels.cases import bench_rmsnorm

    out = []
    for n in row_counts:
        for r in bench_rmsnorm((n, hidden), dtype, torch.device(device), iters=iters, compile_=compile_):
            out.append({**r, "rows": n})
    return out


def plot_bandwidth(rows: list[dict], ceiling_gb_s: float, ax=None, title: str = "",
                   impls=("triton_fused_residual", "eager_add_then_norm", "triton", "eager", "torch_compile"),
                   datasheet_gb_s: float | None = None):
    """GB/s against row count for each implementation in ``rows`` (``norm_sweep``), with the measured copy
    bandwidth (and the datasheet's, if given) as the line no kernel can pass. Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(6, 3.6))[1]
    labels = {"triton_fused_residual": "labkit add+RMSNorm (1 kernel)", "eager_add_then_norm": "eager add, then norm",
              "triton": "labkit RMSNorm", "eager": "eager RMSNorm (HF)", "torch_compile": "torch.compile RMSNorm"}
    for impl in impls:
        sub = [r for r in rows if r["impl"] == impl]
        if sub:
            ax.plot([r["rows"] for r in sub], [r["gb_s"] for r in sub], "o-", label=labels.get(impl, impl),
                    lw=2 if impl.startswith("triton") else 1)
    ax.axhline(ceiling_gb_s, color="black", ls="--", lw=1, label="copy bandwidth (measured)")
    if datasheet_gb_s:
        ax.axhline(datasheet_gb_s, color="gray", ls=":", lw=1, label="datasheet bandwidth")
    ax.set(xscale="log", xlabel="rows (tokens)", ylabel="GB/s moved", title=title)
    ax.legend(fontsize=7)
    return ax
