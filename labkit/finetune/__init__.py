"""Fine-tuning instead of inference: the memory of training, LoRA / QLoRA, and a short training loop.

* ``memory_model``: weights, gradients, optimizer state and activations of a training step for a ``ModelSpec``
  (full / LoRA / QLoRA, fp32 / bf16 autocast, checkpointing, 8-bit Adam, ZeRO and tensor-parallel sharding),
  against inference's weights and KV cache.
* ``measure``: peak memory of a region on the CPU (profiler allocator events) and the GPU (CUDA allocator).
* ``lora``: a LoRA layer over ``nn.Linear`` or bitsandbytes NF4 ``Linear4bit`` (QLoRA), applied to a Llama model.
* ``train``: the loop (mixed precision, activation checkpointing, AdamW / 8-bit AdamW), held-out loss, and the
  measured peak of one step.
"""
