"""Models: the embedded trained model, full-size random architectures, and the arithmetic of a model's shape.

Two scales, one code path (DESIGN.md): accuracy is measured on the embedded model, trained by this project and
shipped in ``data/``; speed is measured on real architectures at full size with random weights
(``random_model("llama-3-8b")``), because speed does not depend on weight values.

``ModelSpec`` holds the shape of a transformer and derives what the later notebooks need from it: parameter
count, weight bytes, FLOPs per token in prefill and decode, and KV-cache bytes per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from labkit.device import resolve_device

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
EMBEDDED_MODEL = "pydocs-llama"
EMBEDDED_MODEL_DIR = DATA_DIR / EMBEDDED_MODEL

# Bytes per element for the dtypes the workbook talks about; int4 and nf4 pack two weights per byte.
DTYPE_BYTES = {
    "fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "nf4": 0.5,
}
_TORCH_DTYPE_NAMES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8",
    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8",
}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "float8": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical short name ('fp32', 'bf16', 'fp16', 'fp8', 'int8', 'int4', 'nf4') of a dtype or its alias."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"dtype={dtype} is not one labkit sizes; allowed: {sorted(_TORCH_DTYPE_NAMES.values())}")
        return _TORCH_DTYPE_NAMES[dtype]
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is unknown; allowed: {sorted(DTYPE_BYTES)} or a torch dtype")
    return name


def dtype_bytes(dtype: str | torch.dtype) -> float:
    """Bytes per element (0.5 for the 4-bit formats)."""
    return DTYPE_BYTES[dtype_name(dtype)]


def torch_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A floating torch dtype for model weights from a name, a torch dtype or ``None`` (the default)."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES.values():
            raise ValueError(f"dtype={dtype}: model weights must be one of {list(TORCH_DTYPES.values())}")
        return dtype
    name = dtype_name(dtype)
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r}: model weights must be one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer and the arithmetic derived from it.

    ``mlp`` is ``"swiglu"`` (a gated MLP: gate, up, down, three matrices; Llama, Mistral, Qwen, Gemma, Phi-3) or
    ``"gelu"`` (up, down: two, GPT-3). Family features that add parameters: ``qkv_bias`` / ``o_bias`` /
    ``mlp_bias`` (biases of those projections; Qwen2 has q/k/v biases), ``qk_norm`` (an RMSNorm of ``head_dim``
    on queries and keys per layer, Qwen3), ``norm_bias`` (LayerNorm with a bias, GPT-2/3) and
    ``learned_positions`` (a ``max_position x hidden`` position table, GPT-2/3). ``num_params`` counts every
    parameter; ``matmul_params`` only the weight matrices a token multiplies; FLOPs count matmuls only.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    max_position: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_bias: bool = False
    learned_positions: bool = False

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                  "max_position"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                                 f"give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive integer")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={self.mlp!r}: allowed 'swiglu' or 'gelu'")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta >= 0):
            raise ValueError(f"rope_theta={self.rope_theta!r} must be a finite number >= 0 (0: no RoPE)")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be in (0, 1)")

    # --- parameter counts -------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        """Q, K, V and O projection weights of one layer (matmul weights only; see ``attn_extra_params``)."""
        return self.hidden_size * (2 * self.q_dim + 2 * self.kv_dim)

    @property
    def mlp_params_per_layer(self) -> int:
        """The MLP's weight matrices of one layer (matmul weights only)."""
        return self._mlp_mats * self.hidden_size * self.intermediate_size

    @property
    def _mlp_mats(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def attn_extra_params(self) -> int:
        """Biases of q/k/v and o, and the q/k norms, of one layer."""
        return (self.qkv_bias * (self.q_dim + 2 * self.kv_dim) + self.o_bias * self.hidden_size
                + self.qk_norm * 2 * self.head_dim)

    @property
    def mlp_extra_params(self) -> int:
        """Biases of the MLP's projections of one layer."""
        return self.mlp_bias * ((self._mlp_mats - 1) * self.intermediate_size + self.hidden_size)

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size * (1 + self.norm_bias)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        return (self.attn_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer
                + self.attn_extra_params + self.mlp_extra_params)

    @property
    def num_params(self) -> int:
        """Every parameter: embeddings (and a learned position table), layers, final norm and (untied) LM head;
        equal to ``sum(p.numel())`` of the Hugging Face model (tied weights once)."""
        return (self.embedding_params + self.learned_positions * self.max_position * self.hidden_size
                + self.num_layers * self.layer_params + self.hidden_size * (1 + self.norm_bias) + self.lm_head_params)

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every linear layer plus the LM head (tied or not)."""
        return self.num_layers * (self.attn_params_per_layer + self.mlp_params_per_layer) + \
            self.vocab_size * self.hidden_size

    # --- bytes ------------------------------------------------------------------------------------------------
    def weight_bytes(self, dtype: str | torch.dtype = "bf16") -> float:
        """Bytes of all weights stored in ``dtype`` (scales of quantised formats not included)."""
        return self.num_params * dtype_bytes(dtype)

    def decode_weight_bytes(self, dtype: str | torch.dtype = "bf16") -> float:
        """Bytes a decode step must read: every weight once, except the embedding table, of which a decode step
        reads one row per token (a tied table is read in full as the LM head)."""
        read = self.num_params - (0 if self.tie_embeddings else self.embedding_params)
        return read * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str | torch.dtype = "bf16") -> float:
        """KV-cache bytes per token: ``2 * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def kv_bytes(self, tokens: int, dtype: str | torch.dtype = "bf16") -> float:
        return tokens * self.kv_bytes_per_token(dtype)

    # --- FLOPs ------------------------------------------------------------------------------------------------
    def attention_flops_per_token(self, context: int) -> float:
        """QK^T and PV for one query token attending to ``context`` tokens: 2 matmuls x 2 FLOPs per MAC."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * context

    def decode_flops_per_token(self, context: int) -> float:
        """FLOPs to decode one token with ``context`` tokens already cached (the new token included)."""
        return 2.0 * self.matmul_params + self.attention_flops_per_token(context)

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs to prefill a prompt of ``prompt_len`` tokens under a causal mask (token i attends to i+1)."""
        mean_context = (prompt_len + 1) / 2
        return prompt_len * (2.0 * self.matmul_params + self.attention_flops_per_token(mean_context))

    # --- conversion -------------------------------------------------------------------------------------------
    def with_name(self, name: str) -> ModelSpec:
        return replace(self, name=name)

    @classmethod
    def from_config(cls, config, name: str | None = None) -> ModelSpec:
        """Build from a Hugging Face config: the Llama family (Llama 1-3, Mistral, Qwen2, Qwen3, Gemma, Phi-3 and
        others with the same fields) or ``GPT2Config``. Biases and q/k norms are read per family."""
        mt = getattr(config, "model_type", "")
        if mt == "gpt2":
            return cls(name=name or "gpt2-like", vocab_size=config.vocab_size, hidden_size=config.n_embd,
                       num_layers=config.n_layer, num_heads=config.n_head, num_kv_heads=config.n_head,
                       intermediate_size=config.n_inner or 4 * config.n_embd, mlp="gelu", tie_embeddings=True,
                       max_position=config.n_positions, rope_theta=0.0, rms_norm_eps=config.layer_norm_epsilon,
                       qkv_bias=True, o_bias=True, mlp_bias=True, norm_bias=True, learned_positions=True)
        needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [f for f in needed if getattr(config, f, None) is None]
        if missing:
            raise ValueError(f"config of model_type={mt!r} lacks {missing}: not a decoder this ModelSpec describes "
                             f"(Llama-family or GPT-2 configs)")
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = True if mt == "qwen2" else attn_bias  # Qwen2 always has q/k/v biases and no o bias
        return cls(name=name or getattr(config, "_name_or_path", "") or mt,
                   vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   intermediate_size=config.intermediate_size,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   max_position=config.max_position_embeddings,
                   rope_theta=float(theta), rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
                   qkv_bias=qkv_bias, o_bias=attn_bias and mt != "qwen2",
                   mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=mt in ("qwen3", "qwen3_moe"))

    def to_hf_config(self):
        """A Hugging Face config for this shape (``LlamaConfig``, or ``GPT2Config`` for the GELU MLP)."""
        from transformers import GPT2Config, LlamaConfig

        if self.mlp == "gelu":
            return GPT2Config(vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_layers,
                              n_head=self.num_heads, n_inner=self.intermediate_size, n_positions=self.max_position,
                              layer_norm_epsilon=self.rms_norm_eps)
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, intermediate_size=self.intermediate_size,
                           head_dim=self.head_dim, tie_word_embeddings=self.tie_embeddings,
                           max_position_embeddings=self.max_position, rms_norm_eps=self.rms_norm_eps,
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           bos_token_id=1, eos_token_id=2, pad_token_id=None)


# The embedded model's shape; kept in step with data/pydocs-llama/config.json by a test.
TINY = ModelSpec(name="tiny", vocab_size=8192, hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2,
                 intermediate_size=768, tie_embeddings=True, max_position=2048, rope_theta=10000.0,
                 rms_norm_eps=1e-5)

PRESETS: dict[str, ModelSpec] = {
    "tiny": TINY,
    "llama-2-7b": ModelSpec(name="llama-2-7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                            num_kv_heads=32, intermediate_size=11008, max_position=4096, rope_theta=10000.0,
                            rms_norm_eps=1e-5),
    "llama-3-8b": ModelSpec(name="llama-3-8b", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                            num_kv_heads=8, intermediate_size=14336, max_position=8192),
    "llama-3-70b": ModelSpec(name="llama-3-70b", vocab_size=128256, hidden_size=8192, num_layers=80,
                             num_heads=64, num_kv_heads=8, intermediate_size=28672, max_position=8192),
    # GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads of 128, 2048 context.
    "gpt3-175b": ModelSpec(name="gpt3-175b", vocab_size=50257, hidden_size=12288, num_layers=96, num_heads=96,
                           num_kv_heads=96, intermediate_size=4 * 12288, mlp="gelu", tie_embeddings=True,
                           max_position=2048, rope_theta=0.0),
}


def get_spec(preset_or_model) -> ModelSpec:
    """The ``ModelSpec`` of a preset name, a Hugging Face model or config, or a ``ModelSpec`` itself."""
    if isinstance(preset_or_model, ModelSpec):
        return preset_or_model
    if isinstance(preset_or_model, str):
        if preset_or_model not in PRESETS:
            raise ValueError(f"preset={preset_or_model!r} is unknown; allowed: {sorted(PRESETS)}")
        return PRESETS[preset_or_model]
    config = getattr(preset_or_model, "config", preset_or_model)
    if not hasattr(config, "vocab_size"):
        raise TypeError(f"cannot derive a ModelSpec from {type(preset_or_model).__name__}; pass a preset name "
                        f"({sorted(PRESETS)}), a Hugging Face model or config, or a ModelSpec")
    return ModelSpec.from_config(config)


def _check_fits(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
    need = spec.weight_bytes(dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    elif device.type == "cpu":
        import psutil

        free = psutil.virtual_memory().available
    else:
        return
    if need > 0.9 * free:
        raise MemoryError(f"random_model({spec.name!r}) needs {need / 2**30:.1f} GiB of weights in {dtype}, "
                          f"but {device} has {free / 2**30:.1f} GiB free; use a smaller preset, dtype or "
                          f"device='meta'")


def random_model(preset: str | ModelSpec, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = torch.bfloat16, seed: int = 0,
                 num_layers: int | None = None):
    """A Hugging Face causal LM of a real architecture at full size with random weights.

    Weights are created directly on ``device`` (``"meta"`` allowed, for shapes only); nothing is materialised
    on the CPU first. ``num_layers`` truncates the depth (same per-layer shape) for quick experiments.
    Weights are drawn as N(0, 0.02) by the model's own initialiser: never zeros.
    """
    from transformers import AutoModelForCausalLM

    spec = get_spec(preset)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} must be at least 1")
        spec = replace(spec, num_layers=num_layers)
    dev = torch.device("meta") if str(device) == "meta" else resolve_device(device)
    dt = torch_dtype(dtype, default=torch.bfloat16)
    _check_fits(spec, dev, dt)
    config = spec.to_hf_config()
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    return model.eval()


def _resolve_checkpoint(name_or_path: str | Path | None) -> Path:
    if name_or_path is None or name_or_path == EMBEDDED_MODEL:
        path = EMBEDDED_MODEL_DIR
    else:
        path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"name_or_path={str(name_or_path)!r} is not a Hugging Face checkpoint directory "
                         f"(no config.json at {path}); allowed: None or {EMBEDDED_MODEL!r} for the embedded "
                         f"model, or a local directory holding config.json and weights. Nothing is downloaded.")
    return path


def load_model(name_or_path: str | Path | None = None, device: str | torch.device | None = "cpu",
               dtype: str | torch.dtype | None = torch.float32):
    """Load ``(model, tokenizer)`` from the embedded model (``None``) or a local HF checkpoint directory.

    The model is in eval mode on ``device`` in ``dtype``: float32 by default on every device (the accuracy
    reference), so a bfloat16 checkpoint (the embedded one too) is upcast unless you pass ``torch.bfloat16`` (or
    ``"auto"``: the dtype its config.json names). The choice is logged (logger ``labkit.models``, INFO)."""
    import json
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, dev = _resolve_checkpoint(name_or_path), resolve_device(device)
    cfg = json.loads((path / "config.json").read_text())
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    dt = torch_dtype(stored if dtype == "auto" else dtype)
    logging.getLogger(__name__).info("load_model(%s): %s on %s (%s; the checkpoint stores %s)", path.name, dt,
                                     dev.type, "asked" if dtype != torch.float32 else "the default", stored)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters of a module (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def human_bytes(n: float) -> str:
    """``1.5 GiB`` style formatting."""
    if n <= 0:
        return "0 B"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = min(int(math.log(n, 1024)), len(units) - 1)
    return f"{n / 1024**i:.1f} {units[i]}"
