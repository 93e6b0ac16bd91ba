"""The ops of the paged forward, each run by the kernel its ``FusionPlan`` field names: the model applies the plan
(resolved once, by ``CausalLM.use``) here, by plain calls (no lookup by name, no module switch, no decision again).

* ``add_norm``: ``[residual +] h`` then RMSNorm (``plan.norm``: 'triton' is one fused kernel, ``rms_norm(h, w, eps,
  residual=r)``)
* ``rope_and_write``: RoPE on q and k, then k and v into the paged cache (``plan.rope``; ``rope_cache_write``: one
  kernel for both, ``apply_rope_and_cache``, with a cache stored in the activations' dtype)
* ``act_and_mul``: the gated MLP's ``act(gate) * up`` (``plan.activation``: ``silu_and_mul``)
* ``qkv_projection``: the merged int8/int4 q/k/v projection with its RMSNorm, RoPE and the cache write in its
  store (``plan.qkv_rope_cache``). The other int8/int4 projections take their epilogue (the RMSNorm before, the
  residual add after, SwiGLU of the input) as arguments of their own forward (``plan.quant_epilogues``;
  ``labkit.quant.weight_only``); whether the model runs them so is the plan's (``epilogue_ready``, at resolution).

Every torch expression rounds as the family's HF module does, so the torch plan's greedy output equals HF's.

Which kernel ran is observable: each op appends a ``KernelCall`` to the ``KernelLog`` it is handed (``log``; the
step's ``ModelInput.kernel_log``, set by ``ModelRunner(kernel_log=...)`` or ``ModelInput.build``), or to nothing
(``labkit.kernels.common``: the quantised matmuls record their launches in one too).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.kernels.common import KernelLog
from labkit.kvcache.paged import PagedKVCache
from labkit.model.fusion import FusionPlan
from labkit.model.rotary import rotate
from labkit.quant.weight_only import Int4Linear, Int8Linear

EPILOGUE_LINEARS = (Int8Linear, Int4Linear)
"""The linears whose GEMVs take their epilogue as arguments (``forward(x, norm=, residual=, swiglu=)``) and have a
q/k/v GEMV with RoPE and the cache write (``qkv_kernel``)."""


def _note(log: KernelLog | None, op: str, kernel: str, fused=(), pdl: str = "") -> None:
    if log is not None:
        log.record(op, kernel, fused, pdl)


def add_norm(norm: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, plan: FusionPlan,
             log: KernelLog | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + h), residual + h)`` (``residual`` None: ``(norm(h), h)``)."""
    _note(log, "norm", "rms_norm" if plan.norm == "triton" else "torch", () if residual is None else ("residual",))
    if plan.norm == "triton":
        from labkit.kernels.rms_norm import rms_norm

        if residual is None:
            return rms_norm(h, norm.weight, norm.eps), h
        return rms_norm(h, norm.weight, norm.eps, residual=residual)
    if residual is not None:
        h = residual + h
    return norm(h), h


def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: PagedKVCache, layer: int, slot_mapping: torch.Tensor,
                   plan: FusionPlan, log: KernelLog | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q`` ``[T, heads, D]`` and ``k`` ``[T, kv_heads, D]``; the rotated ``k`` and ``v`` written at
    ``slot_mapping`` of ``layer``. Returns the rotated ``(q, k)``."""
    if plan.rope == "triton":
        if plan.rope_cache_write:  # resolved for a cache stored in the activations' dtype (CausalLM.use)
            from labkit.kernels.rope import apply_rope_and_cache

            _note(log, "rope", "apply_rope_and_cache", ("cache",))
            return apply_rope_and_cache(q, k, v, cos, sin, cache.k_caches[layer], cache.v_caches[layer],
                                        slot_mapping)
        from labkit.kernels.rope import apply_rope as rope_kernel

        _note(log, "rope", "apply_rope")
        q, k = rope_kernel(q, k, cos, sin)
    else:
        _note(log, "rope", "torch")
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    cache.write(layer, slot_mapping, k, v, check=False)  # slots from the engine's allocator; a check syncs per layer
    return q, k


def act_and_mul(act, gate_up: torch.Tensor, plan: FusionPlan, log: KernelLog | None = None) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up`` ``[..., 2 * I]`` = ``[gate | up]``."""
    _note(log, "activation", "silu_and_mul" if plan.activation == "triton" else "torch")
    if plan.activation == "triton":
        from labkit.kernels.silu_and_mul import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def epilogue_ready(linears: list[nn.Module | None], device: torch.device) -> bool:
    """Whether every one of ``linears`` is labkit's int8/int4 linear running its kernels on ``device`` (what the
    epilogue fusions need; None: a layer the model's weight layout does not have)."""
    return all(type(m) in EPILOGUE_LINEARS and m.uses_kernels(device) for m in linears)


def peers_take(linears: list[nn.Module], rows: int) -> bool:
    """Whether a kernel table (``labkit.quant.dispatch``) hands ``rows`` rows of any of ``linears`` to a peer
    kernel: then the neighbours cannot be folded into labkit's GEMV, and the layer runs unfused."""
    return any(getattr(m, "dispatch", None) is not None and m.dispatch.takes(rows) for m in linears)


def qkv_projection(lin: nn.Module, x: torch.Tensor, norm: nn.Module, num_heads: int, cos: torch.Tensor,
                   sin: torch.Tensor, cache: PagedKVCache, layer: int, slot_mapping: torch.Tensor,
                   pdl: str = "", log: KernelLog | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm``, the merged bias-free q/k/v projection ``lin``, RoPE and the cache write of ``layer`` in one kernel
    at decode batch 1 (``w4a16_qkv_rope_cache`` / ``w8a16_qkv_rope_cache``). Returns the rotated ``(q, k)``."""
    kernel = lin.qkv_kernel
    _note(log, "qkv_projection", kernel.__name__, ("norm", "rope", "cache"), pdl)
    return kernel(x, *lin.weights(), num_heads, cos, sin, cache.k_caches[layer], cache.v_caches[layer],
                  slot_mapping, norm_weight=norm.weight, norm_eps=norm.eps, pdl=pdl,
                  **({} if lin.tuning is None else {"tuning": lin.tuning}))
