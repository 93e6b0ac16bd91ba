"""Megatron-style tensor parallelism for labkit.model's decoder and Hugging Face Llama models, written out by hand.

Each rank of the tensor-parallel group keeps a slice of every weight matrix (Shoeybi et al. 2019, Megatron-LM):

- ``ColumnParallelLinear`` splits ``W [out, in]`` by output rows: every rank computes its slice of the output from
  the full (replicated) input. Used for q/k/v (split by attention head) and the MLP's gate and up projections.
- ``RowParallelLinear`` splits ``W`` by input columns: every rank multiplies its slice of the input, then one
  all-reduce sums the partial outputs. Used for o_proj and down_proj; these are the **two all-reduces per layer**.
- ``VocabParallelEmbedding`` and the LM head split the vocabulary: a token's row lives on one rank (the others
  contribute zeros to an all-reduce); the logits are all-gathered so that every rank sees the full vocabulary.

Attention needs no communication: heads are independent. With fewer KV heads than ranks (grouped-query
attention, e.g. 2 KV heads at TP 4) each KV head is *replicated* on the ``tp / num_kv_heads`` ranks whose query
heads use it, as vLLM does; this costs KV-cache memory (each replica stores the head) but no communication.

Autograd: the all-reduce at a row-parallel output is the identity in backward, and the (free) copy at a
column-parallel input is an all-reduce in backward (Megatron's ``g`` and ``f``), so the sharded model trains too.

Each layer issues its collectives through the ``Collectives`` it holds (``layer.comm``, ``labkit.parallel.comm``):
a measurement counts, skips or times them by lending the layers another (``labkit.bench.collectives``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.comm import Collectives


# --- Megatron's f and g: communication with the right backward ------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Forward: identity (the input is already replicated). Backward: all-reduce the input's gradient."""

    @staticmethod
    def forward(ctx, x, comm, group):
        ctx.comm, ctx.group = comm, group
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.contiguous(), ctx.group), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum the partial outputs). Backward: identity."""

    @staticmethod
    def forward(ctx, x, comm, group):
        return comm.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm, group):
        ctx.group, ctx.width = group, x.shape[-1]
        return comm.all_gather(x, dim=-1, group=group)

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_rank(ctx.group)
        return grad[..., r * ctx.width:(r + 1) * ctx.width].contiguous(), None, None


def shard_range(size: int, tp: int, rank: int, name: str = "size") -> slice:
    """Rank ``rank``'s contiguous slice of ``size`` split into ``tp`` equal parts; ``size`` must divide."""
    if size % tp:
        raise ValueError(f"{name}={size} is not divisible by the tensor-parallel size tp={tp}")
    part = size // tp
    return slice(rank * part, (rank + 1) * part)


# --- layers --------------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``y[..., rows] = x @ W[rows].T + b[rows]``: this rank's output slice from the full input.

    weight: ``[out_local, in]``; input ``[..., in]`` replicated; output ``[..., out_local]`` (or ``[..., out]``
    with ``gather_output``, all-gathered).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, gather_output: bool = False,
                 comm: Collectives | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group, self.gather_output, self.comm = group, gather_output, comm or Collectives()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, rows: slice | torch.Tensor | None = None,
                    gather_output: bool = False, comm: Collectives | None = None) -> ColumnParallelLinear:
        """Keep ``rows`` (a slice or int64 indices) of ``linear``'s output (default: this rank's equal share)."""
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = rows if rows is not None else shard_range(linear.out_features, tp, rank, "out_features")
        bias = None if linear.bias is None else linear.bias.detach()[rows].clone()
        return cls(linear.weight.detach()[rows].clone(), bias, group, gather_output, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_CopyToTP.apply(x, self.comm, self.group), self.weight, self.bias)
        return _GatherFromTP.apply(y, self.comm, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out_local={self.weight.shape[0]}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W[:, cols].T) + b``: partial products summed over the group.

    weight: ``[out, in_local]``; input ``[..., in_local]`` (this rank's slice); output ``[..., out]`` replicated.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, comm: Collectives | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group, self.comm = group, comm or Collectives()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, cols: slice | None = None,
                    comm: Collectives | None = None) -> RowParallelLinear:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        cols = cols if cols is not None else shard_range(linear.in_features, tp, rank, "in_features")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.weight.detach()[:, cols].clone(), bias, group, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.comm, self.group)
        return y if self.bias is None else y + self.bias  # bias added once, after the sum

    def extra_repr(self) -> str:
        return f"in_local={self.weight.shape[1]}, out={self.weight.shape[0]}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose table rows ``[vocab_start, vocab_end)`` live on this rank.

    input: int64 ids ``[...]``; output ``[..., hidden]`` replicated (ids outside this rank's range look up
    zeros, and one all-reduce adds the rank that owns each id).
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, group, num_embeddings: int | None = None,
                 comm: Collectives | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight.shape[0]
        self.group, self.comm = group, comm or Collectives()
        # the whole vocabulary (every rank's rows), as nn.Embedding reports it: what the engine checks ids against
        self.num_embeddings = num_embeddings if num_embeddings is not None else self.vocab_end

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group, comm: Collectives | None = None) -> VocabParallelEmbedding:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = shard_range(emb.num_embeddings, tp, rank, "vocab_size")
        return cls(emb.weight.detach()[rows].clone(), rows.start, group, emb.num_embeddings, comm)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, self.comm, self.group)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), hidden={self.weight.shape[1]}"


# --- sharding a Hugging Face Llama -------------------------------------------------------------------------
def allowed_tp_sizes(config) -> list[int]:
    """Tensor-parallel sizes this model supports: query heads, MLP width and vocabulary divide, and KV heads
    either divide or are replicated evenly (``tp`` a multiple of ``num_key_value_heads``)."""
    h, kv = config.num_attention_heads, config.num_key_value_heads
    return [t for t in range(1, h + 1)
            if h % t == 0 and config.intermediate_size % t == 0 and config.vocab_size % t == 0
            and (kv % t == 0 or t % kv == 0)]


def check_tp_size(config, tp: int) -> None:
    """Raise a ``ValueError`` naming the allowed sizes when ``tp`` cannot shard ``config``."""
    allowed = allowed_tp_sizes(config)
    if tp not in allowed:
        raise ValueError(f"tensor-parallel size tp={tp} cannot shard this model (num_attention_heads="
                         f"{config.num_attention_heads}, num_key_value_heads={config.num_key_value_heads}, "
                         f"intermediate_size={config.intermediate_size}, vocab_size={config.vocab_size}); "
                         f"allowed: {allowed}")


def head_rows(config, tp: int, rank: int) -> tuple[slice, slice, int]:
    """Rows of q_proj and of k_proj/v_proj this rank keeps, and the KV replication factor.

    Query heads are split evenly. KV heads are split when ``tp`` divides them; otherwise rank ``r`` keeps KV head
    ``r // (tp / num_kv_heads)``, the one its query heads belong to (replicated ``tp / num_kv_heads`` times).
    """
    d = config.head_dim if getattr(config, "head_dim", None) else config.hidden_size // config.num_attention_heads
    h, kv = config.num_attention_heads, config.num_key_value_heads
    q = shard_range(h, tp, rank, "num_attention_heads")
    if kv % tp == 0:
        k, replicas = shard_range(kv, tp, rank, "num_key_value_heads"), 1
    else:
        replicas = tp // kv
        k = slice(rank // replicas, rank // replicas + 1)
    return slice(q.start * d, q.stop * d), slice(k.start * d, k.stop * d), replicas


def _rows(*parts: tuple[int, slice]) -> torch.Tensor:
    """The rows ``offset + slice`` of each part, concatenated: a rank's share of a merged projection."""
    return torch.cat([torch.arange(off + sl.start, off + sl.stop) for off, sl in parts])


def local_heads(model: nn.Module, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Make a sharded ``labkit.model.CausalLM``'s attention modules and config count this rank's heads and MLP width,
    so ``make_cache`` sizes a rank's cache."""
    from dataclasses import replace

    d = model.config.head_dim
    for layer in model.model.layers:
        a = layer.self_attn
        a.num_heads, a.num_kv_heads, a.q_size, a.kv_size = num_heads, num_kv_heads, num_heads * d, num_kv_heads * d
    model.config = replace(model.config, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           intermediate_size=intermediate_size)


def _shard_vocab(model: nn.Module, group) -> None:
    emb, head = model.model.embed_tokens, model.lm_head
    tied = head.weight is emb.weight
    model.model.embed_tokens = VocabParallelEmbedding.from_embedding(emb, group)
    model.lm_head = ColumnParallelLinear.from_linear(head, group, gather_output=True)
    if tied:  # both keep the same vocabulary rows, so the shards stay tied
        model.lm_head.weight = model.model.embed_tokens.weight


def tensor_parallel(model: nn.Module, group=None) -> nn.Module:
    """Shard ``model`` in place over ``group`` (default: the world) and return it: a ``labkit.model.CausalLM``
    (merged q/k/v sharded by head group, merged gate/up by rows of each half) or a Hugging Face Llama-family model.

    Every rank must hold the same full model before the call (same weights, e.g. loaded from one checkpoint) and
    call this collectively. Afterwards each rank keeps ``1/tp`` of the attention heads, the MLP and the
    vocabulary; the model's forwards (HF's ``generate``; labkit's ``forward`` and ``forward_paged`` on a cache
    from the sharded model's ``make_cache``) work unchanged and return full logits on every rank.
    """
    from labkit.model import CausalLM

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model.config
    check_tp_size(cfg, tp)
    q_rows, kv_rows, _ = head_rows(cfg, tp, rank)
    mlp_rows = shard_range(cfg.intermediate_size, tp, rank, "intermediate_size")
    col, row = ColumnParallelLinear.from_linear, RowParallelLinear.from_linear
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "merged", False):  # labkit's merged q/k/v keeps this rank's rows of q, of k and of v
            q, kv = cfg.q_size, cfg.kv_size
            attn.qkv_proj = col(attn.qkv_proj, group, _rows((0, q_rows), (q, kv_rows), (q + kv, kv_rows)))
        else:
            attn.q_proj, attn.k_proj = col(attn.q_proj, group, q_rows), col(attn.k_proj, group, kv_rows)
            attn.v_proj = col(attn.v_proj, group, kv_rows)
        attn.o_proj = row(attn.o_proj, group, q_rows)
        if getattr(mlp, "merged", False):  # labkit's merged gate/up: its share of gate and of up
            mlp.gate_up_proj = col(mlp.gate_up_proj, group, _rows((0, mlp_rows), (cfg.intermediate_size, mlp_rows)))
        else:
            mlp.gate_proj, mlp.up_proj = col(mlp.gate_proj, group, mlp_rows), col(mlp.up_proj, group, mlp_rows)
        mlp.down_proj = row(mlp.down_proj, group, mlp_rows)
        if not isinstance(model, CausalLM):  # HF reads the GQA group size from the module; replicas change it
            attn.num_key_value_groups = (q_rows.stop - q_rows.start) // (kv_rows.stop - kv_rows.start)
    _shard_vocab(model, group)
    if isinstance(model, CausalLM):
        d = cfg.head_dim
        local_heads(model, (q_rows.stop - q_rows.start) // d, (kv_rows.stop - kv_rows.start) // d,
                    mlp_rows.stop - mlp_rows.start)
    return model
