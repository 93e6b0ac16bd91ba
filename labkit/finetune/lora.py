"""LoRA and QLoRA written out: a low-rank adapter beside a frozen linear layer, optionally over NF4 weights.

LoRA (Hu et al. 2021) keeps a pretrained weight ``W`` [out, in] frozen and learns a rank-``r`` update:

    y = x W^T + (alpha / r) * (x A^T) B^T        A: [r, in], B: [out, r]

``A`` starts random and ``B`` at zero, so the adapted model is the pretrained one at step 0. Only ``A`` and ``B``
train: ``r * (in + out)`` parameters per layer instead of ``in * out``, and so only they carry gradients and
optimizer state. QLoRA (Dettmers et al. 2023) stores the frozen ``W`` in 4-bit NormalFloat (NF4) with double
quantisation of its scales (bitsandbytes ``Linear4bit``) and adds the same adapters in higher precision.

Why our own layer rather than ``peft``: the whole technique is the two matmuls in ``LoRALinear.forward``; writing
them out is the lesson, and it keeps one fewer library (and its version skew between the CPU and GPU images)
out of the path. The parameter names (``lora_A``, ``lora_B``, ``scaling``) follow peft's, so the ideas carry over.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Every linear layer inside a Llama decoder layer (the QLoRA paper's choice: adapt all of them, not only q and v).
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Llama linear layers LoRA can target."""


def _is_linear4bit(module: nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(module, bnb.nn.Linear4bit)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update.

    ``base``: ``nn.Linear`` or bitsandbytes ``Linear4bit`` mapping [..., in_features] to [..., out_features];
    its parameters are frozen here. ``lora_A`` [rank, in_features] and ``lora_B`` [out_features, rank] are float32
    parameters on the base's device (float32 master copies; autocast runs their matmuls in bf16 when enabled).
    """

    def __init__(self, base: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0) -> None:
        super().__init__()
        if not (isinstance(base, nn.Linear) or _is_linear4bit(base)):
            raise TypeError(f"base must be nn.Linear or bitsandbytes Linear4bit, got {type(base).__name__}")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r} must be a positive int")
        if rank > min(base.in_features, base.out_features):
            raise ValueError(f"rank={rank} must be at most min(in_features, out_features)="
                             f"{min(base.in_features, base.out_features)}: a larger rank adds no capacity")
        if alpha <= 0:
            raise ValueError(f"alpha={alpha} must be positive")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank  # alpha / r keeps the update's size steady when r changes
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init, as in the paper's code
        # p = 0 makes nn.Dropout an identity that saves nothing for backward
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in the base layer's output dtype."""
        y = self.base(x)
        a = self.dropout(x)
        if a.dtype != self.lora_A.dtype and not torch.is_autocast_enabled(a.device.type):
            a = a.to(self.lora_A.dtype)  # a bf16 base outside autocast: run the fp32 adapter in fp32
        update = F.linear(F.linear(a, self.lora_A), self.lora_B)
        return y + self.scaling * update.to(y.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The dense update ``scaling * B A`` [out_features, in_features] in float32."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def extra_repr(self) -> str:
        kind = "nf4" if _is_linear4bit(self.base) else "dense"
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}, base={kind}"


def _decoder_linears(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every target linear inside the decoder layers, checked by name."""
    targets = tuple(targets)
    if not targets:
        raise ValueError(f"targets is empty; allowed: a non-empty subset of {list(LLAMA_LINEARS)}")
    unknown = [t for t in targets if t not in LLAMA_LINEARS]
    if unknown:
        raise ValueError(f"targets {unknown} are unknown; allowed: a subset of {list(LLAMA_LINEARS)}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers; expected a Hugging Face Llama-family model")
    found = []
    for layer in layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in targets:
                if hasattr(parent, name):
                    found.append((parent, name, getattr(parent, name)))
    if len(found) != len(layers) * len(targets):
        raise ValueError(f"expected {len(targets)} target linears in each of {len(layers)} layers, found "
                         f"{len(found)} in all; targets={list(targets)}")
    return found


def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: tuple[str, ...] = LLAMA_LINEARS) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each target linear of its decoder layers in ``LoRALinear``.

    In place; returns ``model``. Embeddings, norms and the LM head stay frozen and unadapted. After this, the
    only parameters with ``requires_grad`` are the adapters' ``lora_A`` and ``lora_B``.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, name, module in _decoder_linears(model, targets):
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} already holds a LoRALinear; apply_lora once per model")
        setattr(parent, name, LoRALinear(module, rank=rank, alpha=alpha, dropout=dropout))
    return model


def quantize_nf4(model: nn.Module, targets: tuple[str, ...] = LLAMA_LINEARS,
                 compute_dtype: torch.dtype = torch.float32, double_quant: bool = True) -> nn.Module:
    """Replace each target ``nn.Linear`` of the decoder layers by a bitsandbytes NF4 ``Linear4bit`` (frozen).

    In place; returns ``model``. ``double_quant`` quantises the per-64-weight absmax scales to 8 bits as well
    (QLoRA's "double quantisation"): about 0.5 + 1/64 + 4/(64*256) bytes per weight instead of 0.5 + 4/64.
    ``compute_dtype`` is the dtype the weight is dequantised to for the matmul (bf16 on the GPU).
    """
    from labkit.quant import bnb_nf4_linear

    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype={compute_dtype} must be torch.float32, torch.bfloat16 or torch.float16")
    for parent, name, module in _decoder_linears(model, targets):
        if not isinstance(module, nn.Linear) or _is_linear4bit(module):
            raise TypeError(f"{name} is {type(module).__name__}; quantize_nf4 must run once, before apply_lora, "
                            f"on plain nn.Linear layers")
        q = bnb_nf4_linear(module, double_quant=double_quant, compute_dtype=compute_dtype)
        # On CPUs with AVX512-BF16, bitsandbytes repacks an NF4 weight for a faster kernel the first time the
        # layer runs in eval mode without gradients, for good; that kernel has no backward, so training after an
        # evaluation would get wrong gradients (with only a warning). Training layers keep the autograd path.
        q.support_avx512bf16_for_cpu = False
        setattr(parent, name, q)
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each dense ``LoRALinear`` into its base weight (``W += scaling * B A``) and put the plain
    ``nn.Linear`` back: after merging, inference costs exactly what the base model costs. In place.

    NF4 bases cannot absorb a float update without requantising (which loses it), so they are refused.
    """
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, module in list(parent.named_children()):
                if isinstance(module, LoRALinear):
                    if _is_linear4bit(module.base):  # (Linear4bit subclasses nn.Linear)
                        raise TypeError(f"{name}: cannot merge into an NF4 base; dequantise it first or keep the "
                                        f"adapter separate")
                    w = module.base.weight
                    w.add_(module.delta_weight().to(w.dtype))
                    setattr(parent, name, module.base)
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters with ``requires_grad`` (tied weights once)."""
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; an NF4 weight counts its logical [out, in] size, not its bytes."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        qs = getattr(p, "quant_state", None)
        n = math.prod(qs.shape) if qs is not None else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total
