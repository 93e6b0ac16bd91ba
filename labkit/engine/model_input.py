"""One step's inputs, built on the host and moved to the device in two copies (vLLM's names).

A step computes ``num_tokens[i]`` uncomputed tokens of each of ``num_seqs`` sequences, laid back to back. The host
side packs every field into two numpy arrays, int64 ``[3, num_tokens]`` (token ids, positions, slots) and int32
``[num_seqs * (3 + width) + 1]`` (context lengths, query starts, logits rows, block tables), so one copy each feeds
the device; ``ModelInput`` is views into them. A CUDA-graph step packs into the static buffers' shape instead
(``labkit.engine.cuda_graph``): padding sequences of no tokens, padding token rows that write to a scratch block.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from labkit.kvcache import PagedKVCache


@dataclass
class ModelInput:
    """Inputs of one forward. Device tensors: ``input_ids``, ``positions``, ``slot_mapping`` (int64
    ``[num_tokens]``), ``block_tables`` (int32 ``[num_seqs, width]``), ``context_lens`` (int32 ``[num_seqs]``,
    tokens cached after this step), ``query_start_loc`` (int32 ``[num_seqs + 1]``, sequence ``s`` owns token rows
    ``query_start_loc[s]:query_start_loc[s + 1]``) and ``logits_indices`` (int32 ``[num_seqs]``: the rows whose
    logits the forward returns, each sequence's last row; a step with prefill rows may name others). Host lists:
    ``query_lens`` and ``context_lens_host`` per sequence, ``tables_host`` (each sequence's block table);
    ``num_decode`` leading sequences have one token each. Padding (a captured step's) adds token rows past the last
    sequence's and sequences of no tokens."""

    seq_ids: list[Hashable]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    query_lens: list[int]
    context_lens_host: list[int]
    tables_host: list[list[int]]
    num_decode: int
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # the flat int64 and int32 tensors of the fields

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return self.num_decode == self.num_seqs


def collect_step(cache: PagedKVCache, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> tuple[list, ...]:
    """Host lists of a step: ``(ids, positions, slots, context_lens, tables)``: token ids, positions and slots of
    every token; each sequence's context length after the step and its block table. The slots must be reserved."""
    if not seq_ids or len(seq_ids) != len(num_tokens):
        raise ValueError(f"need one num_tokens per sequence and at least one sequence, got {len(seq_ids)} "
                         f"sequences and {len(num_tokens)} counts")
    ids, pos, slots, ctx, tables = [], [], [], [], []
    for sid, n in zip(seq_ids, num_tokens):
        seq = cache.seq(sid)
        start, end = seq.num_computed, seq.num_computed + n
        if not start < end <= seq.num_tokens:
            raise ValueError(f"sequence {sid!r}: {n} tokens to compute, but it has {seq.num_tokens} slots of "
                             f"which {start} are computed; reserve slots first")
        ids += seq.token_ids[start:end]
        pos += range(start, end)
        slots += cache.slots(sid, start, end)
        ctx.append(end)
        tables.append(seq.block_table)
    return ids, pos, slots, ctx, tables


def layout(n_seqs: int) -> tuple[int, int, int, int]:
    """Offsets in the int32 array: context lengths, query starts, logits rows, block tables."""
    return 0, n_seqs, 2 * n_seqs + 1, 3 * n_seqs + 1


def pack_step(ids, pos, slots, ctx, tables, qlens: list[int], n_seqs: int, n_tok: int, width: int,
              block_size: int, scratch_block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The lists of ``collect_step`` as two host arrays in the device layout (see the module docstring), padded to
    ``n_seqs`` sequences (context 1, tables of ``scratch_block``) and ``n_tok`` token rows (the scratch block's
    first slot, position 0), block tables ``width`` wide (built in numpy: a graph step's tables are
    max_model_len / block_size wide)."""
    if n_seqs < len(ctx) or n_tok < len(ids):
        raise ValueError(f"padding to {n_seqs} sequences and {n_tok} tokens cannot hold the step's {len(ctx)} "
                         f"sequences and {len(ids)} tokens")
    longs = np.zeros((3, n_tok), dtype=np.int64)
    longs[:, :len(ids)] = (ids, pos, slots)
    longs[2, len(ids):] = scratch_block * block_size
    ints = np.full(n_seqs * (3 + width) + 1, scratch_block, dtype=np.int32)
    c, q, g, t0 = layout(n_seqs)
    n = len(ctx)
    ints[c:q] = 1
    ints[c:c + n] = ctx
    ints[q] = 0
    ints[q + 1:g] = np.cumsum(qlens + [0] * (n_seqs - n))
    ints[g:t0] = 0
    ints[g:g + n] = ints[q + 1:q + 1 + n] - 1
    rows = ints[t0:].reshape(n_seqs, width)
    for r, t in enumerate(tables):
        rows[r, :len(t)] = t
    return longs, ints


def input_views(longs: torch.Tensor, ints: torch.Tensor, n_seqs: int, width: int, seq_ids, qlens, ctx, tables,
                num_decode: int) -> ModelInput:
    """A ``ModelInput`` whose tensors are views of the packed device arrays ``longs`` and ``ints``."""
    c, q, g, t0 = layout(n_seqs)
    return ModelInput(seq_ids, longs[0], longs[1], longs[2], ints[t0:].view(n_seqs, width), ints[c:q],
                      ints[q:g], ints[g:t0], qlens, ctx, tables, num_decode, buffers=(longs, ints))
