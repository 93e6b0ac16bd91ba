"""The same Megatron sharding as ``tensor_parallel``, expressed as a PyTorch DTensor plan.

``torch.distributed.tensor.parallel.parallelize_module`` turns each listed ``nn.Linear``/``nn.Embedding`` weight
into a ``DTensor`` sharded over a ``DeviceMesh`` and inserts the collectives itself:

- ``ColwiseParallel``: weight ``Shard(0)`` (output rows), input replicated, output sharded: q/k/v, gate, up.
- ``RowwiseParallel``: weight ``Shard(1)`` (input columns), output all-reduced: o_proj, down_proj.
- the embedding as ``RowwiseParallel(input_layouts=Replicate())`` (vocabulary rows, all-reduce), the LM head as
  ``ColwiseParallel(output_layouts=Replicate())`` (vocabulary rows, all-gather), as in PyTorch's Llama TP example.

Local outputs are plain tensors (``use_local_output``), so the Hugging Face attention code, which infers the
number of heads from the tensor width, runs unchanged. Unlike the hand-written version this plan does not
replicate KV heads: ``tp`` must divide ``num_key_value_heads``.
"""

from __future__ import annotations

from torch import nn

from labkit.parallel.tensor_parallel import allowed_tp_sizes, local_heads


def llama_tp_plan() -> dict:
    """``parallelize_module`` plan for a Hugging Face ``LlamaForCausalLM`` (or a ``labkit.model.CausalLM`` with
    separate projections: the same module names), keyed by module path pattern."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def check_dtensor_tp_size(config, tp: int) -> None:
    """The plan shards KV heads without replication: ``tp`` must divide ``num_key_value_heads`` too."""
    allowed = [t for t in allowed_tp_sizes(config) if config.num_key_value_heads % t == 0]
    if tp not in allowed:
        raise ValueError(f"tp={tp}: the DTensor plan needs tp to divide num_attention_heads="
                         f"{config.num_attention_heads} and num_key_value_heads={config.num_key_value_heads} "
                         f"(no KV-head replication); allowed: {allowed}. labkit.parallel.tensor_parallel "
                         f"replicates KV heads for larger tp")


def _labkit_ready(model: nn.Module, tp: int) -> None:
    """A ``labkit.model.CausalLM`` takes the plan with separate projections (an even row split of a merged q/k/v
    would cut across q, k and v); its attention modules and config then count this rank's heads."""
    if model.merge_qkv or model.merge_gate_up:
        raise ValueError("the DTensor plan shards q/k/v and gate/up as separate layers: build the labkit model with "
                         "merge_qkv=False, merge_gate_up=False (or use labkit.parallel.tensor_parallel, which shards "
                         "the merged layers per head group)")
    cfg = model.config
    local_heads(model, cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp)


def dtensor_tensor_parallel(model: nn.Module, mesh=None) -> nn.Module:
    """Shard ``model`` (an HF Llama, or a ``labkit.model.CausalLM`` built with separate projections) in place with
    ``llama_tp_plan`` over a 1-D ``mesh`` (default: all ranks on this rank's device type) and return it. Every rank
    must hold the same full model and call this collectively."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from labkit.model import CausalLM

    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    check_dtensor_tp_size(model.config, mesh.size())
    if isinstance(model, CausalLM):
        _labkit_ready(model, mesh.size())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tied:  # parallelize_module shards each module's parameter; give the head its own before, re-tie after
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    parallelize_module(model, mesh, llama_tp_plan())
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # both Shard(0) over the vocabulary
    return model
