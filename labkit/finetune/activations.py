"""Activations of a training step, per token and per rank: the tensors autograd saves for backward in Hugging Face's
Llama, op by op (which an op saves depends on which of its inputs need a gradient, so full fine-tuning and LoRA
differ), and the bf16 weight copies autocast keeps (see ``memory_model.py`` for how they add up at the peak).
"""

from __future__ import annotations

from labkit.finetune.state import TrainSetup, is_adapted, linear_names, lora_shapes, param_inventory, tp_divisor
from labkit.model import ModelConfig


# --- activations --------------------------------------------------------------------------------------------
def nf4_out_bytes(setup: TrainSetup) -> float:
    """bitsandbytes' Linear4bit returns its input's dtype: the fp32 norm output, or bf16 with a bf16 base."""
    return 2.0 if setup.base_dtype == "bf16" else 4.0


def sdpa_math_backend(spec: ModelConfig, setup: TrainSetup) -> bool:
    """Whether PyTorch's ``scaled_dot_product_attention`` runs its math backend in HF's attention: on CUDA with
    fp32 inputs (no autocast) and grouped-query attention, flash attention refuses fp32 and the memory-efficient
    kernel takes no GQA, so SDPA falls back to the math path, which saves the attention probabilities ``[batch,
    heads, seq, seq]`` and K/V expanded to every query head. On the CPU the flash kernel takes fp32 and GQA.
    Measured on an H100 (``research/records/h100/gpu_failures_probe.json``): full fp32 fine-tuning of the embedded
    model at 8 x 512 tokens peaked 287.5 MiB above the flash-style count, 8 layers x 9,200 B per token: this term."""
    return setup.device == "cuda" and setup.precision == "fp32" and spec.num_kv_heads < spec.num_heads


def layer_activation_bytes(spec: ModelConfig, setup: TrainSetup, first_layer: bool = False) -> dict[str, float]:
    """Bytes per token that one decoder layer saves for backward (per TP rank), term by term.

    ``first_layer``: under LoRA the embedding is frozen, so the first layer's input needs no gradient and its
    first norm saves nothing. fp32 residual and norm internals (HF's RMSNorm computes in fp32); ``c`` is the
    matmul dtype's size (2 under bf16 autocast, which also casts each linear's input separately, so q, k and v
    each keep their own bf16 copy of the normed input); ``o`` the dtype of the linears' outputs (NF4 layers
    return their input's dtype, fp32).
    """
    h, i, q, kv, heads = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size, spec.num_heads
    tp = setup.tensor_parallel
    mixed = setup.precision == "bf16-mixed"
    c = 2.0 if mixed else 4.0
    o = nf4_out_bytes(setup) if setup.method == "qlora" else c
    shared = not mixed or setup.base_dtype == "bf16"  # the normed input is already in the matmul dtype
    full = setup.method == "full"
    lora = not full
    r = setup.lora_rank

    def needs_input(name: str) -> bool:  # a linear keeps its input if its weight or its adapter trains
        return full or is_adapted(setup, name)

    def inputs(names: tuple[str, ...]) -> float:  # one shared normed tensor, or autocast's copy per linear
        n = sum(needs_input(nm) for nm in names)
        return c * h * (n > 0) if shared else c * h * n

    mlp_in = ("gate_proj", "up_proj") if spec.gated_mlp else ("up_proj",)
    terms = {
        "norm1 input + rstd": 0.0 if (first_layer and lora) else 4.0 * (h + 1),
        "norm1 normalized (weight grad)": 4.0 * h if full else 0.0,
        "q/k/v inputs": inputs(("q_proj", "k_proj", "v_proj")),
        # flash-style kernels save q, k, v, out and a float32 log-sum-exp per head; the math backend saves q, K/V
        # expanded to every query head, out and the probabilities (seq_len per head and token)
        "attention q, k, v, out": ((c * (4 * q + heads * setup.seq_len)) if sdpa_math_backend(spec, setup)
                                   else (c * (2 * q + 2 * kv) + 4.0 * heads)) / tp,
        "norm2 input + rstd": 4.0 * (h + 1),
        "norm2 normalized (weight grad)": 4.0 * h if full else 0.0,
        "mlp inputs": inputs(mlp_in),
        "lora x A^T": sum(c * r for nm in linear_names(spec) if is_adapted(setup, nm)) / tp,
    }
    if spec.gated_mlp:  # silu saves gate; the product saves silu(gate) and up; down saves the product
        terms["mlp gate, silu(gate), up"] = 3 * o * i / tp
        terms["mlp down input"] = (c * i if needs_input("down_proj") else 0.0) / tp
    else:  # gelu saves its input; down saves gelu's output
        terms["mlp up output, gelu output"] = (o * i + (c * i if needs_input("down_proj") else 0.0)) / tp
    return terms


def head_activation_bytes(spec: ModelConfig, setup: TrainSetup) -> dict[str, float]:
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


def autocast_weight_copies(spec: ModelConfig, setup: TrainSetup) -> dict[str, float]:
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
    out["layers"] += sum(2.0 * r * (fi + fo) for fi, fo in lora_shapes(spec, setup)) / setup.tensor_parallel
    if setup.base_dtype == "bf16":  # frozen weights already in bf16: nothing to copy but the adapters
        return out
    for p in param_inventory(spec):
        div = tp_divisor(p, setup.tensor_parallel)
        if p.kind == "linear":
            nf4 = setup.method == "qlora" and is_adapted(setup, p.linear)
            no_input_grad = setup.method != "full" and p.layer == 0 and p.linear in ("q_proj", "k_proj", "v_proj")
            if not nf4 and not no_input_grad:
                out["layers"] += 2.0 * p.numel / div
        elif p.kind == "lm_head" or (p.kind == "embedding" and spec.tie_word_embeddings):
            out["head"] += 2.0 * p.numel / div
    return out


def activation_bytes(spec: ModelConfig, setup: TrainSetup) -> dict[str, float]:
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


