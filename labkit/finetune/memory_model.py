"""The memory of training a transformer, against the memory of serving it, from its shape (``ModelSpec``).

Inference holds the weights and a KV cache that grows with every token. Training holds no KV cache but, per
trainable weight, a gradient and optimizer state (Adam: two moments, 8 bytes in fp32, ~2 in 8-bit), and, per
token, every activation that backward will need. This module counts all of them for Hugging Face's Llama
implementation as it runs under ``labkit.finetune.train`` (full fine-tuning, LoRA or QLoRA; fp32 or bf16 autocast;
with or without activation checkpointing; AdamW, 8-bit AdamW or SGD), and divides them as ZeRO / FSDP
(data-parallel sharding) and tensor parallelism would.

The activation count is not a rule of thumb: it lists the tensors autograd saves, op by op (which tensors an op
saves depends on which of its inputs need a gradient, so it differs between full fine-tuning and LoRA), and the
buffers alive at the moments memory peaks. Peak = the state that lives across steps (weights, optimizer state)
plus the largest of these moments:

* ``head_backward``: every saved activation, plus the gradients of the log-probabilities and of the logits
  ([tokens, vocab] fp32 each) while the log-softmax output is still alive. Largest when activations dominate.
* ``lm_head_backward``: the log-softmax output freed, the logits' gradient, the LM head's weight gradient.
* ``end_of_backward``: all activations freed, every gradient allocated, plus the embedding's backward buffers.
* with checkpointing, ``recompute``: the layer inputs kept, one layer's activations recomputed, its gradients.
* with 8-bit AdamW on the CPU, ``optimizer_step``: every gradient, plus bitsandbytes' fp32 temporaries.

Other architectures (GPT-3's GELU MLP) are counted with the same enumeration, the MLP's terms adjusted: for them
the numbers are predictions, checked here only on the Llama family.

``labkit.experiments.finetuning`` measures the same peak on the CPU and the GPU; the tests and notebook 07 compare
them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from labkit.finetune.lora import LLAMA_LINEARS
from labkit.models import ModelSpec, dtype_bytes, get_spec

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


def linear_names(spec: ModelSpec) -> tuple[str, ...]:
    return LLAMA_LINEARS if spec.mlp == "swiglu" else GELU_LINEARS


def param_inventory(spec: ModelSpec) -> list[ParamTensor]:
    """Every weight tensor of ``spec``, in the order of a Hugging Face Llama checkpoint (biases not counted)."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    out = [ParamTensor("embed_tokens", (spec.vocab_size, h), "embedding")]
    for layer in range(spec.num_layers):
        for name in linear_names(spec):
            out.append(ParamTensor(f"layers.{layer}.{name}", shapes[name], "linear", name, layer))
        out.append(ParamTensor(f"layers.{layer}.input_layernorm", (h,), "norm", None, layer))
        out.append(ParamTensor(f"layers.{layer}.post_attention_layernorm", (h,), "norm", None, layer))
    out.append(ParamTensor("norm", (h,), "norm"))
    if not spec.tie_embeddings:
        out.append(ParamTensor("lm_head", (spec.vocab_size, h), "lm_head"))
    return out


def nf4_bytes(numel: int) -> float:
    """Bytes of one NF4 weight with double quantisation, as bitsandbytes stores it: packed 4-bit values, one
    uint8 absmax per 64 weights, one fp32 scale per 256 absmaxes, the 256-entry fp32 code of the absmax
    quantiser, the 16-entry NF4 code and one fp32 offset."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return numel / 2 + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + 4 * 256 + 4 * 16 + 4


def _adapted(setup: TrainSetup, name: str | None) -> bool:
    if setup.method == "full" or name is None:
        return False
    return setup.lora_targets is None or name in setup.lora_targets


def _lora_shapes(spec: ModelSpec, setup: TrainSetup) -> list[tuple[int, int]]:
    """(in, out) of every adapted linear."""
    return [(p.shape[1], p.shape[0]) for p in param_inventory(spec) if _adapted(setup, p.linear)]


@dataclass
class MemoryBreakdown:
    """Bytes of each kind of tensor (per GPU after sharding), and the peak.

    ``weights``, ``grads``, ``optimizer_states``: the full size of each. ``activations``: tensors saved for
    backward. ``transient``: the largest buffer set alive only at the peak moment. ``peak`` is the phase model's
    answer (grads and activations are never both at full size at once), ``at_peak`` what it is made of (sums to
    ``peak``); ``total`` is the naive sum of the full sizes.
    """

    weights: float = 0.0
    grads: float = 0.0
    optimizer_states: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    transient: float = 0.0
    peak: float = 0.0
    peak_phase: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    at_peak: dict[str, float] = field(default_factory=dict)
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer_states + self.activations + self.kv_cache + \
            self.transient

    def to_dict(self) -> dict:
        return dict(asdict(self), total=self.total)


# --- weights, gradients, optimizer state --------------------------------------------------------------------
def _tp_div(p: ParamTensor, tp: int) -> int:
    """Tensor parallelism splits linears and the vocabulary; norms are replicated."""
    return 1 if p.kind == "norm" else tp


def weight_bytes(spec: ModelSpec, setup: TrainSetup) -> dict[str, float]:
    """Base weights (fp32 masters, or NF4 for QLoRA's targets) and LoRA adapters (fp32), per TP rank."""
    base = adapters = 0.0
    for p in param_inventory(spec):
        n = p.numel / _tp_div(p, setup.tensor_parallel)
        if setup.method == "qlora" and _adapted(setup, p.linear):
            base += nf4_bytes(n)
        else:
            base += (4.0 if setup.method == "full" else setup.frozen_bytes) * n
    for fan_in, fan_out in _lora_shapes(spec, setup):
        adapters += 4.0 * setup.lora_rank * (fan_in + fan_out) / setup.tensor_parallel
    return {"base": base, "adapters": adapters}


def trainable_tensors(spec: ModelSpec, setup: TrainSetup) -> list[int]:
    """Element counts of the trainable tensors (per TP rank): every weight, or the adapters' A and B."""
    tp = setup.tensor_parallel
    if setup.method == "full":
        return [p.numel // _tp_div(p, tp) for p in param_inventory(spec)]
    r = setup.lora_rank
    return [n for fi, fo in _lora_shapes(spec, setup) for n in (r * fi // tp, r * fo // tp)]


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


# --- activations --------------------------------------------------------------------------------------------
def _nf4_out_bytes(setup: TrainSetup) -> float:
    """bitsandbytes' Linear4bit returns its input's dtype: the fp32 norm output, or bf16 with a bf16 base."""
    return 2.0 if setup.base_dtype == "bf16" else 4.0


def layer_activation_bytes(spec: ModelSpec, setup: TrainSetup, first_layer: bool = False) -> dict[str, float]:
    """Bytes per token that one decoder layer saves for backward (per TP rank), term by term.

    ``first_layer``: under LoRA the embedding is frozen, so the first layer's input needs no gradient and its
    first norm saves nothing. fp32 residual and norm internals (HF's RMSNorm computes in fp32); ``c`` is the
    matmul dtype's size (2 under bf16 autocast, which also casts each linear's input separately, so q, k and v
    each keep their own bf16 copy of the normed input); ``o`` the dtype of the linears' outputs (NF4 layers
    return their input's dtype, fp32).
    """
    h, i, q, kv, heads = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim, spec.num_heads
    tp = setup.tensor_parallel
    mixed = setup.precision == "bf16-mixed"
    c = 2.0 if mixed else 4.0
    o = _nf4_out_bytes(setup) if setup.method == "qlora" else c
    shared = not mixed or setup.base_dtype == "bf16"  # the normed input is already in the matmul dtype
    full = setup.method == "full"
    lora = not full
    r = setup.lora_rank

    def needs_input(name: str) -> bool:  # a linear keeps its input if its weight or its adapter trains
        return full or _adapted(setup, name)

    def inputs(names: tuple[str, ...]) -> float:  # one shared normed tensor, or autocast's copy per linear
        n = sum(needs_input(nm) for nm in names)
        return c * h * (n > 0) if shared else c * h * n

    mlp_in = ("gate_proj", "up_proj") if spec.mlp == "swiglu" else ("up_proj",)
    terms = {
        "norm1 input + rstd": 0.0 if (first_layer and lora) else 4.0 * (h + 1),
        "norm1 normalized (weight grad)": 4.0 * h if full else 0.0,
        "q/k/v inputs": inputs(("q_proj", "k_proj", "v_proj")),
        "attention q, k, v, out": (c * (2 * q + 2 * kv) + 4.0 * heads) / tp,
        "norm2 input + rstd": 4.0 * (h + 1),
        "norm2 normalized (weight grad)": 4.0 * h if full else 0.0,
        "mlp inputs": inputs(mlp_in),
        "lora x A^T": sum(c * r for nm in linear_names(spec) if _adapted(setup, nm)) / tp,
    }
    if spec.mlp == "swiglu":  # silu saves gate; the product saves silu(gate) and up; down saves the product
        terms["mlp gate, silu(gate), up"] = 3 * o * i / tp
        terms["mlp down input"] = (c * i if needs_input("down_proj") else 0.0) / tp
    else:  # gelu saves its input; down saves gelu's output
        terms["mlp up output, gelu output"] = (o * i + (c * i if needs_input("down_proj") else 0.0)) / tp
    return terms


def head_activation_bytes(spec: ModelSpec, setup: TrainSetup) -> dict[str, float]:
    """Bytes per token saved by the final norm, the LM head and the loss (log-softmax output in fp32, as HF
    upcasts the logits before the loss), per TP rank (vocabulary-parallel head)."""
    h, v = spec.hidden_size, spec.vocab_size
    full = setup.method == "full"
    c = 2.0 if setup.precision == "bf16-mixed" else 4.0
    return {
        "final norm input + rstd": 4.0 * (h + 1),
        "final norm normalized + lm_head input": (4.0 * h + c * h) if full else 0.0,
        "log-softmax output": 4.0 * v / setup.tensor_parallel,
        "labels": 8.0,
    }


def autocast_weight_copies(spec: ModelSpec, setup: TrainSetup) -> dict[str, float]:
    """bf16 copies of fp32 weights that autocast makes and autograd keeps until backward (bytes, per TP rank),
    for the decoder layers and for the head.

    A linear keeps its (bf16) weight to compute its input's gradient, so every dense fp32 linear does unless its
    input needs no gradient (the first layer's q/k/v under LoRA); NF4 layers keep their packed weight instead, and
    a bf16 base needs no copy. The (tied) LM head and the adapters are copied too. Under checkpointing a layer's
    copies live only while that layer is recomputed.
    """
    out = {"layers": 0.0, "head": 0.0}
    if setup.precision != "bf16-mixed":
        return out
    r = setup.lora_rank
    out["layers"] += sum(2.0 * r * (fi + fo) for fi, fo in _lora_shapes(spec, setup)) / setup.tensor_parallel
    if setup.base_dtype == "bf16":  # frozen weights already in bf16: nothing to copy but the adapters
        return out
    for p in param_inventory(spec):
        div = _tp_div(p, setup.tensor_parallel)
        if p.kind == "linear":
            nf4 = setup.method == "qlora" and _adapted(setup, p.linear)
            no_input_grad = setup.method != "full" and p.layer == 0 and p.linear in ("q_proj", "k_proj", "v_proj")
            if not nf4 and not no_input_grad:
                out["layers"] += 2.0 * p.numel / div
        elif p.kind == "lm_head" or (p.kind == "embedding" and spec.tie_embeddings):
            out["head"] += 2.0 * p.numel / div
    return out


def activation_bytes(spec: ModelSpec, setup: TrainSetup) -> dict[str, float]:
    """Saved activations of one step on one rank, by part: layers, head, rotary tables, autocast copies.

    With checkpointing, each layer keeps only its input (fp32, [tokens, hidden]) and recomputes the rest in
    backward, one layer at a time (that layer's share is counted in the ``recompute`` phase of ``training_memory``).
    """
    t, s = setup.tokens, setup.seq_len
    copies = autocast_weight_copies(spec, setup)
    if setup.checkpointing:
        layers = spec.num_layers * 4.0 * spec.hidden_size * t
        copies["layers"] = 0.0
    else:
        per = sum(layer_activation_bytes(spec, setup).values())
        first = sum(layer_activation_bytes(spec, setup, first_layer=True).values())
        layers = t * (first + (spec.num_layers - 1) * per)
    return {
        "layers": layers,
        "head": t * sum(head_activation_bytes(spec, setup).values()),
        # [seq, head_dim] in the residual stream's dtype, shared by all layers and the whole batch
        "rotary cos/sin": 2 * setup.frozen_bytes * s * spec.head_dim,
        "autocast weight copies": copies["layers"] + copies["head"],
    }


# --- the whole step -----------------------------------------------------------------------------------------
def training_memory(spec: ModelSpec | str, setup: TrainSetup) -> MemoryBreakdown:
    """Memory of one training step on one rank, by kind and at its peak (see the module docstring)."""
    spec = get_spec(spec)
    if setup.method != "full" and setup.lora_targets is not None:
        allowed = linear_names(spec)
        unknown = [t for t in setup.lora_targets if t not in allowed]
        if unknown:
            raise ValueError(f"lora_targets {unknown} are not linears of {spec.name}; allowed: {list(allowed)}")
    t, h, v = setup.tokens, spec.hidden_size, spec.vocab_size
    tp, dp, zero = setup.tensor_parallel, setup.data_parallel, setup.zero_stage
    w = weight_bytes(spec, setup)
    numels = trainable_tensors(spec, setup)
    weights = sum(w.values()) / (dp if zero >= 3 else 1)
    grads = 4.0 * sum(numels) / (dp if zero >= 2 else 1)
    optim = optimizer_bytes(numels, setup.optimizer) / (dp if zero >= 1 else 1)
    acts = activation_bytes(spec, setup)
    saved = sum(acts.values())
    batch = 8.0 * t  # the int64 input ids
    static = weights + optim + batch
    full, mixed = setup.method == "full", setup.precision == "bf16-mixed"
    head_w_grad = 4.0 * v * h / tp if full else 0.0
    logits = 4.0 * t * v / tp
    # each moment: (saved activations alive, gradients alive, transient buffers)
    moments = {
        # grad of the log-probs and grad of the logits, while the log-softmax output is still alive
        "head_backward": (saved, 0.0, 2 * logits),
        # log-softmax output freed; grad of the logits, the head's weight grad and the hidden-state grad alive
        "lm_head_backward": (saved - logits, head_w_grad, logits + 4.0 * t * h),
        # every gradient allocated; a tied embedding adds its lookup's grad to the head's grad, in place when
        # the head's grad is a fresh tensor (autocast's cast back to fp32), into a third buffer when it is not
        "end_of_backward": (0.0, grads, head_w_grad * (1 if mixed else 2) if spec.tie_embeddings else 0.0),
    }
    if setup.optimizer == "adamw8bit" and setup.device == "cpu":
        # the largest tensor's two moments dequantised, its grad upcast, sqrt(v) and the denominator, in fp32
        moments["optimizer_step"] = (0.0, grads, 5 * 4.0 * max(numels))
    if setup.checkpointing:
        # the last layer recomputed: the layer inputs, its activations, the incoming hidden-state grad, the head's
        # weight grad, and the grads of the MLP's [tokens, intermediate] tensors as they are formed
        o = _nf4_out_bytes(setup) if setup.method == "qlora" else (2.0 if mixed else 4.0)
        layer = sum(layer_activation_bytes(spec, setup).values()) * t + \
            autocast_weight_copies(spec, setup)["layers"] / spec.num_layers
        moments["recompute"] = (saved - acts["head"] + layer, head_w_grad,
                                4.0 * t * h + 3 * o * t * spec.intermediate_size / tp)
    if zero >= 3:  # FSDP gathers one layer's weights (and prefetches the next) in compute precision
        gathered = 2 * (2.0 if setup.precision == "bf16-mixed" else 4.0) * spec.layer_params / tp
        moments = {k: (a, g, x + gathered) for k, (a, g, x) in moments.items()}
    phases = {k: static + sum(m) for k, m in moments.items()}
    phase = max(phases, key=phases.get)
    alive = dict(zip(("activations", "grads", "transient"), moments[phase], strict=True))
    at_peak = {"weights": weights, "optimizer": optim, "batch": batch, **alive}
    return MemoryBreakdown(weights=weights, grads=grads, optimizer_states=optim, activations=saved,
                           transient=moments[phase][2], peak=phases[phase], peak_phase=phase, phases=phases,
                           at_peak=at_peak,
                           detail={**{f"weights: {k}": val for k, val in w.items()},
                                   **{f"activations: {k}": val for k, val in acts.items()}, "batch": batch})


def inference_memory(spec: ModelSpec | str, batch_size: int, context_len: int, weight_dtype: str = "bf16",
                     kv_dtype: str = "bf16") -> MemoryBreakdown:
    """Serving memory: the weights once, a KV cache of ``batch_size * context_len`` tokens, and the transient
    working set of a decode step (one token's logits in fp32 per sequence). No gradients, no optimizer state,
    no saved activations: the KV cache is the part that grows."""
    spec = get_spec(spec)
    if batch_size < 1 or context_len < 1:
        raise ValueError(f"batch_size={batch_size} and context_len={context_len} must be positive")
    weights = spec.weight_bytes(weight_dtype)
    kv = spec.kv_bytes(batch_size * context_len, kv_dtype)
    transient = batch_size * (4.0 * spec.vocab_size + dtype_bytes(weight_dtype) * (
        2 * spec.hidden_size + 2 * spec.intermediate_size))
    total = weights + kv + transient
    return MemoryBreakdown(weights=weights, kv_cache=kv, transient=transient, peak=total, peak_phase="decode",
                           phases={"decode": total})
