"""Diagnosis, predicted: the roofline of one step per layer type, and the utilisations that compare a measurement to it.

``roofline`` says what the hardware allows: for each layer type the FLOPs, the bytes it must move, their ratio
(arithmetic intensity), which ceiling binds and the time that implies. ``mbu``/``mfu`` put a measured time beside it
(the measured side is ``labkit.profiling``); ``plot_roofline`` draws the ceilings with measured points.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.hardware import Hardware
from labkit.model import ModelConfig, dtype_bytes, get_config

PHASES = ("prefill", "decode")


@dataclass
class RooflineRow:
    """One layer type summed over all layers: FLOPs, bytes moved, and the time the binding ceiling implies."""

    name: str
    flops: float
    bytes: float
    peak_flops: float
    bandwidth: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    @property
    def compute_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_s(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass
class Roofline:
    """Per-layer-type rows and totals for one phase of one model at one batch and context."""

    spec: ModelConfig
    hardware: Hardware
    phase: str
    batch: int
    context: int
    rows: list[RooflineRow] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.rows)

    @property
    def bytes(self) -> float:
        return sum(r.bytes for r in self.rows)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def time_s(self) -> float:
        """Each layer type at its own ceiling, summed: the floor for unfused, one-op-at-a-time execution."""
        return sum(r.time_s for r in self.rows)

    @property
    def bound(self) -> str:
        return "compute" if self.flops / self.hardware.bf16_flops >= self.bytes / self.hardware.mem_bandwidth \
            else "memory"

    @property
    def tokens(self) -> int:
        """Tokens produced (decode) or processed (prefill) by the step."""
        return self.batch if self.phase == "decode" else self.batch * self.context

    def table(self) -> list[dict]:
        rows = [{"layer type": r.name, "GFLOP": r.flops / 1e9, "MB moved": r.bytes / 1e6,
                 "FLOP/byte": r.intensity, "bound": r.bound, "time (us)": r.time_s * 1e6} for r in self.rows]
        rows.append({"layer type": "total", "GFLOP": self.flops / 1e9, "MB moved": self.bytes / 1e6,
                     "FLOP/byte": self.intensity, "bound": self.bound, "time (us)": self.time_s * 1e6})
        return rows


def roofline(spec, hardware: Hardware, batch: int, context: int, phase: str, dtype="bf16",
             kv_dtype=None) -> Roofline:
    """Predict one step of ``phase`` for ``batch`` sequences.

    ``decode``: each sequence emits one token attending to ``context`` cached tokens (the new one included).
    ``prefill``: each sequence processes a prompt of ``context`` tokens under a causal mask, and (as ``generate``
    does) computes logits for its last token only. Weights in ``dtype``, KV cache in ``kv_dtype`` (default
    ``dtype``), activations in ``dtype``. Attention is counted as a fused (flash) kernel: Q, K, V read once, O
    written once, no score matrix in memory.
    """
    spec = get_config(spec, "spec")
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} is unknown; allowed: {list(PHASES)}")
    if batch < 1 or context < 1:
        raise ValueError(f"batch={batch} and context={context} must be at least 1")
    wb, ab = dtype_bytes(dtype), dtype_bytes(dtype if dtype_bytes(dtype) >= 2 else "bf16")
    kvb = dtype_bytes(kv_dtype or dtype)
    L, h = spec.num_layers, spec.hidden_size
    tokens = batch if phase == "decode" else batch * context
    peak, bw = hardware.bf16_flops, hardware.mem_bandwidth

    def row(name, flops, nbytes):
        return RooflineRow(name, float(flops), float(nbytes), peak, bw)

    attn_w = spec.attn_params_per_layer * L
    qkv_act = tokens * (h + spec.q_size + 2 * spec.kv_size + spec.q_size + h) * ab * L
    mlp_w = spec.mlp_params_per_layer * L
    n_mats = 3 if spec.gated_mlp else 2
    mlp_act = tokens * (2 * h + (n_mats - 1) * spec.intermediate_size + spec.intermediate_size) * ab * L
    if phase == "decode":
        attn_flops = batch * spec.attention_flops_per_token(context)
        attn_bytes = batch * context * spec.kv_bytes_per_token(kv_dtype or dtype) \
            + 2 * batch * spec.q_size * ab * L
    else:
        attn_flops = batch * 4.0 * L * spec.num_heads * spec.head_dim * context * (context + 1) / 2
        attn_bytes = tokens * (2 * spec.q_size * ab + 2 * spec.kv_size * kvb) * L
    logits_tokens = batch
    rows = [
        row("QKV/O projections", 2 * tokens * attn_w, attn_w * wb + qkv_act),
        row("attention", attn_flops, attn_bytes),
        row("MLP", 2 * tokens * mlp_w, mlp_w * wb + mlp_act),
        # two norms per layer plus the final one; a norm reads and writes the hidden state (and its residual)
        row("norms and residuals", tokens * (2 * L + 1) * 5 * h, tokens * (2 * L + 1) * 3 * h * ab + tokens * h * ab),
        row("LM head", 2 * logits_tokens * spec.vocab_size * h,
            spec.vocab_size * h * wb + logits_tokens * (h + spec.vocab_size) * ab),
    ]
    return Roofline(spec, hardware, phase, batch, context, rows)


def mbu(bytes_moved: float, seconds: float, bandwidth: float) -> float:
    """Model bandwidth utilisation: achieved bytes/s over the (measured) bandwidth ceiling."""
    return bytes_moved / seconds / bandwidth


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOP utilisation: achieved FLOP/s over the (measured) matmul ceiling."""
    return flops / seconds / peak_flops


def plot_roofline(hardware: Hardware, points: list[tuple[str, float, float]], ax=None):
    """Log-log roofline of ``hardware`` with measured ``points`` (label, FLOP/byte, achieved FLOP/s)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4.5))[1]
    lo = min([0.1] + [p[1] for p in points]) / 2
    hi = max([10 * hardware.ridge_point] + [p[1] for p in points]) * 2
    xs = torch.logspace(torch.log10(torch.tensor(lo)), torch.log10(torch.tensor(hi)), 200)
    ax.loglog(xs, torch.minimum(xs * hardware.mem_bandwidth, torch.tensor(hardware.bf16_flops)), "k-",
              label=f"{hardware.name} roofline")
    ax.axvline(hardware.ridge_point, color="grey", ls=":", label=f"ridge {hardware.ridge_point:.0f} FLOP/B")
    for label, x, y in points:
        ax.loglog([x], [y], "o", label=label)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.legend(fontsize=8)
    return ax
