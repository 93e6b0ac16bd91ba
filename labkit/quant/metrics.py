"""What a quantisation method costs and buys: held-out perplexity, per-layer output error, bytes actually held,
peak memory, decode step time, and the bytes-per-weight arithmetic that predicts the last three.

Bytes are *measured*: every tensor a layer keeps (packed codes, scales, zero-points, bitsandbytes quant states)
is counted once, so a format's overhead shows up instead of being assumed away.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from labkit.evaluate import perplexity, relative_error
from labkit.quant.bnb import bnb_tensors

BF16_BYTES = 2


# --- accuracy -----------------------------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def _heldout_ids(tokenizer) -> torch.Tensor:
    from labkit.data import split_tokens

    return split_tokens("heldout", tokenizer)


def heldout_perplexity(model: nn.Module, tokenizer, seq_len: int = 256, max_windows: int | None = None,
                       batch_size: int = 8, progress: bool = False) -> float:
    """Perplexity on the ``heldout`` split (never seen in training or calibration); ``max_windows`` scores only
    the first windows of ``seq_len + 1`` tokens (``None``: the whole split)."""
    return perplexity(model, _heldout_ids(tokenizer), seq_len=seq_len, batch_size=batch_size,
                      max_windows=max_windows, progress=progress)


@torch.no_grad()
def layer_errors(reference: nn.Module, quantised: nn.Module, input_ids: torch.Tensor) -> dict[str, float]:
    """Relative output error ``||layer_q(x) - layer(x)|| / ||layer(x)||`` of every quantised linear layer.

    ``x`` is the input each layer receives in the *reference* model on ``input_ids`` (int64 ``[batch, seq]``),
    so each number is that layer's own error, not the error accumulated by the layers before it.
    """
    names = [n for n, m in quantised.named_modules() if _is_quantised_linear(m)]
    if not names:
        raise ValueError("quantised holds no quantised linear layers; pass the output of labkit.quant.quantize")
    inputs: dict[str, torch.Tensor] = {}
    hooks = [reference.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: inputs.__setitem__(n, args[0].detach())) for n in names]
    try:
        reference(input_ids=input_ids.to(next(reference.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for n in names:
        x = inputs[n]
        out[n] = relative_error(quantised.get_submodule(n)(x.to(_device(quantised))).float(),
                                reference.get_submodule(n)(x).float())
    return out


def _device(model: nn.Module) -> torch.device:
    return next(t for t in [*model.parameters(), *model.buffers()]).device


def _is_quantised_linear(m: nn.Module) -> bool:
    from labkit.quant.fp8 import Fp8Linear
    from labkit.quant.weight_only import Int4Linear, Int8Linear

    if isinstance(m, Int8Linear | Int4Linear | Fp8Linear):
        return True
    return type(m).__name__ in ("Linear8bitLt", "Linear4bit")


# --- bytes --------------------------------------------------------------------------------------------------------
def _tensors(module: nn.Module) -> list[torch.Tensor]:
    ts = [*module.parameters(), *module.buffers()]
    for m in module.modules():
        ts += bnb_tensors(m)
    return ts


def bytes_held(module: nn.Module) -> int:
    """Bytes of every tensor ``module`` keeps (parameters, buffers, bitsandbytes states), each storage once."""
    seen, total = set(), 0
    for t in _tensors(module):
        key = (t.device, t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def linear_weight_bytes(model: nn.Module, names: list[str] | None = None) -> dict[str, float]:
    """Bytes held by the quantisable linear layers ``names`` (default: every quantised linear of ``model``),
    against the same weights in bf16: ``{"held", "bf16", "ratio", "params"}``."""
    if names is None:
        names = [n for n, m in model.named_modules() if _is_quantised_linear(m)]
        if not names:
            raise ValueError("model holds no quantised linear layers; pass names= to size plain linears")
    held = sum(bytes_held(model.get_submodule(n)) for n in names)
    params = sum(_layer_params(model.get_submodule(n)) for n in names)
    return {"held": held, "bf16": BF16_BYTES * params, "ratio": held / (BF16_BYTES * params), "params": params}


def _layer_params(m: nn.Module) -> int:
    """Weights (and bias) of a linear layer, plain or quantised, counted as logical elements."""
    n = m.in_features * m.out_features
    return n + (m.out_features if getattr(m, "bias", None) is not None else 0)


def bytes_per_weight(method: str, in_features: int = 4096, group_size: int = 128,
                     scale_bytes: int = BF16_BYTES) -> float:
    """Predicted bytes per weight of each format, scales and zero-points included (``bf16``/``fp32``: the
    unquantised baselines). bnb NF4: 4 bits + one 8-bit absmax per 64 weights + one fp32 per 256 absmax."""
    table = {
        "fp32": 4.0, "bf16": 2.0, "fp16": 2.0,
        "int8": 1.0 + scale_bytes / in_features,
        "int4": 0.5 + 2 * scale_bytes / group_size,
        "gptq": 0.5 + 2 * scale_bytes / group_size,
        "bnb-int8": 1.0 + 4 / in_features,
        "bnb-nf4": 0.5 + 1 / 64 + 4 / (64 * 256),
        "fp8": 1.0 + 4 / in_features,
    }
    if method not in table:
        raise ValueError(f"method={method!r} is unknown; allowed: {sorted(table)}")
    return table[method]


# --- memory and time ----------------------------------------------------------------------------------------------
def _status_bytes(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}; peak memory on the CPU needs Linux")
    return 1024 * int(m.group(1))


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> dict[str, int | str]:
    """Run ``fn`` once and return how far memory rose above where it started: ``{"peak_bytes", "how"}``.

    CUDA: the caching allocator's peak of allocated bytes. CPU (Linux): the process's peak resident set
    (``VmHWM``, reset through ``/proc/self/clear_refs``) over its resident set before; this counts pages
    actually touched, so it includes allocator slack and can under-count memory reused from earlier frees.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return {"peak_bytes": torch.cuda.max_memory_allocated(dev) - before, "how": "cuda_max_memory_allocated"}
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        raise RuntimeError("peak memory on the CPU needs a writable /proc/self/clear_refs (Linux)") from e
    before = _status_bytes("VmRSS")
    fn()
    return {"peak_bytes": max(0, _status_bytes("VmHWM") - before), "how": "cpu_peak_rss_growth"}


def decode_step_time(model: nn.Module, batch_size: int = 1, context_len: int = 512, cuda_graph: bool = True,
                     iters: int = 20):
    """``labkit.bench.Timing`` of one decode forward over a static KV cache (a CUDA-graph replay on CUDA when
    ``cuda_graph``; eager elsewhere), via ``labkit.decode_step.time_decode_step``."""
    from labkit.decode_step import time_decode_step

    return time_decode_step(model, batch_size=batch_size, context_len=context_len, cuda_graph=cuda_graph,
                            iters=iters)
