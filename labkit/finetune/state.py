"""What a training step holds across steps, counted from a model's shape: the ``TrainSetup`` (what trains, in which
precision, with which optimizer, how it is sharded), the parameter inventory of a Hugging Face Llama checkpoint, and
the bytes of weights (fp32, bf16 or NF4), LoRA adapters, gradients and optimizer state per rank. The activations
are counted in ``activations.py``; ``memory_model.py`` puts both together at the moments memory peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.finetune.lora import LLAMA_LINEARS
from labkit.model import ModelConfig

METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "bf16-mixed")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
GELU_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
NF4_BLOCK, NF4_BLOCK2 = 64, 256  # bitsandbytes: 64 weights per absmax, 256 absmaxes per second-level scale
ADAM8_BLOCK, ADAM8_MIN_SIZE = 256, 4096  # bitsandbytes 8-bit optimizers: block size, smaller tensors stay fp32


@dataclass(frozen=True)
class TrainSetup:
    """How a model is trained: what trains, in which precision, with which optimizer, how it is sharded.

    ``precision``: ``fp32``, or ``bf16-mixed`` (fp32 trainable weights, gradients and optimizer state; matmuls
    under ``torch.autocast`` in bf16). ``base_dtype``: the dtype of frozen weights under LoRA / QLoRA (``bf16``
    halves them and needs ``bf16-mixed``); full fine-tuning keeps fp32 master weights. ``zero_stage`` 1/2/3
    shards optimizer state / + gradients / + weights over ``data_parallel`` ranks (stage 3 is FSDP's full
    sharding); ``tensor_parallel`` splits every linear layer and the vocabulary (Megatron-style, without sequence
    parallelism). ``device`` matters for one term: the bitsandbytes CPU backend of 8-bit AdamW dequantises each
    tensor's moments to fp32 temporaries while it updates it, where the CUDA kernel works in registers.
    """

    method: str = "full"
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    checkpointing: bool = False
    batch_size: int = 1
    seq_len: int = 2048
    lora_rank: int = 8
    base_dtype: str = "fp32"
    lora_targets: tuple[str, ...] | None = None  # None: every linear of the decoder layers
    zero_stage: int = 0
    data_parallel: int = 1
    tensor_parallel: int = 1
    device: str = "cuda"

    def __post_init__(self) -> None:
        for arg, value, allowed in (("method", self.method, METHODS), ("precision", self.precision, PRECISIONS),
                                    ("optimizer", self.optimizer, OPTIMIZERS),
                                    ("zero_stage", self.zero_stage, (0, 1, 2, 3)),
                                    ("device", self.device, ("cuda", "cpu")),
                                    ("base_dtype", self.base_dtype, ("fp32", "bf16"))):
            if value not in allowed:
                raise ValueError(f"{arg}={value!r} is unknown; allowed: {list(allowed)}")
        for arg in ("batch_size", "seq_len", "lora_rank", "data_parallel", "tensor_parallel"):
            v = getattr(self, arg)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{arg}={v!r} must be a positive int")
        if self.zero_stage and self.data_parallel == 1:
            raise ValueError(f"zero_stage={self.zero_stage} shards over data_parallel ranks; data_parallel=1 "
                             f"shards nothing (use zero_stage=0, or data_parallel > 1)")
        if self.base_dtype == "bf16" and (self.method == "full" or self.precision != "bf16-mixed"):
            raise ValueError(f"base_dtype='bf16' needs method 'lora' or 'qlora' with precision 'bf16-mixed' (got "
                             f"method={self.method!r}, precision={self.precision!r}): full fine-tuning keeps fp32 "
                             f"master weights, and fp32 adapters cannot multiply bf16 inputs without autocast")
        if self.lora_targets is not None:
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
            if not self.lora_targets:
                raise ValueError("lora_targets is empty; pass None for every linear, or name at least one")

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def frozen_bytes(self) -> float:
        """Bytes per frozen (non-NF4) weight."""
        return 2.0 if self.base_dtype == "bf16" else 4.0


@dataclass(frozen=True)
class ParamTensor:
    """One weight tensor of a model: ``kind`` is 'embedding', 'lm_head', 'norm' or 'linear' (``linear`` names
    which one, e.g. 'q_proj'); ``layer`` is None outside the decoder layers."""

    name: str
    shape: tuple[int, ...]
    kind: str
    linear: str | None = None
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def linear_names(spec: ModelConfig) -> tuple[str, ...]:
    return LLAMA_LINEARS if spec.gated_mlp else GELU_LINEARS


def param_inventory(spec: ModelConfig) -> list[ParamTensor]:
    """Every weight tensor of ``spec``, in the order of a Hugging Face Llama checkpoint (biases not counted)."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    out = [ParamTensor("embed_tokens", (spec.vocab_size, h), "embedding")]
    for layer in range(spec.num_layers):
        for name in linear_names(spec):
            out.append(ParamTensor(f"layers.{layer}.{name}", shapes[name], "linear", name, layer))
        out.append(ParamTensor(f"layers.{layer}.input_layernorm", (h,), "norm", None, layer))
        out.append(ParamTensor(f"layers.{layer}.post_attention_layernorm", (h,), "norm", None, layer))
    out.append(ParamTensor("norm", (h,), "norm"))
    if not spec.tie_word_embeddings:
        out.append(ParamTensor("lm_head", (spec.vocab_size, h), "lm_head"))
    return out


def nf4_bytes(numel: int) -> float:
    """Bytes of one NF4 weight with double quantisation, as bitsandbytes stores it: packed 4-bit values, one
    uint8 absmax per 64 weights, one fp32 scale per 256 absmaxes, the 256-entry fp32 code of the absmax
    quantiser, the 16-entry NF4 code and one fp32 offset."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return numel / 2 + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + 4 * 256 + 4 * 16 + 4


def is_adapted(setup: TrainSetup, name: str | None) -> bool:
    """Whether the linear ``name`` ('q_proj', ...) carries a LoRA adapter under ``setup``."""
    if setup.method == "full" or name is None:
        return False
    return setup.lora_targets is None or name in setup.lora_targets


def lora_shapes(spec: ModelConfig, setup: TrainSetup) -> list[tuple[int, int]]:
    """(in, out) of every adapted linear."""
    return [(p.shape[1], p.shape[0]) for p in param_inventory(spec) if is_adapted(setup, p.linear)]


# --- weights, gradients, optimizer state --------------------------------------------------------------------
def tp_divisor(p: ParamTensor, tp: int) -> int:
    """Tensor parallelism splits linears and the vocabulary; norms are replicated."""
    return 1 if p.kind == "norm" else tp


def weight_bytes(spec: ModelConfig, setup: TrainSetup) -> dict[str, float]:
    """Base weights (fp32 masters, or NF4 for QLoRA's targets) and LoRA adapters (fp32), per TP rank."""
    base = adapters = 0.0
    for p in param_inventory(spec):
        n = p.numel / tp_divisor(p, setup.tensor_parallel)
        if setup.method == "qlora" and is_adapted(setup, p.linear):
            base += nf4_bytes(n)
        else:
            base += (4.0 if setup.method == "full" else setup.frozen_bytes) * n
    for fan_in, fan_out in lora_shapes(spec, setup):
        adapters += 4.0 * setup.lora_rank * (fan_in + fan_out) / setup.tensor_parallel
    return {"base": base, "adapters": adapters}


def trainable_tensors(spec: ModelConfig, setup: TrainSetup) -> list[int]:
    """Element counts of the trainable tensors (per TP rank): every weight, or the adapters' A and B."""
    tp = setup.tensor_parallel
    if setup.method == "full":
        return [p.numel // tp_divisor(p, tp) for p in param_inventory(spec)]
    r = setup.lora_rank
    return [n for fi, fo in lora_shapes(spec, setup) for n in (r * fi // tp, r * fo // tp)]


def optimizer_bytes(numels: list[int], optimizer: str) -> float:
    """Optimizer state for tensors of these sizes (fp32 parameters).

    ``adamw``: two fp32 moments and a step counter per tensor (torch's fused AdamW). ``adamw8bit``: bitsandbytes
    blockwise 8-bit moments (1 byte each plus an fp32 absmax per 256) for tensors of at least 4096 elements,
    fp32 moments for smaller ones, and the two 256-entry quantisation maps, shared. ``sgd``: none.
    """
    if optimizer == "sgd":
        return 0.0
    if optimizer == "adamw":
        return sum(8.0 * n + 4.0 for n in numels)
    if optimizer == "adamw8bit":
        total, any8 = 0.0, False
        for n in numels:
            if n >= ADAM8_MIN_SIZE:
                total += 2 * (n + 4 * math.ceil(n / ADAM8_BLOCK))
                any8 = True
            else:
                total += 8.0 * n
        return total + (2 * 4 * 256 if any8 else 0)
    raise ValueError(f"optimizer={optimizer!r} is unknown; allowed: {list(OPTIMIZERS)}")
