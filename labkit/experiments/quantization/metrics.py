"""What a quantisation method costs and buys: held-out perplexity, per-layer output error, bytes actually held,
peak memory, decode step time, and the bytes-per-weight arithmetic that predicts the last three.

Bytes are *measured*: every tensor a layer keeps (packed codes, scales, zero-points, bitsandbytes quant states)
is counted once, so a format's overhead shows up instead of being assumed away.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from torch import nn

from labkit.evaluate import perplexity, relative_error
from labkit.quant import Fp8Linear, Int4Linear, Int8Linear, bnb_tensors

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
        # the same storage viewed twice (tied weights) counts once; meta tensors have no address, only identity
        key = id(t) if t.device.type == "meta" else (t.device, t.data_ptr(), t.numel())
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


def decode_weight_bytes(spec, method: str, group_size: int = 128, lm_head: bool | str = False) -> float:
    """Predicted weight bytes one decode step reads for a ``labkit.model.ModelConfig`` (or preset name) with its
    linear layers in ``method``: the decoder's linears at ``bytes_per_weight``, the LM head in bf16 unless
    ``lm_head`` (True: in ``method`` too; a method name: in that one), norms in bf16; the embedding contributes one
    row per token (nothing, to this precision)."""
    from labkit.model import get_config

    spec = get_config(spec)
    linear = spec.num_layers * (spec.attn_params_per_layer + spec.mlp_params_per_layer)
    head = spec.vocab_size * spec.hidden_size
    bpw = bytes_per_weight(method, in_features=spec.hidden_size, group_size=group_size)
    norms = (spec.num_layers * spec.norm_params_per_layer + spec.hidden_size) * BF16_BYTES
    head_method = method if lm_head is True else (lm_head or None)
    head_bpw = bytes_per_weight(head_method, spec.hidden_size, group_size) if head_method else BF16_BYTES
    return linear * bpw + head * head_bpw + norms


def model_decode_bytes(model: nn.Module, batch_size: int = 1, context_len: int = 512) -> int:
    """Bytes one decode step must read from memory, *measured* on ``model`` as it is held: every weight it keeps
    (quantised codes, scales and states included) except an untied embedding table (one row per token is
    read), plus the KV cache of ``batch_size`` sequences of ``context_len`` tokens in the model's dtype."""
    from labkit.model import dtype_name, get_config

    spec = get_config(model)
    held = bytes_held(model)
    embed = model.get_input_embeddings().weight
    if embed is not getattr(model.get_output_embeddings(), "weight", None):  # untied: not read in full
        held -= embed.numel() * embed.element_size()
    return held + batch_size * int(spec.kv_bytes(context_len, dtype_name(model.dtype)))


# --- memory and time ----------------------------------------------------------------------------------------------
def _cpu_alloc_peak(fn: Callable[[], object]) -> int:
    """Peak of live tensor bytes allocated by ``fn`` on the CPU, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_allocated(fn: Callable[[], object], device: torch.device | str = "cpu") -> dict[str, int | str]:
    """Run ``fn`` once and return the peak of tensor memory it allocated above what was live before:
    ``{"peak_bytes", "how"}``. CUDA: the caching allocator's ``max_memory_allocated``. CPU: the same quantity
    rebuilt from ``torch.profiler``'s allocation events (the CPU allocator keeps no peak statistic, and the
    process's resident set hides small allocations that reuse freed pages)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return {"peak_bytes": torch.cuda.max_memory_allocated(dev) - before, "how": "cuda_max_memory_allocated"}
    if dev.type != "cpu":
        raise ValueError(f"device={device!r}: peak memory is measured on 'cpu' or 'cuda'")
    return {"peak_bytes": _cpu_alloc_peak(fn), "how": "cpu_profiler_allocations"}


def hf_decode_step_time(model: nn.Module, batch_size: int = 1, context_len: int = 512, cuda_graph: bool = True,
                     iters: int = 20, breakdown: int = 0):
    """``labkit.bench.Timing`` of one decode forward over a static KV cache (a CUDA-graph replay on CUDA when
    ``cuda_graph``; eager elsewhere), via ``labkit.experiments.decode_step.time_decode_step`` (``breakdown``: its kernel
    profile in ``extra["breakdown"]``)."""
    from labkit.experiments.decode_step import time_decode_step

    return time_decode_step(model, batch_size=batch_size, context_len=context_len, cuda_graph=cuda_graph,
                            iters=iters, breakdown=breakdown)
