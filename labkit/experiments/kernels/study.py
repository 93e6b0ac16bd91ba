"""The arithmetic and the experiments of notebook 03 (custom kernels), kept here so they are tested.

* ``operator_costs``: FLOPs and bytes of each transformer operator at a given size, its arithmetic intensity
  against the ridge point, and the time the binding ceiling implies (hint 1: memory- vs compute-bound).
* ``FUSION_BYTES``: bytes per element that eager torch moves for the elementwise operators against one fused
  pass, counted pass by pass from the Hugging Face expressions -- the predicted speed-up of fusing them.
* ``matmul_rates``: the same matmul in float32 on CUDA cores, TF32 and bfloat16 on Tensor Cores.
* ``kv_quant_attention``: one layer's decode attention over a paged cache in bf16, int8 dequantised inside
  the kernel, and int8 dequantised to bf16 first (the algorithmic change without a kernel for it).
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


# The int8 KV attention figure's one shape (issue 30/33): batch 16, context 4096, 32 query / 8 KV heads, d 128
INT8_ATTN_SHAPE = {"seqs": 16, "heads": 32, "kv_heads": 8, "head_dim": 128, "context": 4096}
INT8_ATTN_FIGURE = "kvcache.int8_attn_speedup_ctx4k_b16"


def int8_attention_speedup(rows: list[dict]) -> float:
    """bf16-cache time over int8-cache-read-in-the-kernel time, from ``kv_quant_attention`` rows (> 1: int8 wins)."""
    by = {r["attention"]: r["us"] for r in rows}
    return by["bf16 cache"] / by["int8 cache, dequantised in the kernel"]


def kv_quant_attention(seqs: int, heads: int, kv_heads: int, head_dim: int, context: int, block_size: int = 16,
                       dtype: torch.dtype | None = None, device=None, iters: int = 20) -> list[dict]:
    """One layer's paged decode attention with the cache in bf16, int8 read by the kernel, and int8
    dequantised to bf16 before a bf16 kernel. Rows carry time, cache bytes and the error against bf16."""
    from labkit.evaluate import relative_error
    from labkit.experiments.kernels.cases import _paged_inputs
    from labkit.kernels.paged_attention import paged_attention
    from labkit.kvcache.quant import dequantize_kv, kv_format, quantize_kv

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float16)
    q, k, v, tables, lens = _paged_inputs((seqs, heads, kv_heads, head_dim, block_size, context), dtype, dev)
    (kq, ks), (vq, vs) = quantize_kv(k, kv_format("int8")), quantize_kv(v, kv_format("int8"))
    fns = {
        "bf16 cache": lambda: paged_attention(q, k, v, tables, lens),
        "int8 cache, dequantised in the kernel": lambda: paged_attention(q, kq, vq, tables, lens,
                                                                         k_scale=ks, v_scale=vs),
        "int8 cache, dequantised first": lambda: paged_attention(q, dequantize_kv(kq, ks, dtype),
                                                                 dequantize_kv(vq, vs, dtype), tables, lens),
    }
    elems = 2 * seqs * context * kv_heads * head_dim
    nbytes = [elems * torch.finfo(dtype).bits // 8, elems + elems // head_dim * 4,
              elems + elems // head_dim * 4 + 2 * 2 * elems]  # read int8, write + re-read bf16
    ref = fns["bf16 cache"]()
    warm = 3 if dev.type == "cuda" else 1
    rows = []
    for (name, fn), nb in zip(fns.items(), nbytes, strict=True):
        t = time_fn(fn, dev, warmup=warm, iters=iters, cuda_graph=dev.type == "cuda")
        rows.append({"attention": name, "us": t.median_us, "cache MB read": nb / 1e6,
                     "GB/s": nb / t.median_s / 1e9, "rel_err vs bf16": relative_error(fn(), ref)})
    return rows


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
