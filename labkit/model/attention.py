"""A paged step's input, and attention: dense and causal (the plain forward) or over the paged KV cache.

``ModelInput`` (vLLM's names) is one step of ``CausalLM.forward_paged``: the next ``num_tokens[i]`` tokens of each
sequence (from its ``num_computed`` on; slots reserved), rows back to back, decodes first. ``pack_step``, the one
packing function (the engine's runner and CUDA graphs, the speculative decoder, the proposers, the pipeline's
stages), writes it into two host arrays, int64 ``[3, rows]`` (token ids, positions, slots) and int32 (context
lengths, query starts, logits rows, block tables): one host-to-device copy each, a ``ModelInput`` views them.
Padding (a captured step's shape): sequences of no tokens (context 1, tables of ``scratch_block``) and token rows
writing to the scratch block's first slot at position 0. Under the engine's async scheduling an input id may be a
``placeholder`` (negative) for a token the previous step sampled and the host has not read yet; ``fill_placeholders``
gathers those from the previous step's device tensor once the step is on the device.

``cached_attention`` runs, with the layer's sliding window, the references of ``labkit.kvcache.attention`` on the
torch path (prefill rows causally per sequence, decode rows batched) or the kernels of ``labkit.kernels`` on the
Triton path (``FusionPlan.attention``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from labkit.device import host_to_device
from labkit.kvcache.attention import dequantised_blocks, paged_decode_attention_ref, paged_prefill_attention_ref
from labkit.kvcache.paged import KVSequence, PagedKVCache


@dataclass
class ModelInput:
    """One step's inputs for ``CausalLM.forward_paged`` (vLLM's names), views of the two packed device arrays
    ``buffers`` (``pack_step``; ``None`` for slices of them):

    * ``input_ids``, ``positions``, ``slot_mapping``: int64 ``[num_tokens]``: each row's token, position and cache
      slot (``block * block_size + offset``; its K/V are written there before attention)
    * ``block_tables``: int32 ``[num_seqs, width]``; ``context_lens``: int32 ``[num_seqs]``, tokens cached after this
      step's writes; ``query_start_loc``: int32 ``[num_seqs + 1]``, sequence ``s`` owns rows
      ``query_start_loc[s]:query_start_loc[s + 1]`` (vLLM's ``cu_seqlens_q``)
    * ``logits_indices``: int32 ``[num_logits]``: the rows whose logits the forward returns (each sequence's last,
      every row, or each sequence's last few: speculative decoding's verify rows)
    * ``num_decodes``: the leading sequences with one row each (a host int)
    * ``kernel_log``: a ``labkit.model.ops.KernelLog`` the step's ops record the kernels they ran in, or None
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    num_decodes: int = 0
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    kernel_log: list | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every row is a sequence's one row (padding included): the rows are the logits rows, in order. (A step with
        prefill rows may have as many rows as sequences: a captured step of T tokens and min(T, max_num_seqs)
        sequences; only the step's kind decides.)"""
        return self.num_decodes == self.num_seqs == self.num_tokens

    def token_seq_lens(self) -> torch.Tensor:
        """int64 ``[num_tokens]``: the context length of each row's sequence (what 'dynamic' RoPE needs)."""
        query_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
        return self.context_lens.long().repeat_interleave(query_lens, output_size=self.num_tokens)

    def check(self) -> None:
        """Shapes and dtypes agree (metadata only: no device sync)."""
        n, t = self.num_seqs, self.num_tokens
        for name, x, shape in (("input_ids", self.input_ids, (t,)), ("positions", self.positions, (t,)),
                               ("slot_mapping", self.slot_mapping, (t,)), ("context_lens", self.context_lens, (n,)),
                               ("query_start_loc", self.query_start_loc, (n + 1,)),
                               ("logits_indices", self.logits_indices, tuple(self.logits_indices.shape[:1])),
                               ("block_tables", self.block_tables, (n, self.block_tables.shape[-1]))):
            if x.dtype not in (torch.int64, torch.int32) or tuple(x.shape) != shape:
                raise ValueError(f"{name} must be int64 or int32 of shape {shape}, got {x.dtype} {tuple(x.shape)}")
        if not 0 <= self.num_decodes <= min(n, t):
            raise ValueError(f"num_decodes={self.num_decodes} must be in [0, {min(n, t)}]")

    @classmethod
    def build(cls, cache: PagedKVCache, seqs: Sequence[KVSequence], num_tokens: Sequence[int], num_decodes: int = 0,
              *, num_seqs: int | None = None, width: int | None = None, all_logits: bool = False,
              logits_per_seq: Sequence[int] | None = None, kernel_log: list | None = None,
              **padding) -> ModelInput:
        """``pack_step`` over ``seqs`` with ``cache``'s block size, copied to ``cache``'s device (two copies).
        ``num_seqs``, ``width``, ``all_logits``, ``logits_per_seq`` and ``padding`` (``num_rows``, ``scratch_block``,
        ``token_ids``) as ``pack_step`` takes them; ``kernel_log`` as the field."""
        num_seqs = num_seqs or len(seqs)
        width = width or max((len(s.block_table) for s in seqs), default=1)
        longs, ints = pack_step(seqs, num_tokens, cache.block_size, num_seqs=num_seqs, width=width,
                                all_logits=all_logits, logits_per_seq=logits_per_seq, **padding)
        longs, ints = (host_to_device(a, cache.device) for a in (longs, ints))
        num_logits = ints.shape[0] - 2 * num_seqs - 1 - num_seqs * width
        c, q, g, t0 = layout(num_seqs, num_logits)  # views of the two arrays
        return cls(longs[0], longs[1], longs[2], ints[t0:].view(num_seqs, width), ints[c:q], ints[q:g], ints[g:t0],
                   num_decodes, (longs, ints), kernel_log)


def layout(num_seqs: int, num_logits: int) -> tuple[int, int, int, int]:
    """Offsets in the int32 array: context lengths, query starts, logits rows, block tables."""
    return 0, num_seqs, 2 * num_seqs + 1, 2 * num_seqs + 1 + num_logits


def pack_step(seqs: Sequence[KVSequence], num_tokens: Sequence[int], block_size: int, *,
              num_seqs: int | None = None, num_rows: int | None = None, width: int | None = None,
              scratch_block: int = 0, all_logits: bool = False, logits_per_seq: Sequence[int] | None = None,
              token_ids: bool = True) -> tuple[np.ndarray, ...]:
    """The step computing the next ``num_tokens[i]`` tokens of each sequence (from its ``num_computed`` on; their
    slots reserved; the sequences are only read) as two host arrays: int64 ``[3, rows]`` and int32 ``[2 * num_seqs
    + 1 + num_logits + num_seqs * width]`` (``layout``).

    Padded to ``num_seqs`` sequences and ``num_rows`` token rows (see the module docstring), block tables ``width``
    wide (default: the widest table). ``all_logits``: every row's logits, not each sequence's last; ``logits_per_seq``:
    the logits of the last ``logits_per_seq[i]`` rows of sequence ``i`` (in ``[1, num_tokens[i]]``: speculative
    decoding's verify rows beside other sequences' prefill chunks), padding sequences one each. ``token_ids=False``
    leaves the input ids 0 (a pipeline stage's sequences hold none: its inputs are hidden states)."""
    n = len(seqs)
    if len(num_tokens) != n or (n == 0 and not num_seqs):
        raise ValueError(f"need one num_tokens per sequence and at least one sequence, got {n} sequences and "
                         f"{len(num_tokens)} counts")
    bs = block_size
    ids, pos, slots, ctx, tables = [], [], [], [], []
    for seq, q in zip(seqs, num_tokens):
        start, table = seq.num_computed, seq.block_table
        end = start + q
        if not (0 < q and end <= seq.num_tokens and end <= len(table) * bs):
            raise ValueError(f"sequence {getattr(seq, 'seq_id', None)!r}: {q} tokens to compute, but it has "
                             f"{seq.num_tokens} tokens of which {start} are computed, and slots for "
                             f"{len(table) * bs}; reserve slots first")
        if q == 1:
            if token_ids:
                ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            if token_ids:
                ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        ctx.append(end)
        tables.append(table)
    n_seqs = num_seqs or n
    n_real = len(pos)
    n_tok = num_rows or n_real + n_seqs - n
    width = width or max(len(t) for t in tables)
    if n_seqs < n or n_tok < n_real:
        raise ValueError(f"padding to {n_seqs} sequences and {n_tok} rows cannot hold the step's {n} sequences and "
                         f"{n_real} tokens")
    if any(len(t) > width for t in tables):
        raise ValueError(f"a sequence holds {max(len(t) for t in tables)} blocks, more than the block tables' "
                         f"width={width}")
    longs = np.zeros((3, n_tok), dtype=np.int64)
    if token_ids:
        longs[0, :n_real] = ids
    longs[1:, :n_real] = (pos, slots)
    longs[2, n_real:] = scratch_block * bs
    if logits_per_seq is not None:
        counts = list(logits_per_seq)
        if all_logits or len(counts) != n or any(not 1 <= c <= q for c, q in zip(counts, num_tokens)):
            raise ValueError(f"logits_per_seq={counts!r} must give each of the {n} sequences a count in [1, its "
                             f"num_tokens={list(num_tokens)!r}] (and all_logits must be False)")
    n_logits = n_tok if all_logits else n_seqs if logits_per_seq is None else sum(counts) + n_seqs - n
    ints = np.full(2 * n_seqs + 1 + n_logits + n_seqs * width, scratch_block, dtype=np.int32)
    c, q, g, t0 = layout(n_seqs, n_logits)
    ints[c:q] = 1
    ints[c:c + n] = ctx
    ints[q] = 0
    ints[q + 1:q + 1 + n] = np.cumsum(num_tokens)
    ints[q + 1 + n:g] = n_real
    if all_logits:
        ints[g:t0] = np.arange(n_tok)
    elif logits_per_seq is not None:
        ends = ints[q + 1:q + 1 + n]
        ints[g:t0] = 0
        ints[g:g + n_logits - (n_seqs - n)] = np.concatenate([np.arange(e - c, e) for e, c in zip(ends, counts)])
    else:
        ints[g:t0] = 0
        ints[g:g + n] = ints[q + 1:q + 1 + n] - 1
    rows = ints[t0:].reshape(n_seqs, width)
    for r, t in enumerate(tables):
        rows[r, :len(t)] = t
    return longs, ints


def placeholder(row: int) -> int:
    """The input id that stands for the token row ``row`` of the previous step sampled while that token is still on
    the device (the engine's async scheduling): ``-(row + 1)``, never a real id. ``pack_step`` packs it as it is;
    ``fill_placeholders`` replaces it on the device."""
    return -1 - row


def fill_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """In place on the device: every input id ``placeholder(j)`` becomes ``sampled[j]``, the others stay (a gather
    by row: nothing is read back to the host). ``input_ids`` int64 ``[rows]``; ``sampled`` int64 ``[k]``, ``k >= 1``,
    the previous step's sampled tokens, on the same device. Returns ``input_ids``."""
    src = (-1 - input_ids).clamp_(min=0)
    return input_ids.copy_(torch.where(input_ids < 0, sampled.index_select(0, src), input_ids))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Dense causal attention, ``q`` ``[batch, T, heads, head_dim]``, ``k``/``v`` ``[batch, T, kv_heads,
    head_dim]`` -> ``[batch, T, heads, head_dim]``; with ``window``, query ``i`` sees keys ``i - window < j <=
    i`` (HF's sliding-window mask). KV heads are repeated for grouped-query attention."""
    T, group = q.shape[1], q.shape[2] // k.shape[2]
    i = torch.arange(T, device=q.device)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def cached_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, inp: ModelInput, scale: float,
                    window: int | None = None, kernel: str = "torch", pdl: str = "") -> torch.Tensor:
    """Attention of every query row ``q`` ``[num_tokens, heads, head_dim]`` over ``layer``'s pools of ``cache``
    (this step's K/V already written); ``window``: the layer's sliding window or None.

    ``kernel`` 'torch': the references of ``labkit.kvcache.attention`` (the decode rows batched, prefill rows per
    sequence); 'triton': ``labkit.kernels.paged_attention`` for an all-decode step (``pdl``: its launch mode),
    ``paged_prefill_attention`` for every row of a step with prefill chunks, in one launch whose grid depends on
    shapes only (no window: ``FusionPlan.fit`` keeps sliding-window layers on torch). An int8/fp8 cache, or one
    stored in another dtype than ``q``, is read through ``dequantised_blocks``."""
    if cache.fmt.quantised or cache.fmt.storage_dtype != q.dtype:
        k_cache, v_cache, tables = dequantised_blocks(cache, layer, inp.block_tables, q.dtype)
    else:
        k_cache, v_cache, tables = cache.k_caches[layer], cache.v_caches[layer], inp.block_tables
    d, log = inp.num_decodes, inp.kernel_log
    if kernel == "triton":
        if window is not None:
            raise ValueError(f"kernel='triton' has no sliding window (window={window}); use 'torch'")
        if d == inp.num_seqs:
            from labkit.kernels.paged_attention import paged_attention as decode

            if log is not None:
                log.record("attention", "paged_attention", pdl=pdl)
            # check=False: the engine's tables come from its allocator (width checked when packed); the host check
            # would synchronise every layer and break a graph capture
            return decode(q, k_cache, v_cache, tables, inp.context_lens, scale=scale, pdl=pdl, check=False)
        from labkit.kernels.paged_prefill_attention import paged_prefill_attention

        if log is not None:
            log.record("attention", "paged_prefill_attention")
        return paged_prefill_attention(q, k_cache, v_cache, tables, inp.query_start_loc, inp.context_lens, scale,
                                       out=torch.zeros_like(q),  # padding rows of a captured step stay finite
                                       check=False)
    if log is not None:
        log.record("attention", "torch")
    if d == inp.num_seqs:
        return paged_decode_attention_ref(q, k_cache, v_cache, tables, inp.context_lens, scale, window)
    out = torch.empty_like(q)
    if d:
        out[:d] = paged_decode_attention_ref(q[:d], k_cache, v_cache, tables[:d], inp.context_lens[:d], scale,
                                             window)
    qsl = inp.query_start_loc[d:] - inp.query_start_loc[d]
    out[d:] = paged_prefill_attention_ref(q[d:], k_cache, v_cache, tables[d:], qsl, inp.context_lens[d:], scale,
                                          window)
    return out
