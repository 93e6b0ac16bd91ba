"""The arithmetic of a decoder's shape: parameters, bytes per dtype, FLOPs per token, KV-cache bytes.

``ShapeArithmetic`` is what ``ModelConfig`` derives from its fields (``labkit.model.config``): the notebooks, the
fine-tuning memory model and the planner read a model's size from it, for a checkpoint's config, a preset
(``labkit.model.presets``) or an HF model alike. Bytes per element come from ``DTYPE_BYTES`` (the 4-bit formats pack
two weights per byte).
"""

from __future__ import annotations

import math

import torch

from labkit.checks import ArgumentTypeError, check_number

DTYPE_BYTES = {
    "fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "nf4": 0.5,
}
"""Bytes per element of the formats the workbook sizes, by short name."""
_TORCH_DTYPE_NAMES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8",
    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8",
}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "float8": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8"}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical short name ('fp32', 'bf16', 'fp16', 'fp8', 'int8', 'int4', 'nf4') of a dtype or its alias."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"dtype={dtype} is not one labkit sizes; allowed: {sorted(_TORCH_DTYPE_NAMES.values())}")
        return _TORCH_DTYPE_NAMES[dtype]
    if not isinstance(dtype, str):
        raise ArgumentTypeError(f"dtype={dtype!r} must be a dtype name or a torch dtype; allowed: "
                                f"{sorted(DTYPE_BYTES)}")
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is unknown; allowed: {sorted(DTYPE_BYTES)} or a torch dtype")
    return name


def dtype_bytes(dtype: str | torch.dtype) -> float:
    """Bytes per element (0.5 for the 4-bit formats)."""
    return DTYPE_BYTES[dtype_name(dtype)]


class ShapeArithmetic:
    """Sizes derived from a decoder's fields (``ModelConfig`` provides them): ``vocab_size``, ``hidden_size``,
    ``intermediate_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``tie_word_embeddings``,
    ``max_position_embeddings``, the biases (``qkv_bias``, ``o_bias``, ``mlp_bias``), ``qk_norm``, ``gated_mlp``
    (gate, up, down: three matrices; GPT-2/3: up, down), ``norm_bias`` and ``learned_positions`` (GPT-2/3).

    ``num_params`` counts every parameter (equal to ``sum(p.numel())`` of the Hugging Face model, tied weights
    once); ``matmul_params`` only the weight matrices a token multiplies; FLOPs count matmuls only."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        """Q, K, V and O projection weights of one layer (matmul weights only; see ``attn_extra_params``)."""
        return self.hidden_size * (2 * self.q_size + 2 * self.kv_size)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def mlp_params_per_layer(self) -> int:
        """The MLP's weight matrices of one layer (matmul weights only)."""
        return self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def attn_extra_params(self) -> int:
        """Biases of q/k/v and o, and the q/k norms, of one layer."""
        return (self.qkv_bias * (self.q_size + 2 * self.kv_size) + self.o_bias * self.hidden_size
                + self.qk_norm * 2 * self.head_dim)

    @property
    def mlp_extra_params(self) -> int:
        """Biases of the MLP's projections of one layer."""
        return self.mlp_bias * ((self.mlp_matrices - 1) * self.intermediate_size + self.hidden_size)

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size * (1 + self.norm_bias)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        return (self.attn_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer
                + self.attn_extra_params + self.mlp_extra_params)

    @property
    def num_params(self) -> int:
        """Every parameter: embeddings (and a learned position table), layers, final norm and (untied) LM head."""
        return (self.embedding_params + self.learned_positions * self.max_position_embeddings * self.hidden_size
                + self.num_layers * self.layer_params + self.hidden_size * (1 + self.norm_bias) + self.lm_head_params)

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every linear layer plus the LM head (tied or not)."""
        return self.num_layers * (self.attn_params_per_layer + self.mlp_params_per_layer) + self.embedding_params

    def weight_bytes(self, dtype: str | torch.dtype = "bf16") -> float:
        """Bytes of all weights stored in ``dtype`` (scales of quantised formats not included)."""
        return self.num_params * dtype_bytes(dtype)

    def decode_weight_bytes(self, dtype: str | torch.dtype = "bf16") -> float:
        """Bytes a decode step must read: every weight once, except the embedding table, of which a decode step
        reads one row per token (a tied table is read in full as the LM head)."""
        return (self.num_params - (0 if self.tie_word_embeddings else self.embedding_params)) * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str | torch.dtype = "bf16") -> float:
        """KV-cache bytes per token: ``2 * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def kv_bytes(self, tokens: float, dtype: str | torch.dtype = "bf16") -> float:
        """KV-cache bytes of ``tokens`` tokens (>= 0; a mean may be fractional)."""
        return check_number("tokens", tokens, 0) * self.kv_bytes_per_token(dtype)

    def attention_flops_per_token(self, context: float) -> float:
        """QK^T and PV for one query token attending to ``context`` tokens (>= 0): 2 matmuls x 2 FLOPs per MAC."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * check_number("context", context, 0)

    def decode_flops_per_token(self, context: float) -> float:
        """FLOPs to decode one token with ``context`` tokens already cached (the new token included)."""
        return 2.0 * self.matmul_params + self.attention_flops_per_token(context)

    def prefill_flops(self, prompt_len: float) -> float:
        """FLOPs to prefill a prompt of ``prompt_len`` tokens (>= 0) under a causal mask (token i attends to i + 1)."""
        n = check_number("prompt_len", prompt_len, 0)
        return n * (2.0 * self.matmul_params + self.attention_flops_per_token((n + 1) / 2))


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters of a module (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def human_bytes(n: float) -> str:
    """``1.5 GiB`` style formatting of ``n`` bytes (>= 0)."""
    if check_number("n", n, 0) == 0:
        return "0 B"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = min(int(math.log(n, 1024)), len(units) - 1)
    return f"{n / 1024**i:.1f} {units[i]}"
