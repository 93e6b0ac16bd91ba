"""The int8 / fp8 KV trade-off, measured: accuracy on the embedded model, memory per token, attention latency.

Accuracy runs the real model on the paged cache with every query attending to K/V read back from the cache
(``PagedModelRunner``), so a quantised format affects every scored token the way it would during decoding.
The unquantised run (the model's own dtype) is the reference for both perplexity and the logit error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from labkit.kvcache.attention import decode_attention, dequantised_blocks
from labkit.kvcache.model import PagedModelRunner, prepare_step
from labkit.kvcache.paged import PagedKVCache


@torch.no_grad()
def kv_format_accuracy(model, token_ids: torch.Tensor, kv_dtypes: Sequence[str] = ("int8", "fp8"),
                       seq_len: int = 256, max_windows: int | None = None, batch_size: int = 4,
                       block_size: int = 16, spread: bool = False, progress: bool = False) -> dict[str, dict]:
    """Perplexity and logit error of ``model`` with its KV cache stored in each of ``kv_dtypes``.

    ``token_ids`` (1-D) is cut into windows of ``seq_len + 1`` tokens exactly as ``labkit.evaluate.perplexity``
    does (each window predicts its last ``seq_len`` tokens); ``max_windows`` keeps the first windows, or with
    ``spread`` that many evenly spaced over the whole stream (text difficulty varies along it).

    Returns, per format and for ``"reference"`` (the model's dtype): ``ppl``, ``logit_rel_err``
    (``||logits - ref|| / ||ref||`` over every scored position), ``top1_agree`` (fraction of positions whose
    argmax equals the reference's), ``bytes_per_token`` and ``scored_tokens``.
    """
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    total = (len(token_ids) - 1) // seq_len
    if total < 1:
        raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than one window of seq_len+1={seq_len + 1}")
    n_windows = total if max_windows is None else min(total, max_windows)
    picks = [j * total // n_windows for j in range(n_windows)] if spread else list(range(n_windows))
    ref_dtype = next(model.parameters()).dtype
    names = ["reference", *kv_dtypes]
    runners = {name: PagedModelRunner(model, PagedKVCache.for_model(
        model, num_blocks=batch_size * -(-seq_len // block_size), block_size=block_size,
        kv_dtype=ref_dtype if name == "reference" else name)) for name in names}
    acc = {name: {"nll": 0.0, "diff2": 0.0, "agree": 0} for name in names}
    ref2, count = 0.0, 0
    for i in tqdm(range(0, n_windows, batch_size), desc="kv formats", disable=not progress):
        rows = [token_ids[j * seq_len:(j + 1) * seq_len + 1] for j in picks[i:i + batch_size]]
        targets = torch.cat([r[1:] for r in rows]).to(next(model.parameters()).device)
        ref = None
        for name in names:
            logits = _window_logits(runners[name], [r[:-1].tolist() for r in rows])
            acc[name]["nll"] += F.cross_entropy(logits, targets, reduction="sum").item()
            if ref is None:
                ref = logits
            acc[name]["diff2"] += (logits.double() - ref.double()).pow(2).sum().item()
            acc[name]["agree"] += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        ref2 += ref.double().pow(2).sum().item()
        count += targets.numel()
    return {name: {"ppl": math.exp(a["nll"] / count), "logit_rel_err": math.sqrt(a["diff2"] / ref2),
                   "top1_agree": a["agree"] / count, "bytes_per_token": runners[name].cache.bytes_per_token,
                   "scored_tokens": count}
            for name, a in acc.items()}


def _window_logits(runner: PagedModelRunner, windows: list[list[int]]) -> torch.Tensor:
    """Prefill every window as its own sequence in one flat batch; float32 logits ``[sum(len), vocab]``."""
    cache = runner.cache
    ids = list(range(len(windows)))
    for sid, w in zip(ids, windows, strict=True):
        cache.allocate(sid, w)
    try:
        return runner.forward(prepare_step(cache, ids), all_logits=True)
    finally:
        for sid in ids:
            cache.free(sid)


def attention_latency(kv_dtype: str, num_seqs: int, context_len: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", backend: str = "auto", fused: bool = True,
                      iters: int = 20, seed: int = 0):
    """Time one layer's decode attention over a paged cache stored in ``kv_dtype``, the way the runner does it.

    Quantised formats go to ``decode_attention`` with their scales (``fused``: the Triton kernel on CUDA reads
    8-bit K/V and dequantises in registers; the torch path dequantises first), or, with ``fused=False``, are
    always dequantised to ``dtype`` (the blocks the batch names) before the attention.
    Returns ``(timing, bytes_read)``: a ``labkit.bench.Timing`` and the cache bytes one call must read (K, V and
    scales of ``num_seqs * context_len`` tokens), the floor against which the time is judged.
    """
    from labkit.bench import time_fn

    g = torch.Generator(device=device).manual_seed(seed)  # random K/V drawn where they live
    blocks_per_seq = -(-context_len // block_size)
    cache = PagedKVCache(1, num_kv_heads, head_dim, num_blocks=num_seqs * blocks_per_seq, block_size=block_size,
                         kv_dtype=kv_dtype, device=device)
    ids = list(range(num_seqs))
    for sid in ids:
        cache.allocate(sid, [0] * context_len)
        slots = torch.tensor(cache.slots(sid, 0, context_len), device=device)
        k, v = (torch.randn(context_len, num_kv_heads, head_dim, generator=g, device=device).to(dtype) for _ in "kv")
        cache.write(0, slots, k, v)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g, device=device).to(dtype)
    tables, lens = cache.block_tables(ids), cache.context_lens(ids)

    quant = cache.fmt.quantised
    scales = {"k_scale": cache.k_scales[0], "v_scale": cache.v_scales[0]} if quant else {}

    def step():
        if fused and (quant or cache.fmt.storage_dtype == dtype):
            return decode_attention(q, cache.k_caches[0], cache.v_caches[0], tables, lens, backend=backend, **scales)
        k_cache, v_cache, t = dequantised_blocks(cache, 0, tables, dtype)
        return decode_attention(q, k_cache, v_cache, t, lens, backend=backend)

    bytes_read = num_seqs * context_len * cache.bytes_per_token
    return time_fn(step, device=device, warmup=2, iters=iters), bytes_read
