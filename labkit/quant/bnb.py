"""bitsandbytes layers: LLM.int8 (``Linear8bitLt``) and NF4 with double quantisation (``Linear4bit``).

LLM.int8 (Dettmers et al. 2022) quantises weights per row to int8 and activations per token to int8, but
first pulls out the input features holding any activation above ``threshold`` (6.0 in the paper) and multiplies
those in 16 bits: the rare outlier features of large models are what breaks plain int8 activations. NF4 (QLoRA,
Dettmers et al. 2023) stores weights in 4-bit codes whose 16 levels are the quantiles of a normal
distribution (blocks of 64 weights, one absmax each); double quantisation stores those absmax values
themselves in 8 bits (blocks of 256), saving ~0.37 bits per weight. Both run on the CPU in bitsandbytes
0.50.2 and on CUDA.
"""

from __future__ import annotations

import logging

import torch
from torch import nn


class _DropCastNotice(logging.Filter):
    """bitsandbytes logs "inputs will be cast from float32 to float16" on *every* LLM.int8 matmul with float32
    inputs (thousands of lines per evaluation); LLM.int8 always computes in fp16, so the notice says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will be cast from" not in record.getMessage()


def _quiet_cast_notice() -> None:
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropCastNotice) for f in log.filters):
        log.addFilter(_DropCastNotice())


def require_bitsandbytes():
    """``bitsandbytes``, or an ImportError saying how to get it."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise ImportError("methods 'bnb-int8' and 'bnb-nf4' need bitsandbytes (pip install bitsandbytes; the "
                          "H200 image brings it as a wheel: tools/gpu-wheels.sh)") from e
    return bitsandbytes


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=False)


def bnb_int8_linear(linear: nn.Linear, threshold: float = 6.0) -> nn.Module:
    """``linear`` as a ``bitsandbytes.nn.Linear8bitLt`` (int8 weights, int8 matmul with fp16 outlier features
    above ``threshold``; ``threshold=0`` turns the decomposition off), on ``linear``'s device."""
    bnb = require_bitsandbytes()
    if not threshold >= 0:
        raise ValueError(f"threshold={threshold} must be >= 0 (6.0 is LLM.int8's; 0 disables outliers)")
    _quiet_cast_notice()
    w = linear.weight
    # built on the meta device so no throw-away float weight is allocated; quantised by .to(device)
    mod = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              has_fp16_weights=False, threshold=threshold, device="meta")
    # Int8Params quantises when moved off the CPU (or .to("cpu") on the CPU), so it starts there
    mod.weight = bnb.nn.Int8Params(w.detach().cpu().clone(), requires_grad=False, has_fp16_weights=False)
    mod.bias = _frozen(linear.bias)
    return mod.to(w.device)


def bnb_nf4_linear(linear: nn.Linear, double_quant: bool = True, blocksize: int = 64,
                   compute_dtype: torch.dtype | None = None) -> nn.Module:
    """``linear`` as a ``bitsandbytes.nn.Linear4bit`` in NF4 (``blocksize`` weights per absmax; absmax values
    quantised again when ``double_quant``), computing in ``compute_dtype`` (default the weight's dtype)."""
    bnb = require_bitsandbytes()
    if blocksize not in (64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"blocksize={blocksize} is not one bitsandbytes supports; "
                         "allowed: 64, 128, ..., 4096")
    w = linear.weight
    mod = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=compute_dtype or w.dtype, compress_statistics=double_quant,
                            quant_type="nf4", device="meta")
    mod.weight = bnb.nn.Params4bit(w.detach().cpu().clone(), requires_grad=False, quant_type="nf4",
                                   compress_statistics=double_quant, blocksize=blocksize)
    mod.bias = _frozen(linear.bias)
    return mod.to(w.device)


def bnb_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors bitsandbytes keeps outside parameters and buffers: int8 row scales (``SCB``) and NF4 quant
    states (absmax, code book, offset, and the second-level state of double quantisation)."""
    out = []
    for p in module.parameters(recurse=False):
        if getattr(p, "SCB", None) is not None:
            out.append(p.SCB)
        state = getattr(p, "quant_state", None)
        while state is not None:
            parts = (state.absmax, state.code, getattr(state, "offset", None))
            out += [t for t in parts if torch.is_tensor(t)]
            state = getattr(state, "state2", None)
    return out
