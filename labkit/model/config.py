"""``ModelConfig``: the shape and the family features of a decoder, read from a Hugging Face config or given as a
preset (``labkit.model.presets``), and the arithmetic of its size (``labkit.model.shapes``): one concept for the
model that runs and for the model that is sized.

One dataclass holds everything the model module needs; the families differ only in its fields:

=========  ========================================================================================
family     what its config turns on
=========  ========================================================================================
llama      Llama 1-3: RoPE scalings 'linear', 'dynamic', 'yarn', 'llama3'; tied embeddings; optional
           ``attention_bias`` (q, k, v, o) and ``mlp_bias``
mistral    ``sliding_window`` on every layer
qwen2      bias on q, k, v (not o); ``use_sliding_window`` on layers ``>= max_window_layers``
qwen3      RMSNorm of each head of q and k (``qk_norm``) before RoPE; optional sliding window as qwen2
gemma      (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), GELU-tanh MLP, tied embeddings
phi3       q/k/v and gate/up stored fused in the checkpoint (``qkv_proj``, ``gate_up_proj``); partial
           rotary; ``sliding_window`` on every layer
=========  ========================================================================================

GPT-2/3 (``model_type='gpt2'``) is sized, never built. Anything else (another ``model_type``, a RoPE type such as
'longrope', a quantised checkpoint, ...) is refused here with a ``ValueError`` that names it, so a checkpoint either
runs right or does not load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from labkit.checks import check_bool, check_choice, check_number, check_positive_int
from labkit.model.shapes import ShapeArithmetic

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
"""The model families labkit.model builds (HF ``model_type`` values)."""
MODEL_TYPES = (*FAMILIES, "gpt2")
"""Families a ModelConfig sizes: those it builds, and GPT-2/3 (the 175B GPT-3 of the capstone; sized only)."""
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""RoPE scalings labkit.model implements (HF ``rope_scaling['rope_type']``)."""
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling variant and its parameters, named as in HF's ``rope_parameters`` (see ``rope.py``).

    ``factor``: all types. ``original_max_position_embeddings``: 'llama3' and 'yarn' (the pre-training length).
    'llama3': ``low_freq_factor``, ``high_freq_factor``. 'yarn': ``attention_factor`` (None: from ``factor``,
    ``mscale``, ``mscale_all_dim``), ``beta_fast``, ``beta_slow``, ``truncate``.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; allowed: {ROPE_TYPES[1:]}")
        if self.factor is None or self.factor <= 0:
            raise ValueError(f"rope_scaling factor={self.factor!r} must be a positive number")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"rope_scaling type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None
                                           or self.high_freq_factor <= self.low_freq_factor):
            raise ValueError(f"rope_scaling 'llama3' needs low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ShapeArithmetic):
    """A decoder's shape and features (HF names in brackets where ours differ), and the arithmetic of its size
    (``ShapeArithmetic``: parameters, bytes, FLOPs, KV bytes per token).

    ``num_layers`` [num_hidden_layers], ``num_heads`` [num_attention_heads], ``num_kv_heads``
    [num_key_value_heads] (default ``num_heads``); ``head_dim`` (default ``hidden_size // num_heads``) may differ
    (Gemma, Qwen3). ``layer_types`` holds 'full_attention' or 'sliding_attention' per layer; a sliding layer's queries
    see the ``sliding_window`` newest keys (themselves included), as HF's mask does (key > query - window).
    ``norm_offset`` is 1.0 for Gemma's ``x * (1 + w)`` RMSNorm and 0.0 for Llama's ``x * w``; ``embed_scale``
    multiplies the embeddings (Gemma: sqrt(hidden_size)). ``fused_checkpoint``: the checkpoint stores q/k/v as one
    ``qkv_proj`` and gate/up as one ``gate_up_proj`` (Phi-3). ``dtype``: the checkpoint's declared dtype name (or
    None). ``eos_token_ids``: every end-of-sequence id of ``config.json`` and ``generation_config.json``.
    ``name``: a label (a preset's name). ``model_type='gpt2'`` (GPT-2/3: ``gated_mlp=False``, ``norm_bias``,
    ``learned_positions``, no RoPE) is sized here but has no ``labkit.model`` decoder (``BUILDABLE``).
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    name: str = ""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    gated_mlp: bool = True
    norm_bias: bool = False
    learned_positions: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: float | None = None
    fused_checkpoint: bool = False
    dtype: str | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        check_choice("model_type", self.model_type, MODEL_TYPES)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "max_position_embeddings"):
            check_positive_int(name, getattr(self, name))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        check_positive_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                                 f"give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        check_positive_int("head_dim", self.head_dim)
        check_choice("hidden_act", self.hidden_act, ACTIVATIONS)
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types={self.layer_types!r} must hold {self.num_layers} entries from "
                             f"{LAYER_TYPES}")
        check_positive_int("sliding_window", self.sliding_window, none_ok=True)
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "gated_mlp", "norm_bias",
                     "learned_positions", "fused_checkpoint"):
            check_bool(name, getattr(self, name))
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give an "
                             f"even rotary dim (head_dim={self.head_dim})")
        check_number("rms_norm_eps", self.rms_norm_eps, 0, 1, low_open=True, high_open=True)
        # GPT-2/3 have no RoPE: rope_theta 0 says so
        check_number("rope_theta", self.rope_theta, 0, low_open=self.model_type != "gpt2")

    # --- HF's names, so code written for an HF config reads ours (PagedKVCache.for_model, ModelSpec, ...) ---
    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def eos_token_id(self) -> int | None:
        """The first of ``eos_token_ids`` (HF's single-id view; a stop check should use ``eos_token_ids``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # --- derived sizes (the rest: ShapeArithmetic) ------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (all of them unless ``partial_rotary_factor < 1``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to its whole context."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    # --- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """From a Hugging Face config object (``model.config``) or its ``to_dict()``."""
        return cls.from_dict(config if isinstance(config, dict) else config.to_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """From a local checkpoint directory's ``config.json`` (and ``generation_config.json``'s EOS ids).

        The file is read as HF's own ``AutoConfig`` reads it (defaults of the family's config class, legacy
        keys converted), after the family is checked, so an unknown ``model_type`` is refused by name."""
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise ValueError(f"path={str(path)!r} holds no config.json: not a Hugging Face checkpoint directory")
        raw = json.loads(file.read_text())
        _check_family(raw)
        from transformers import AutoConfig

        d = AutoConfig.from_pretrained(path).to_dict()
        gen = path / "generation_config.json"
        extra = _as_ids(json.loads(gen.read_text()).get("eos_token_id")) if gen.is_file() else ()
        cfg = cls.from_dict(d)
        ids = tuple(dict.fromkeys(cfg.eos_token_ids + extra))
        return cls(**{**cfg.__dict__, "eos_token_ids": ids})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a config dict (a config's ``to_dict()``, or ``config.json``'s keys); refuses what it cannot run.

        A raw ``config.json`` dict gets the family defaults of its quirks only (Gemma's activation and tied
        embeddings); ``from_pretrained`` and ``from_hf`` see every default of HF's config class."""
        _check_family(d)
        family = d["model_type"]
        if family == "gpt2":
            return _gpt2(d)
        _refuse_unsupported(d)
        heads = d["num_attention_heads"]
        layers = d["num_hidden_layers"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope = _rope_parameters(d)
        act = d.get("hidden_act") or ("gelu_pytorch_tanh" if family == "gemma" else "silu")
        if family == "gemma":
            # HF's GemmaConfig maps the legacy "gelu" of the official releases to the tanh approximation, and its
            # 4.x configs named the field hidden_activation.
            act = d.get("hidden_activation") or act
            act = "gelu_pytorch_tanh" if act == "gelu" else act
        partial = float(rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
        if partial != 1.0 and family != "phi3":
            raise ValueError(f"partial_rotary_factor={partial} on model_type={family!r}: HF's {family} rotates "
                             f"the whole head; only phi3 supports a partial rotary factor")
        bias = bool(d.get("attention_bias") or False)
        qkv_bias, o_bias = {"qwen2": (True, False), "mistral": (False, False), "phi3": (False, False)}.get(
            family, (bias, bias))
        window, layer_types = _sliding(d, family, layers)
        return cls(
            model_type=family, name=d.get("_name_or_path") or family, vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=layers, num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(rope.pop("rope_theta")),
            rope_scaling=_scaling(rope), partial_rotary_factor=partial,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family == "gemma")),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=family == "llama" and bool(d.get("mlp_bias")),
            qk_norm=family == "qwen3", sliding_window=window, layer_types=layer_types, hidden_act=act,
            norm_offset=1.0 if family == "gemma" else 0.0,
            embed_scale=d["hidden_size"] ** 0.5 if family == "gemma" else None,
            fused_checkpoint=family == "phi3", dtype=_dtype_name(d.get("dtype") or d.get("torch_dtype")),
            eos_token_ids=_as_ids(d.get("eos_token_id")))

    def with_name(self, name: str) -> ModelConfig:
        return replace(self, name=name)

    def to_hf_config(self):
        """A Hugging Face config of this shape: ``LlamaConfig`` (the presets), or ``GPT2Config`` for 'gpt2'. Other
        families come from their checkpoint's own config (``AutoConfig``)."""
        from transformers import GPT2Config, LlamaConfig

        if self.model_type == "gpt2":
            return GPT2Config(vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_layers,
                              n_head=self.num_heads, n_inner=self.intermediate_size,
                              n_positions=self.max_position_embeddings, layer_norm_epsilon=self.rms_norm_eps)
        if self.model_type != "llama" or self.rope_scaling is not None:
            raise ValueError(f"to_hf_config builds plain Llama and GPT-2 configs, not model_type="
                             f"{self.model_type!r} with rope_scaling={self.rope_scaling}; read its checkpoint's")
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, intermediate_size=self.intermediate_size,
                           head_dim=self.head_dim, tie_word_embeddings=self.tie_word_embeddings,
                           max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias,
                           bos_token_id=1, eos_token_id=2, pad_token_id=None)


def _gpt2(d: dict[str, Any]) -> ModelConfig:
    """GPT-2 / GPT-3's shape from a ``GPT2Config`` dict: ungated GELU MLP, LayerNorms with biases, biases on every
    projection, learned positions, tied embeddings (sized only: no labkit.model decoder runs it)."""
    missing = [k for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions") if d.get(k) is None]
    if missing:
        raise ValueError(f"model_type='gpt2' needs GPT-2's keys; missing {missing}")
    h = d["n_embd"]
    return ModelConfig(model_type="gpt2", name=d.get("_name_or_path") or "gpt2-like", vocab_size=d["vocab_size"],
                       hidden_size=h, intermediate_size=d.get("n_inner") or 4 * h, num_layers=d["n_layer"],
                       num_heads=d["n_head"], max_position_embeddings=d["n_positions"],
                       rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)), rope_theta=0.0,
                       tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False,
                       norm_bias=True, learned_positions=True, hidden_act=d.get("activation_function", "gelu_new"),
                       eos_token_ids=_as_ids(d.get("eos_token_id")))


# --- reading HF's keys --------------------------------------------------------------------------------------
def _check_family(d: dict[str, Any]) -> None:
    family = d.get("model_type")
    if family not in MODEL_TYPES:
        raise ValueError(f"model_type={family!r} is not supported by labkit.model; allowed: {MODEL_TYPES} (a "
                         f"decoder of {FAMILIES}, or the shape of GPT-2/3)")


# Keys whose presence (with a value that turns them on) means a feature labkit.model does not implement.
_UNSUPPORTED = {
    "quantization_config": "a quantised checkpoint (quantization_config); load the unquantised weights and "
                           "quantise them with labkit.quant",
    "use_bidirectional_attention": "use_bidirectional_attention (bidirectional Gemma)",
    "attn_logit_softcapping": "attn_logit_softcapping (attention logit soft-capping)",
    "final_logit_softcapping": "final_logit_softcapping (logit soft-capping)",
    "num_local_experts": "num_local_experts (mixture of experts)",
    "num_experts": "num_experts (mixture of experts)",
}


def _refuse_unsupported(d: dict[str, Any]) -> None:
    for key, what in _UNSUPPORTED.items():
        if d.get(key):
            raise ValueError(f"model_type={d['model_type']!r}: {what} is not supported by labkit.model "
                             f"({key}={d[key]!r})")


def _rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """HF's ``rope_parameters`` dict (v5), or one built from the v4 keys ``rope_scaling`` and ``rope_theta``, as
    ``RotaryEmbeddingConfigMixin.standardize_rope_params`` builds it."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    layer_types = d.get("layer_types") or ()
    if any(k in layer_types for k in rope):
        raise ValueError(f"model_type={d['model_type']!r}: per-layer-type rope_parameters {sorted(rope)} are "
                         f"not supported")
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)
    rope.setdefault("rope_theta", d.get("rope_theta") or 10000.0)
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope["original_max_position_embeddings"] = (d.get("original_max_position_embeddings")
                                                    or rope.get("original_max_position_embeddings")
                                                    or d.get("max_position_embeddings"))
    if rope["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"model_type={d['model_type']!r}: rope_scaling type {rope['rope_type']!r} is not "
                         f"supported by labkit.model; allowed: {ROPE_TYPES}")
    return rope


_SCALING_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                 "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def _scaling(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.pop("rope_type")
    unknown = sorted(set(rope) - set(_SCALING_KEYS))
    if unknown:
        raise ValueError(f"rope_scaling {kind!r}: parameters {unknown} are not supported by labkit.model")
    if kind == "default":
        return None
    kw = {k: rope[k] for k in _SCALING_KEYS if rope.get(k) is not None}
    return RopeScaling(rope_type=kind, **kw)


def _sliding(d: dict[str, Any], family: str, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The window and each layer's type, as each family's HF attention picks them."""
    if family in ("mistral", "phi3"):  # one window on every layer (HF ignores layer_types here)
        window = d.get("sliding_window")
        return window, (("sliding_attention" if window else "full_attention"),) * layers
    if family in ("qwen2", "qwen3"):
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        types = d.get("layer_types") or [
            "sliding_attention" if window is not None and i >= d.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)]
        for t in types:
            if t not in LAYER_TYPES:
                raise ValueError(f"model_type={family!r}: layer type {t!r} is not supported; allowed: "
                                 f"{LAYER_TYPES}")
        # A 'sliding_attention' layer without a window attends fully, as in HF (sliding_window=None).
        return window, tuple(t if window is not None else "full_attention" for t in types)
    return None, ("full_attention",) * layers  # llama, gemma: HF's attention takes no window


def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(i) for i in v) if isinstance(v, (list, tuple)) else (int(v),)


def _dtype_name(v: Any) -> str | None:
    if v is None:
        return None
    return str(v).removeprefix("torch.")
