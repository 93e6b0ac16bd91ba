"""Notebook 07 (fine-tuning): the LoRA forward, and merging the adapter into the base weight.

Solutions: labkit's ``LoRALinear`` (``labkit.finetune.lora``): ``y = x W^T + b + (alpha / r) * x A^T B^T`` with
``A`` [r, in] and ``B`` [out, r], and its ``delta_weight`` for the merge.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.exercises.core import Case, Exercise, register, tensor_diff
from labkit.finetune.lora import LoRALinear


def _lora_layer(weight, bias, lora_a, lora_b, alpha) -> LoRALinear:
    base = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        base.weight.copy_(weight)
        if bias is not None:
            base.bias.copy_(bias)
    layer = LoRALinear(base, rank=lora_a.shape[0], alpha=alpha)
    with torch.no_grad():
        layer.lora_A.copy_(lora_a)
        layer.lora_B.copy_(lora_b)
    return layer


@torch.no_grad()
def lora_forward(x, weight, bias, lora_a, lora_b, alpha):
    """Solution: ``x`` [..., in] -> [..., out] through the frozen ``weight`` [out, in] (+ ``bias``) and the adapter
    ``lora_a`` [r, in], ``lora_b`` [out, r] scaled by ``alpha / r``."""
    return _lora_layer(weight, bias, lora_a, lora_b, alpha)(x)


@torch.no_grad()
def lora_merge(weight, lora_a, lora_b, alpha):
    """Solution: the weight [out, in] that computes the same as base + adapter in one matmul."""
    return weight + _lora_layer(weight, None, lora_a, lora_b, alpha).delta_weight()


SHAPES = [((2, 8), 6, 1, 1.0, True), ((3, 20), 12, 4, 16.0, True), ((2, 5, 33), 17, 8, 8.0, False),
          ((1, 64), 64, 16, 32.0, True), ((9, 40), 24, 3, 5.0, True)]


def _tensors(lead_in, out, r, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = lead_in[-1]
    return (torch.randn(*lead_in, generator=g), torch.randn(out, k, generator=g) / k ** 0.5,
            torch.randn(out, generator=g) if bias else None, torch.randn(r, k, generator=g) / k ** 0.5,
            torch.randn(out, r, generator=g))  # B non-zero: a trained adapter, not the zero init


def _cases() -> list[Case]:
    return [Case(f"x {list(s)}, weight [{o}, {s[-1]}], rank {r}, alpha {a:g}, bias {'yes' if b else 'no'}",
                 (s, o, r, a, b)) for s, o, r, a, b in SHAPES]


def _run_forward(fn, data):
    s, o, r, a, b = data
    x, w, bias, la, lb = _tensors(s, o, r, b, sum(s) + o + r)
    with torch.no_grad():
        return fn(x, w, bias, la, lb, a)


register(Exercise(
    "07.lora_forward", "the LoRA forward: frozen base + scaled low-rank update", lora_forward, _cases, _run_forward,
    lambda e, a: tensor_diff(e, a, rtol=1e-4, atol=1e-5),
    hint="scale the update by alpha / r, where r = lora_a.shape[0]; the base keeps its bias; the update has none"))


def _run_merge(fn, data):
    s, o, r, a, _ = data
    _, w, _, la, lb = _tensors(s, o, r, False, sum(s) + o + r)
    with torch.no_grad():
        return fn(w, la, lb, a)


register(Exercise(
    "07.lora_merge", "merge the adapter into the base weight (no extra matmul at inference)", lora_merge, _cases,
    _run_merge, lambda e, a: tensor_diff(e, a, rtol=1e-4, atol=1e-5),
    hint="x A^T B^T = x (B A)^T: the update to W [out, in] is (alpha / r) * B @ A"))
