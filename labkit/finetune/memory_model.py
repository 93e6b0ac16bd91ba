"""The memory of training a transformer, against the memory of serving it, from its shape (``ModelConfig``).

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

from dataclasses import asdict, dataclass, field

from labkit.finetune.activations import activation_bytes, autocast_weight_copies, layer_activation_bytes, nf4_out_bytes
from labkit.finetune.state import TrainSetup, linear_names, optimizer_bytes, trainable_tensors, weight_bytes
from labkit.model import ModelConfig, dtype_bytes, get_config


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


# --- the whole step -----------------------------------------------------------------------------------------
def training_memory(spec: ModelConfig | str, setup: TrainSetup) -> MemoryBreakdown:
    """Memory of one training step on one rank, by kind and at its peak (see the module docstring)."""
    spec = get_config(spec, "spec")
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
        "end_of_backward": (0.0, grads, head_w_grad * (1 if mixed else 2) if spec.tie_word_embeddings else 0.0),
    }
    if setup.optimizer == "adamw8bit" and setup.device == "cpu":
        # the largest tensor's two moments dequantised, its grad upcast, sqrt(v) and the denominator, in fp32
        moments["optimizer_step"] = (0.0, grads, 5 * 4.0 * max(numels))
    if setup.checkpointing:
        # the last layer recomputed: the layer inputs, its activations, the incoming hidden-state grad, the head's
        # weight grad, and the grads of the MLP's [tokens, intermediate] tensors as they are formed
        o = nf4_out_bytes(setup) if setup.method == "qlora" else (2.0 if mixed else 4.0)
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


def inference_memory(spec: ModelConfig | str, batch_size: int, context_len: int, weight_dtype: str = "bf16",
                     kv_dtype: str = "bf16") -> MemoryBreakdown:
    """Serving memory: the weights once, a KV cache of ``batch_size * context_len`` tokens, and the transient
    working set of a decode step (one token's logits in fp32 per sequence). No gradients, no optimizer state,
    no saved activations: the KV cache is the part that grows."""
    spec = get_config(spec, "spec")
    if batch_size < 1 or context_len < 1:
        raise ValueError(f"batch_size={batch_size} and context_len={context_len} must be positive")
    weights = spec.weight_bytes(weight_dtype)
    kv = spec.kv_bytes(batch_size * context_len, kv_dtype)
    transient = batch_size * (4.0 * spec.vocab_size + dtype_bytes(weight_dtype) * (
        2 * spec.hidden_size + 2 * spec.intermediate_size))
    total = weights + kv + transient
    return MemoryBreakdown(weights=weights, kv_cache=kv, transient=transient, peak=total, peak_phase="decode",
                           phases={"decode": total})
