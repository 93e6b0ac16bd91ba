"""A short fine-tuning loop on the embedded model: full, LoRA or QLoRA; fp32 or bf16 autocast; activation
checkpointing; AdamW, 8-bit AdamW (bitsandbytes) or SGD. The ``TrainSetup`` (``state.py``) says which.

The data is a task split of the corpus (``task_train``: the C-API pages, unseen in pre-training), cut into random
windows; the held-out loss is measured on ``task_heldout`` (and on ``heldout``, the general docs, to see what
fine-tuning forgets). The loss is Hugging Face's (``labels=input_ids``: next-token cross-entropy in fp32).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from labkit.bench import Timing
from labkit.finetune.lora import LLAMA_LINEARS, apply_lora, quantize_nf4, trainable_parameters
from labkit.finetune.state import TrainSetup


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def enable_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Recompute each decoder layer in backward instead of keeping its activations (in place).

    Wraps every layer's ``forward`` in ``torch.utils.checkpoint.checkpoint`` (non-reentrant: it accepts keyword
    arguments and works when the layer input needs no gradient, as under LoRA). This is what HF's
    ``gradient_checkpointing_enable`` does, written out so it behaves the same on every transformers version.
    """
    for layer in model.model.layers:
        if getattr(layer, "_labkit_checkpointed", False):
            continue
        original = layer.forward

        def forward(*args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_original, *args, use_reentrant=False, **kwargs)

        layer.forward = functools.wraps(original)(forward)
        layer._labkit_checkpointed = True
    return model


def prepare_model(model: torch.nn.Module, setup: TrainSetup, lora_alpha: float = 16.0) -> torch.nn.Module:
    """Make ``model`` trainable as ``setup`` says, in place: NF4 base weights (qlora), adapters (lora, qlora) or
    every weight (full), activation checkpointing, train mode. Returns ``model``.

    QLoRA dequantises to bf16 for its matmuls under ``bf16-mixed`` and to fp32 otherwise. ``base_dtype='bf16'``
    casts the frozen weights (embeddings, norms, dense bases) to bf16 first; adapters stay fp32.
    """
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"model weights are {next(model.parameters()).dtype}; training here keeps fp32 master "
                         f"weights (load with dtype=torch.float32; bf16 comes from autocast)")
    targets = setup.lora_targets or LLAMA_LINEARS
    if setup.base_dtype == "bf16":
        model.to(torch.bfloat16)  # frozen weights in bf16; the adapters are created in fp32 below
    if setup.method == "qlora":
        compute = torch.bfloat16 if setup.precision == "bf16-mixed" else torch.float32
        quantize_nf4(model, targets, compute_dtype=compute)
    if setup.method in ("lora", "qlora"):
        apply_lora(model, rank=setup.lora_rank, alpha=lora_alpha, targets=targets)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    if setup.checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = False  # training keeps no KV cache
    return model.train()


def make_optimizer(params: list[torch.nn.Parameter], optimizer: str, lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``adamw``: torch's fused AdamW (one kernel, no temporaries); ``adamw8bit``: bitsandbytes' blockwise
    8-bit AdamW (runs on the CPU too in bitsandbytes 0.50); ``sgd``: plain SGD without momentum (no state)."""
    if not params:
        raise ValueError("params is empty: nothing to train (did prepare_model run?)")
    if lr <= 0:
        raise ValueError(f"lr={lr} must be positive")
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    if optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={optimizer!r} is unknown; allowed: ['adamw', 'adamw8bit', 'sgd']")


def training_batches(token_ids: torch.Tensor, batch_size: int, seq_len: int, steps: int,
                     seed: int = 0) -> torch.Tensor:
    """``steps`` batches of ``batch_size`` random windows of ``seq_len`` tokens: int64 [steps, batch, seq]."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    if min(batch_size, seq_len, steps) < 1:
        raise ValueError(f"batch_size={batch_size}, seq_len={seq_len} and steps={steps} must be positive")
    if seq_len >= len(token_ids):
        raise ValueError(f"seq_len={seq_len} must be shorter than the {len(token_ids)} tokens given")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(token_ids) - seq_len, (steps, batch_size), generator=g)
    return token_ids[starts[..., None] + torch.arange(seq_len)]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               precision: str = "fp32") -> float:
    """One step on ``batch`` (int64 [batch, seq], on the model's device): forward (under bf16 autocast for
    ``bf16-mixed``), backward, optimizer step, gradients freed (``set_to_none``). Returns the loss."""
    if precision not in ("fp32", "bf16-mixed"):
        raise ValueError(f"precision={precision!r} is unknown; allowed: ['fp32', 'bf16-mixed']")
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()  # outside autocast, as torch recommends: backward ops run in their forward's dtypes
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@dataclass
class FinetuneResult:
    """Losses per step and each step's wall-clock time (device synchronised), from ``finetune``."""

    losses: list[float]
    step_times: Timing
    tokens_per_step: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_times.median_s

    def to_dict(self) -> dict:
        return {"losses": self.losses, "step_times": self.step_times.to_dict(),
                "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s, **self.extra}


def warmup_cosine(steps: int, warmup: int, floor: float = 0.1):
    """LR multiplier per step: linear warm-up over ``warmup`` steps, then cosine decay to ``floor``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def finetune(model: torch.nn.Module, train_ids: torch.Tensor, setup: TrainSetup, steps: int, lr: float,
             seed: int = 0, weight_decay: float = 0.0, warmup_steps: int | None = None,
             progress: bool = False) -> FinetuneResult:
    """Train a prepared model (``prepare_model``) for ``steps`` steps on random windows of ``train_ids``, with
    a linear warm-up (``warmup_steps``, default a tenth of the steps) and cosine decay of the learning rate.

    The first step's time (optimizer state allocation, kernel warm-up) is kept in ``extra`` but left out of
    ``step_times``.
    """
    from tqdm.auto import tqdm

    if steps < 2:
        raise ValueError(f"steps={steps} must be at least 2 (the first one is a warm-up for the timing)")
    warmup = max(1, steps // 10) if warmup_steps is None else warmup_steps
    if not 0 <= warmup <= steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be in [0, steps={steps}]")
    device = _device_of(model)
    params = trainable_parameters(model)
    opt = make_optimizer(params, setup.optimizer, lr, weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, warmup))
    batches = training_batches(train_ids, setup.batch_size, setup.seq_len, steps, seed).to(device)
    losses, times = [], []
    for i in tqdm(range(steps), desc=f"finetune {setup.method}", disable=not progress):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses.append(train_step(model, opt, batches[i], setup.precision))  # .item() synchronises
        times.append(time.perf_counter() - t0)
        schedule.step()
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"the loss diverged: {losses}")
    return FinetuneResult(losses, Timing(times[1:], "wall_clock_synced"), setup.tokens,
                          extra={"first_step_s": times[0], "optimizer": type(opt).__name__})


def heldout_windows(token_ids: torch.Tensor, seq_len: int, num_windows: int | None = None) -> torch.Tensor:
    """Windows of ``seq_len + 1`` tokens (int64 [n, seq_len + 1]): all non-overlapping ones, or ``num_windows``
    spread evenly over the whole split (so a small sample sees every part of it, not only its first pages)."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    total = (len(token_ids) - 1) // seq_len
    if seq_len < 1 or total < 1:
        raise ValueError(f"seq_len={seq_len} must be in [1, {len(token_ids) - 1}] for {len(token_ids)} tokens")
    if num_windows is not None and not 1 <= num_windows <= total:
        raise ValueError(f"num_windows={num_windows} must be in [1, {total}] (or None for all {total})")
    picks = torch.arange(total) if num_windows is None else torch.linspace(0, total - 1, num_windows).round().long()
    return token_ids[picks[:, None] * seq_len + torch.arange(seq_len + 1)]


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, token_ids: torch.Tensor, seq_len: int = 256,
                 num_windows: int | None = None, batch_size: int = 8, precision: str = "fp32") -> float:
    """Mean next-token cross-entropy (nats per token; ``exp`` of it is the perplexity) over ``heldout_windows``,
    under bf16 autocast for ``precision='bf16-mixed'`` (the model as it trains)."""
    if precision not in ("fp32", "bf16-mixed"):
        raise ValueError(f"precision={precision!r} is unknown; allowed: ['fp32', 'bf16-mixed']")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")
    device = _device_of(model)
    windows = heldout_windows(token_ids, seq_len, num_windows).to(device)
    was_training = model.training
    model.eval()
    nll = 0.0
    try:
        for i in range(0, len(windows), batch_size):
            w = windows[i:i + batch_size]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                logits = model(input_ids=w[:, :-1], use_cache=False).logits
            nll += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
    finally:
        model.train(was_training)
    return nll / windows[:, 1:].numel()
