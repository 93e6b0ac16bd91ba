"""Pipeline parallelism: labkit.model's decoder or a Hugging Face Llama cut into stages of consecutive layers (layer
ranges), one stage per rank.

Stage 0 holds the embedding and the first layers, the last stage the last layers, the final norm and the LM head;
between stages only the hidden states ``[batch, seq, hidden]`` travel, by point-to-point ``send``/``recv``. Each
stage computes the rotary embeddings of its own positions (they depend on positions only), so nothing but hidden
states crosses a stage boundary.

``partition_layers`` balances the stages by cost, counting the LM head (a ``vocab x hidden`` matmul) as the
equivalent number of layers, because an unbalanced pipeline idles every stage at the pace of the slowest.
``pipeline_generate`` decodes greedily with the batch cut into micro-batches, so that while the last stage
finishes micro-batch ``j`` the first is already on ``j + 1``; its tokens equal ``model.generate`` token for token.
The schedules (GPipe, 1F1B) and their bubble are in ``labkit.parallel.schedules``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from labkit.kvcache.paged import PagedKVCache


def head_cost_layers(config) -> float:
    """The LM head's matmul cost in units of one decoder layer's matmuls (weights touched per token)."""
    d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // h
    layer = d * (2 * h * hd + 2 * kv * hd) + 3 * d * config.intermediate_size
    return config.vocab_size * d / layer


def partition_layers(num_layers: int, num_stages: int, head_cost: float = 0.0) -> list[range]:
    """Split layers ``0..num_layers-1`` into ``num_stages`` contiguous ranges minimising the costliest stage,
    where each layer costs 1 and the last stage also pays ``head_cost``. Every stage gets at least one layer."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages={num_stages} must be in [1, num_layers={num_layers}]: every stage needs a layer")
    # best[s][n]: minimal max-cost of putting the first n layers on s stages (the last stage's head added later)
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for n in range(s, num_layers + 1):
            extra = head_cost if s == num_stages else 0.0
            for k in range(s - 1, n):  # stage s takes layers k..n-1
                cost = max(best[s - 1][k], n - k + extra)
                if cost < best[s][n] - 1e-12:
                    best[s][n], cut[s][n] = cost, k
    bounds, n = [], num_layers
    for s in range(num_stages, 0, -1):
        bounds.append(range(cut[s][n], n))
        n = cut[s][n]
    return bounds[::-1]


class StageKVCache:
    """The KV cache of one stage for one micro-batch: keys/values ``[batch, kv_heads, seq, head_dim]`` per layer.

    Duck-types the one method Hugging Face attention calls on a cache (``update``), so the model's own attention
    code runs on it under every transformers version the workbook supports.
    """

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.keys:
            key_states = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.values[layer_idx], value_states], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        if not self.keys:
            return 0
        k = self.keys[layer_idx if layer_idx is not None else min(self.keys)]
        return k.shape[-2]


def _cache_kwarg(layer: nn.Module) -> str:
    """The decoder layer's cache argument: ``cache`` (transformers 5.2x), ``past_key_values`` (4.56 to 5.1x) or
    ``past_key_value`` (older)."""
    params = inspect.signature(layer.forward).parameters
    return next((k for k in ("cache", "past_key_values", "past_key_value") if k in params), "past_key_values")


def causal_mask(q_len: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask ``[1, 1, q_len, past + q_len]``: query ``i`` sees keys ``0..past + i``."""
    q = torch.arange(q_len, device=device).unsqueeze(1) + past
    k = torch.arange(past + q_len, device=device).unsqueeze(0)
    mask = torch.zeros(q_len, past + q_len, dtype=dtype, device=device)
    return mask.masked_fill(k > q, torch.finfo(dtype).min)[None, None]


class LlamaStage(nn.Module):
    """Layers ``layers`` of a Hugging Face Llama (plus embedding on stage 0, norm and LM head on the last).

    forward(x, cache=None): ``x`` is int64 token ids ``[batch, seq]`` on the first stage, else hidden states
    ``[batch, seq, hidden]`` in the model's dtype; returns hidden states, or logits ``[batch, seq, vocab]`` on the
    last stage. ``cache`` (a ``StageKVCache``) makes positions continue after the cached tokens.
    """

    def __init__(self, model: nn.Module, layers: range, stage_index: int, num_stages: int, group=None):
        super().__init__()
        self._take(model, layers, stage_index, num_stages, group)
        self.rotary_emb = model.model.rotary_emb
        self._kw = _cache_kwarg(self.layers[0])
        # sdpa applies the causal mask itself when none is given (is_causal); eager attention needs it explicit
        self._needs_mask = getattr(model.config, "_attn_implementation", "sdpa") != "sdpa"

    def _take(self, model: nn.Module, layers: range, stage_index: int, num_stages: int, group) -> None:
        """Check the stage's place and keep its parts of ``model``: its layers, the embedding (first stage), the
        final norm and the LM head (last stage)."""
        n = len(model.model.layers)
        if not isinstance(layers, range) or not layers or min(layers) < 0 or max(layers) >= n:
            raise ValueError(f"layers={layers!r} must be a non-empty range of layer indices in [0, {n}) (a negative "
                             "index would pick a layer from the end)")
        if not isinstance(num_stages, int) or num_stages < 1 or not isinstance(stage_index, int) or \
                not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index={stage_index!r} must be an int in [0, num_stages={num_stages!r})")
        self.stage_index, self.num_stages, self.layer_ids = stage_index, num_stages, layers
        self.group = group  # the pipeline's process group (None: the world); stage s is its rank s
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.norm = model.model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def peer(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` (what ``send``/``recv`` address)."""
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def forward(self, x: torch.Tensor, cache: StageKVCache | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.is_first else x
        batch, q_len = h.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(past, past + q_len, device=h.device).unsqueeze(0).expand(batch, -1)
        rope = self.rotary_emb(h, pos)
        mask = causal_mask(q_len, past, h.dtype, h.device) if (self._needs_mask or (past and q_len > 1)) else None
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope,
                      use_cache=cache is not None, **{self._kw: cache})
            h = h[0] if isinstance(h, tuple) else h
        return self.lm_head(self.norm(h)) if self.is_last else h

    def new_cache(self) -> StageKVCache:
        """An empty cache of this stage for one micro-batch."""
        return StageKVCache()


@dataclass(eq=False)
class StageSeq:
    """One row of a micro-batch as a stage's block manager sees it (``kvcache.KVSequence``): how many tokens, their
    blocks, how many computed. No token ids: a stage's inputs are hidden states."""

    seq_id: int
    num_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    token_ids: tuple = ()


class StagePagedCache:
    """A ``labkit.model`` stage's KV cache for one micro-batch: a ``PagedKVCache`` of the stage's layers only, and a
    ``StageSeq`` per row of the micro-batch (both made on its first forward)."""

    def __init__(self):
        self.cache: PagedKVCache | None = None
        self.seqs: list[StageSeq] = []

    def get_seq_length(self) -> int:
        return self.seqs[0].num_tokens if self.seqs else 0


class LabkitStage(LlamaStage):
    """Layers ``layers`` of a ``labkit.model.CausalLM`` (the embedding on stage 0, the final norm and LM head on the
    last), the layers re-indexed to the stage's own paged cache (``StagePagedCache``). Same forward as
    ``LlamaStage``: ``x`` token ids or hidden states ``[batch, seq, ...]``; each stage passes on the residual
    stream, the last returns logits ``[batch, seq, vocab]``. Every op runs on torch (the references)."""

    def __init__(self, model: nn.Module, layers: range, stage_index: int, num_stages: int, group=None):
        nn.Module.__init__(self)
        self.body = model.model  # embed, rotary_emb and norm; its layer list is not run, only ours
        self._take(model, layers, stage_index, num_stages, group)
        for local, layer in enumerate(self.layers):
            layer.self_attn.layer = local  # this stage's cache holds its layers only

    def new_cache(self) -> StagePagedCache:
        return StagePagedCache()

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cache: StagePagedCache | None = None) -> torch.Tensor:
        from labkit.model import FusionPlan, ModelInput
        from labkit.model.ops import add_norm

        h = self.body.embed(x) if self.is_first else x
        batch, q_len, hidden = h.shape
        cache = cache or self.new_cache()
        if cache.cache is None:
            c = self.config
            blocks = batch * -(-min(c.max_position_embeddings, 4096) // 16)  # sequences up to 4,096 tokens
            cache.cache = PagedKVCache(len(self.layers), c.num_kv_heads, c.head_dim, blocks, 16, kv_dtype=h.dtype,
                                       device=h.device)
        pc, first = cache.cache, not cache.seqs
        if first:
            cache.seqs = [StageSeq(s) for s in range(batch)]
        for seq in cache.seqs:
            seq.num_tokens += q_len
            pc.allocate(seq) if first else pc.append_slots(seq)
        inp = ModelInput.build(pc, cache.seqs, [q_len] * batch, batch if q_len == 1 else 0, token_ids=False)
        seq_lens = inp.token_seq_lens() if self.body._dynamic else None
        cos, sin = self.body.rotary_emb.lookup(inp.positions, h.dtype, seq_lens)
        plan, flat, residual = FusionPlan(), h.reshape(batch * q_len, hidden), None
        for layer in self.layers:
            flat, residual = layer.forward_paged(flat, residual, cos, sin, pc, inp, plan)
        for seq in cache.seqs:
            pc.mark_computed(seq, seq.num_tokens)
        if self.is_last:
            return self.lm_head(add_norm(self.norm, flat, residual, plan)[0]).view(batch, q_len, -1)
        return (flat + residual).view(batch, q_len, hidden)


def build_stage(model: nn.Module, stage_index: int, num_stages: int, partition: list[range] | None = None,
                group=None) -> LlamaStage:
    """This rank's stage of ``model``: a ``LabkitStage`` of a ``labkit.model.CausalLM``, a ``LlamaStage`` of a Hugging
    Face Llama (balanced by ``partition_layers`` unless ``partition`` is given).

    ``group``: the process group whose ranks ``0..num_stages-1`` are the stages (default: the world)."""
    from labkit.model import CausalLM

    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} must be in [0, num_stages={num_stages})")
    n = model.config.num_hidden_layers
    partition = partition or partition_layers(n, num_stages, head_cost_layers(model.config))
    if len(partition) != num_stages or sorted(i for r in partition for i in r) != list(range(n)):
        raise ValueError(f"partition={partition} must cover layers 0..{n - 1} once in {num_stages} ranges")
    kind = LabkitStage if isinstance(model, CausalLM) else LlamaStage
    return kind(model, partition[stage_index], stage_index, num_stages, group)


# --- point-to-point -------------------------------------------------------------------------------------------
def recv(shape: tuple, dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
    """Blocking receive of a tensor whose shape and dtype both sides know (NaN-filled until it lands)."""
    t = torch.full(shape, float("nan"), dtype=dtype, device=device) if dtype.is_floating_point else \
        torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t


def isend(t: torch.Tensor, dst: int, pending: list) -> None:
    """Non-blocking send; the tensor and its handle are kept in ``pending`` until ``wait_all``. Sends never block,
    so a schedule deadlocks only if a ``recv`` has no matching send at all."""
    t = t.detach().contiguous()
    pending.append((dist.isend(t, dst), t))


def wait_all(pending: list) -> None:
    for work, _ in pending:
        work.wait()
    pending.clear()


def micro_batches(stage: LlamaStage, input_ids: torch.Tensor, num_microbatches: int):
    """``(device, dtype, micro-batches)`` of a stage's pass over ``input_ids`` ``[batch, ...]``, the batch cut into
    ``num_microbatches`` equal parts (``ValueError`` unless that divides it)."""
    if num_microbatches < 1 or input_ids.shape[0] % num_microbatches:
        raise ValueError(f"num_microbatches={num_microbatches} must divide batch size {input_ids.shape[0]}")
    device = next(stage.parameters()).device
    dtype = next(stage.layers.parameters()).dtype
    return device, dtype, list(input_ids.to(device).chunk(num_microbatches))


@torch.no_grad()
def pipeline_generate(stage: LlamaStage, input_ids: torch.Tensor, max_new_tokens: int,
                      num_microbatches: int = 1) -> torch.Tensor:
    """Greedy decoding through the pipeline; every rank passes the same ``input_ids`` ``[batch, prompt]`` (int64)
    and gets ``[batch, prompt + max_new_tokens]`` back.

    The batch is cut into ``num_microbatches`` equal micro-batches, each with its own KV cache per stage. Stage
    ``s`` receives micro-batch ``j``'s hidden states from ``s - 1``; the last stage picks the next token and sends
    it back to stage 0, which embeds it for the next step: with ``num_microbatches >= stages`` every stage has work
    at every step after the first fill.
    """
    rank, world = stage.stage_index, stage.num_stages
    batch = input_ids.shape[0]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    device, dtype, mbs = micro_batches(stage, input_ids, num_microbatches)
    caches = [stage.new_cache() for _ in mbs]
    new_tokens: list[list[torch.Tensor]] = [[] for _ in mbs]
    pending: list = []
    hidden = stage.config.hidden_size
    for step in range(max_new_tokens):
        for j, mb in enumerate(mbs):
            q_len = mb.shape[1] if step == 0 else 1
            if stage.is_first:
                x = mb if step == 0 else _next_token_on_first(stage, new_tokens[j], mb.shape[0], world, device)
            else:
                x = recv((mb.shape[0], q_len, hidden), dtype, stage.peer(rank - 1), device)
            y = stage(x, caches[j])
            if stage.is_last:
                tok = y[:, -1].argmax(dim=-1, keepdim=True)
                new_tokens[j].append(tok)
                if world > 1 and step + 1 < max_new_tokens:
                    isend(tok, stage.peer(0), pending)
            else:
                isend(y, stage.peer(rank + 1), pending)
    wait_all(pending)
    out = torch.cat([torch.cat([mb, *toks], dim=1) for mb, toks in zip(mbs, new_tokens, strict=True)]) \
        if stage.is_last else torch.empty(batch, input_ids.shape[1] + max_new_tokens, dtype=torch.long,
                                          device=device)
    if world > 1:
        dist.broadcast(out, src=stage.peer(world - 1), group=stage.group)
    return out.cpu()


def _next_token_on_first(stage: LlamaStage, toks: list, mb_size: int, world: int, device) -> torch.Tensor:
    """Stage 0's input for a decode step: the token the last stage just chose (received unless one stage)."""
    if world == 1:
        return toks[-1]
    return recv((mb_size, 1), torch.long, stage.peer(world - 1), device)


def sync_tied_embeddings(stage: LlamaStage, group) -> None:
    """All-reduce the gradient of a tied embedding between the first and last stage (Megatron's embedding group).

    With tied weights the single-process gradient is the sum of the embedding's and the LM head's; in a pipeline
    the two live on different ranks, each holding a copy. ``group`` must be ``dist.new_group([0, p - 1])``, created
    by every rank. A no-op on the middle stages, for one stage, and for untied models.
    """
    if stage.num_stages == 1 or not getattr(stage.config, "tie_word_embeddings", False):
        return
    weight = stage.embed_tokens.weight if stage.is_first else stage.lm_head.weight if stage.is_last else None
    if weight is not None and weight.grad is not None:
        dist.all_reduce(weight.grad, group=group)
