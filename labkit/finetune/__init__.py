"""Fine-tuning instead of inference: the memory of training, LoRA / QLoRA, and a short training loop.

* ``memory_model``: the memory of a training step for a ``ModelConfig`` at its peak (full / LoRA / QLoRA, fp32 / bf16
  autocast, checkpointing, 8-bit Adam, ZeRO and tensor-parallel sharding), against inference's weights and KV
  cache; its terms: ``state`` (``TrainSetup``, parameter inventory, weights, gradients, optimizer state) and
  ``activations`` (what autograd saves, op by op).
* ``lora``: a LoRA layer over ``nn.Linear`` or bitsandbytes NF4 ``Linear4bit`` (QLoRA), applied to a Llama model.
* ``train``: the loop (mixed precision, activation checkpointing, AdamW / 8-bit AdamW) and the held-out loss.

What notebook 07 measures with these (method against method, the memory model against measured peaks) is in
``labkit.experiments.finetuning``.

    from labkit.finetune import TrainSetup, finetune, prepare_model, training_memory
    setup = TrainSetup(method="lora", base_dtype="bf16", batch_size=4, seq_len=256)
    print(training_memory("llama-3-8b", setup).peak)      # bytes at the peak of a step, predicted
"""

from labkit.finetune.activations import activation_bytes, autocast_weight_copies, layer_activation_bytes
from labkit.finetune.lora import (
    LLAMA_LINEARS,
    LoRALinear,
    apply_lora,
    count_trainable,
    merge_lora,
    quantize_nf4,
    trainable_parameters,
)
from labkit.finetune.memory_model import MemoryBreakdown, inference_memory, training_memory
from labkit.finetune.state import (
    ParamTensor,
    TrainSetup,
    nf4_bytes,
    optimizer_bytes,
    param_inventory,
    trainable_tensors,
    weight_bytes,
)
from labkit.finetune.train import (
    FinetuneResult,
    enable_checkpointing,
    finetune,
    heldout_loss,
    heldout_windows,
    make_optimizer,
    prepare_model,
    train_step,
    training_batches,
    warmup_cosine,
)

__all__ = ["LLAMA_LINEARS", "LoRALinear", "apply_lora", "count_trainable", "merge_lora", "quantize_nf4",
           "trainable_parameters", "MemoryBreakdown", "ParamTensor", "TrainSetup", "activation_bytes",
           "autocast_weight_copies", "layer_activation_bytes", "trainable_tensors",
           "inference_memory", "nf4_bytes", "optimizer_bytes", "param_inventory", "training_memory", "weight_bytes",
           "FinetuneResult", "enable_checkpointing", "finetune", "heldout_loss", "heldout_windows", "make_optimizer",
           "prepare_model", "train_step", "training_batches", "warmup_cosine"]
