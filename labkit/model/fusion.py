"""``FusionPlan``: which kernel runs each op of the model, as data the engine reads (no module-level switches).

Each op is 'torch' (the reference expression, every family, every device) or 'triton' (``labkit.kernels``):

==============  ===========================================================================================
field           'triton' means
==============  ===========================================================================================
norm            ``rms_norm`` (with the residual add fused in: ``rms_norm(x, w, eps, residual=r)``)
rope            ``apply_rope``; with ``rope_cache_write`` also the K/V cache write (``apply_rope_and_cache``)
attention       ``paged_attention`` (all-decode steps) and ``paged_prefill_attention`` (steps with a prefill)
activation      ``silu_and_mul`` on the merged gate/up output
==============  ===========================================================================================

and the fusions across ops: ``quant_epilogues`` (int8/int4 layers take in their neighbours: RMSNorm inside the
projection after it, the residual add inside the one before it, SwiGLU inside down), ``qkv_rope_cache`` (RoPE and the
cache write in the q/k/v GEMV's store) and ``gemv_pdl`` (the GEMVs as programmatic dependent launches, sm_90). The
weight layout (merged q/k/v and gate/up) is not the plan's: it is fixed when the model is built (``merge_qkv`` /
``merge_gate_up`` of ``labkit.model.build``).

A plan is resolved once, by ``resolve_plan`` (called by ``CausalLM.use``, the one path), into the plan a model runs:
what its family (``conflicts``), its layers or its cache (``CausalLM.use``) cannot run turned back to torch / off with
what needs it (``without``); nothing decides again while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from labkit.model.config import ModelConfig

KERNELS = ("torch", "triton")
"""Kernel sets a FusionPlan may choose per op."""
KERNEL_NAMES = ("auto", "torch", "triton")
"""Names ``FusionPlan.named`` turns into a plan ('auto': Triton on CUDA, torch on the CPU)."""
_OPS = ("norm", "rope", "attention", "activation")
_NEEDS = {"rope_cache_write": "rope", "qkv_rope_cache": "quant_epilogues", "gemv_pdl": "quant_epilogues"}
"""A fusion -> the field it needs on (``without`` turns it off with that field)."""


@dataclass(frozen=True)
class FusionPlan:
    """Kernel per op and the fusions across ops (module docstring); the default is all torch."""

    norm: str = "torch"
    rope: str = "torch"
    attention: str = "torch"
    activation: str = "torch"
    rope_cache_write: bool = False
    quant_epilogues: bool = False
    qkv_rope_cache: bool = False
    gemv_pdl: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _OPS:
                if v not in KERNELS:
                    raise ValueError(f"{f.name}={v!r} is unknown; allowed: {KERNELS}")
            elif not isinstance(v, bool):
                raise ValueError(f"{f.name}={v!r} must be True or False")
        for name, need in _NEEDS.items():
            if getattr(self, name) and getattr(self, need) in ("torch", False):
                raise ValueError(f"{name}=True needs {need}" + ("='triton'" if need in _OPS else ""))

    @classmethod
    def triton(cls, pdl: bool = True) -> FusionPlan:
        """Every op in Triton, RoPE fused with the cache write, the int8/int4 epilogue fusions (which apply only to
        a model whose projections are labkit's int8/int4 linears) and, with ``pdl``, their launches chained."""
        return cls(norm="triton", rope="triton", attention="triton", activation="triton", rope_cache_write=True,
                   quant_epilogues=True, qkv_rope_cache=True, gemv_pdl=pdl)

    @classmethod
    def for_device(cls, device: str | torch.device) -> FusionPlan:
        """The default plan: torch on the CPU; on CUDA ``triton()`` (PDL on sm_90 and newer)."""
        dev = torch.device(device)
        return cls.triton(torch.cuda.get_device_capability(dev)[0] >= 9) if dev.type == "cuda" else cls()

    @classmethod
    def named(cls, kernels: str | FusionPlan, device: str | torch.device) -> FusionPlan:
        """``kernels`` as a plan: a ``FusionPlan`` as given, or a name of ``KERNEL_NAMES``: 'auto' (``for_device``),
        'torch' (``FusionPlan()``) or 'triton' (``triton()``, on the CPU through the interpreter)."""
        if check_kernels(kernels) == "auto":
            return cls.for_device(device)
        return {"torch": cls, "triton": cls.triton}[kernels]() if isinstance(kernels, str) else kernels

    @property
    def uses_triton(self) -> bool:
        """Whether any op runs a Triton kernel."""
        return any(getattr(self, op) == "triton" for op in _OPS)

    def conflicts(self, config: ModelConfig) -> dict[str, str]:
        """The fields this plan sets that ``config``'s family cannot run, each with the reason."""
        out = {}
        if config.norm_offset and self.norm == "triton":
            out["norm"] = f"{config.model_type}'s RMSNorm is x * (1 + w); the Triton rms_norm computes x * w"
        if config.norm_offset and self.quant_epilogues:
            out["quant_epilogues"] = "the fused epilogues fold an x * w RMSNorm"
        if config.hidden_act != "silu":
            for name in ("activation", "quant_epilogues"):
                if getattr(self, name) not in ("torch", False):
                    out[name] = f"hidden_act={config.hidden_act!r}: the kernels fuse SiLU only"
        if config.rotary_dim != config.head_dim:
            for name in ("rope", "rope_cache_write", "qkv_rope_cache"):
                if getattr(self, name) not in ("torch", False):
                    out[name] = f"partial rotary (rotary_dim={config.rotary_dim} of {config.head_dim})"
        if config.sliding_window is not None:
            if self.attention == "triton":
                out["attention"] = f"sliding_window={config.sliding_window}: the attention kernels have no window"
        if self.qkv_rope_cache and (config.qk_norm or config.qkv_bias):
            out["qkv_rope_cache"] = "q/k norm or q/k/v bias sits between the GEMV and RoPE"
        return out

    def check(self, config: ModelConfig, device: str | torch.device | None = None,
              dtype: torch.dtype | None = None) -> None:
        """Raise ``ValueError`` naming every field ``config`` cannot run (and Triton attention in bf16 on the CPU,
        whose interpreter gets ``tl.dot`` on bf16 wrong)."""
        bad = self.conflicts(config)
        if device is not None and torch.device(device).type == "cpu" and dtype == torch.bfloat16 \
                and self.attention == "triton":
            bad["attention"] = "Triton's CPU interpreter computes tl.dot on bf16 wrongly; use fp32/fp16 or 'torch'"
        if bad:
            raise ValueError("FusionPlan does not fit model_type=" + repr(config.model_type) + ": "
                             + "; ".join(f"{k}: {v}" for k, v in bad.items()))

    def without(self, *names: str) -> FusionPlan:
        """This plan with the fields ``names`` turned back to torch / off, and every fusion that needs one of them
        (``rope_cache_write`` needs Triton RoPE; ``qkv_rope_cache`` and ``gemv_pdl`` need ``quant_epilogues``)."""
        unknown = sorted(set(names) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"{unknown} are not FusionPlan fields; allowed: {[f.name for f in fields(self)]}")
        off = set(names) | {n for n, need in _NEEDS.items() if need in names}
        return replace(self, **{k: ("torch" if k in _OPS else False) for k in off})

    def fit(self, config: ModelConfig) -> FusionPlan:
        """This plan with every field ``config`` cannot run turned back to torch / off (and what depends on it)."""
        return self.without(*self.conflicts(config))


def check_kernels(kernels) -> str | FusionPlan:
    """``kernels`` if it is a ``FusionPlan`` or one of ``KERNEL_NAMES`` (a ``ValueError`` naming them otherwise)."""
    if not isinstance(kernels, FusionPlan) and kernels not in KERNEL_NAMES:
        raise ValueError(f"kernels={kernels!r} is unknown; allowed: a FusionPlan or one of {KERNEL_NAMES}")
    return kernels


def resolve_plan(kernels: str | FusionPlan, config: ModelConfig, device: str | torch.device,
            dtype: torch.dtype | None = None, unfit: dict[str, str] | None = None) -> FusionPlan:
    """The plan a model runs: ``kernels`` (``named``) without what ``config``'s family cannot run nor the fields
    ``unfit`` names (field -> why: what the model's layers or cache cannot run), checked for ``device`` and ``dtype``
    (``check``). ``CausalLM.use`` calls it, once per model it returns; nothing else does."""
    plan = FusionPlan.named(kernels, device)
    plan = plan.without(*plan.conflicts(config), *(unfit or {}))
    plan.check(config, device, dtype)
    return plan
