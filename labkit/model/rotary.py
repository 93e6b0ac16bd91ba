"""Rotary position embeddings: the inverse frequencies of each scaling variant, cos/sin, and their application.

Every variant is computed as ``transformers.modeling_rope_utils`` computes it (float32, on the CPU, the same
expressions in the same order), so the tables equal HF's and a model's logits match HF's to rounding:

* 'default': ``inv_freq[i] = 1 / theta ** (2i / dim)``
* 'linear': ``inv_freq / factor`` (position interpolation)
* 'llama3': low frequencies (wavelength above ``original_max / low_freq_factor``) divided by ``factor``, high ones
  kept, the band between interpolated smoothly (Llama 3.1)
* 'yarn': a ramp between interpolated and extrapolated frequencies, and cos/sin scaled by ``attention_factor``
* 'dynamic' (NTK): a sequence of ``n > max_position_embeddings`` tokens uses the base
  ``theta * (factor * n / max_pos - (factor - 1)) ** (dim / (dim - 2))``. HF computes ``n`` from the batch's largest
  position; here each sequence uses its own length (its context after the step), which equals HF's
  ``generate`` of one sequence token for token and keeps one sequence's output independent of its batch.

cos and sin are ``[num_tokens, rotary_dim]`` float32, computed per position as HF's rotary embedding does
(``positions * inv_freq``, duplicated to the full rotary dim), and cast to the activations' dtype where applied.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from labkit.model.config import ModelConfig


def _exponents(dim: int) -> torch.Tensor:
    """``[0, 2, 4, ...] / dim`` as HF builds it (int64 arange, then float32)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def inv_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)``: float32 ``[rotary_dim // 2]`` on the CPU and the factor on cos/sin."""
    dim, base, s = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
    inv_freq = 1.0 / (base ** _exponents(dim))
    if s is None or s.rope_type == "dynamic":  # dynamic equals default up to max_position_embeddings
        if s is not None:  # HF evaluates the dynamic base at seq_len = max_position_embeddings at init
            f = s.factor
            base = base * ((f * cfg.max_position_embeddings / cfg.max_position_embeddings) - (f - 1)) ** (
                dim / (dim - 2))
            inv_freq = 1.0 / (base ** _exponents(dim))
        return inv_freq, 1.0
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s), 1.0
    return _yarn(cfg)


def _llama3(inv_freq: torch.Tensor, s) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    s, dim, base = cfg.rope_scaling, cfg.rotary_dim, cfg.rope_theta
    factor, orig = s.factor, s.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (float(mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim))
                     if s.mscale and s.mscale_all_dim else mscale(factor))
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention


def dynamic_inv_frequencies(cfg: ModelConfig, seq_lens: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Per-token inverse frequencies of 'dynamic' RoPE: ``[num_tokens, rotary_dim // 2]`` float32.

    ``seq_lens`` (int ``[num_tokens]``): the length of each token's sequence; tokens of sequences within
    ``max_position_embeddings`` keep ``inv_freq`` (the table HF builds at init)."""
    dim, max_pos, f = cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_scaling.factor
    n = torch.clamp(seq_lens.long(), min=max_pos)
    base = cfg.rope_theta * ((f * n / max_pos) - (f - 1)) ** (dim / (dim - 2))  # float32, as HF's tensor path
    grown = 1.0 / (base[:, None] ** _exponents(dim).to(seq_lens.device)[None, :])
    return torch.where((seq_lens > max_pos)[:, None], grown, inv_freq[None, :])


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's position for one model (every layer uses the same).

    The inverse frequencies are kept in float32 off the module's parameters and buffers, so that casting the model
    to bf16 or building it on the meta device never touches them; they are copied to a device on first use."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.inv_freq_cpu, self.attention_scaling = inv_frequencies(cfg)
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq_cpu.to(device)
        return self._on_device[device]

    def forward(self, positions: torch.Tensor,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int ``[...]`` -> ``(cos, sin)`` float32 ``[..., rotary_dim]``.

        ``seq_lens`` (same shape: the length of each token's sequence) is needed by 'dynamic' RoPE only; without it
        a dynamic model uses each row's largest position + 1 (the plain forward's case)."""
        inv_freq = self.inv_freq(positions.device)
        s = self.cfg.rope_scaling
        if s is not None and s.rope_type == "dynamic":
            if seq_lens is None:
                seq_lens = (positions.amax(dim=-1, keepdim=True) + 1).expand_as(positions)
            flat = dynamic_inv_frequencies(self.cfg, seq_lens.reshape(-1), inv_freq)
            freqs = (positions.reshape(-1, 1).float() * flat).view(*positions.shape, -1)
        else:
            freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s cos/sin cast to ``dtype`` (``[num_tokens, rotary_dim]``), as the paged step uses them: read
        from a table of every position up to ``max_position_embeddings`` (built on first use; each entry depends on
        its position alone, so a lookup equals the computation), two gathers a step. 'dynamic' RoPE depends on the
        sequence's length too and is computed."""
        s = self.cfg.rope_scaling
        if s is not None and s.rope_type == "dynamic":
            cos, sin = self(positions, seq_lens)
            return cos.to(dtype), sin.to(dtype)
        key = (positions.device, dtype)
        if key not in self._tables:
            cos, sin = self(torch.arange(self.cfg.max_position_embeddings, device=positions.device))
            self._tables[key] = cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
        cos, sin = self._tables[key]
        return cos[positions], sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., heads, head_dim]`` by ``cos``/``sin`` ``[..., rotary_dim]`` (float32, cast to ``x``'s
    dtype as HF does); dims past ``rotary_dim`` pass through (partial rotary)."""
    cos, sin = cos.to(x.dtype)[..., None, :], sin.to(x.dtype)[..., None, :]
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
