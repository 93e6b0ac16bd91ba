"""One step's input for ``CausalLM.forward_paged`` (vLLM's names), and the one function that packs it.

A step computes the next ``num_tokens[i]`` tokens of each of ``num_seqs`` sequences over the paged KV cache: the
tokens from the sequence's ``num_computed`` on, whose slots are reserved (its block table covers them). Their rows
lie back to back, sequences with one row (decodes) first. ``pack_step`` writes every field into two host arrays,
int64 ``[3, num_tokens]`` (token ids, positions, slots) and int32 ``[2 * num_seqs + 1 + num_logits + num_seqs *
width]`` (context lengths, query starts, logits rows, block tables), so one host-to-device copy each feeds the device;
a ``ModelInput`` is views into the two device arrays. The engine's ModelRunner, its CUDA graphs (which copy the two
arrays into their static buffers), the speculative decoder, the proposers and the pipeline's stages all build their
steps this way.

Padding (a captured step's shape): ``num_seqs`` above the real count adds sequences of no tokens (context 1, block
tables of ``scratch_block``), ``num_rows`` above the real token count adds token rows that write to the scratch
block's first slot at position 0; without ``num_rows`` each padding sequence gets one padding row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from labkit.kvcache.paged import PagedKVCache, SeqBlocks


@dataclass
class ModelInput:
    """Inputs of one paged forward, all device tensors but ``num_decodes``:

    * ``input_ids``, ``positions``, ``slot_mapping``: int64 ``[num_tokens]``: each row's token, its position in its
      sequence and its cache slot (``block * block_size + offset``; its K/V are written there before attention)
    * ``block_tables``: int32 ``[num_seqs, width]``: each sequence's physical blocks (padding never read)
    * ``context_lens``: int32 ``[num_seqs]``: tokens each sequence has cached after this step's writes (its rows sit
      at positions ``context_len - query_len ... context_len - 1``)
    * ``query_start_loc``: int32 ``[num_seqs + 1]``: sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s
      + 1]`` (vLLM's ``cu_seqlens_q``)
    * ``logits_indices``: int32 ``[num_logits]``: the rows whose logits the forward returns: each sequence's last
      (``num_logits = num_seqs``), or every row (the speculative decoder's verify step)
    * ``num_decodes``: the leading sequences that have one row each (an all-decode step runs the decode kernel and
      returns its rows' logits as they are)
    * ``buffers``: the flat int64 and int32 device tensors the fields view (``None`` for slices of them)
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
        n, t = self.num_seqs, self.positions.shape
        if self.input_ids.dim() != 1 or tuple(t) != tuple(self.input_ids.shape):
            raise ValueError(f"input_ids and positions must both be [num_tokens], got {tuple(self.input_ids.shape)} "
                             f"and {tuple(t)}")
        for name, x, dtypes, shape in (
                ("slot_mapping", self.slot_mapping, (torch.int64, torch.int32), (self.num_tokens,)),
                ("context_lens", self.context_lens, (torch.int32, torch.int64), (n,)),
                ("query_start_loc", self.query_start_loc, (torch.int32, torch.int64), (n + 1,))):
            if x.dtype not in dtypes or tuple(x.shape) != shape:
                raise ValueError(f"{name} must be {dtypes[0]} of shape {shape}, got {x.dtype} {tuple(x.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != n:
            raise ValueError(f"block_tables must be [num_seqs={n}, width], got {tuple(self.block_tables.shape)}")
        if self.logits_indices.dim() != 1:
            raise ValueError(f"logits_indices must be 1-D, got {tuple(self.logits_indices.shape)}")
        if not 0 <= self.num_decodes <= min(n, self.num_tokens):
            raise ValueError(f"num_decodes={self.num_decodes} must be in [0, {min(n, self.num_tokens)}]")

    @classmethod
    def from_buffers(cls, longs: torch.Tensor, ints: torch.Tensor, num_seqs: int, width: int, num_decodes: int,
                     num_logits: int | None = None) -> ModelInput:
        """The fields as views of the packed arrays ``longs`` and ``ints`` (``pack_step``'s layout, on any
        device)."""
        c, q, g, t0 = layout(num_seqs, num_seqs if num_logits is None else num_logits)
        return cls(longs[0], longs[1], longs[2], ints[t0:].view(num_seqs, width), ints[c:q], ints[q:g], ints[g:t0],
                   num_decodes, (longs, ints))

    @classmethod
    def build(cls, cache: PagedKVCache, seqs: Sequence[SeqBlocks], num_tokens: Sequence[int], num_decodes: int = 0,
              *, num_seqs: int | None = None, width: int | None = None, all_logits: bool = False,
              **padding) -> ModelInput:
        """``pack_step`` over ``seqs`` with ``cache``'s block size, copied to ``cache``'s device (two copies).
        ``num_seqs``, ``width`` and ``padding`` (``num_rows``, ``scratch_block``) as ``pack_step`` takes them."""
        num_seqs = num_seqs or len(seqs)
        width = width or max((len(s.block_table) for s in seqs), default=1)
        longs, ints = pack_step(seqs, num_tokens, cache.block_size, num_seqs=num_seqs, width=width,
                                all_logits=all_logits, **padding)
        dev = cache.device
        return cls.from_buffers(torch.from_numpy(longs).to(dev, non_blocking=True),
                                torch.from_numpy(ints).to(dev, non_blocking=True), num_seqs, width, num_decodes,
                                longs.shape[1] if all_logits else None)


def layout(num_seqs: int, num_logits: int) -> tuple[int, int, int, int]:
    """Offsets in the int32 array: context lengths, query starts, logits rows, block tables."""
    return 0, num_seqs, 2 * num_seqs + 1, 2 * num_seqs + 1 + num_logits


def pack_step(seqs: Sequence[SeqBlocks], num_tokens: Sequence[int], block_size: int, *, num_seqs: int | None = None,
              num_rows: int | None = None, width: int | None = None, scratch_block: int = 0,
              all_logits: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The step computing the next ``num_tokens[i]`` tokens of each sequence (from its ``num_computed`` on; their
    slots reserved) as two host arrays in the device layout (module docstring): int64 ``[3, rows]`` and int32.

    Padded to ``num_seqs`` sequences and ``num_rows`` token rows (see the module docstring), block tables ``width``
    wide (default: the widest table). ``all_logits``: every row's logits, not each sequence's last."""
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
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        ctx.append(end)
        tables.append(table)
    n_seqs = num_seqs or n
    n_tok = num_rows or len(ids) + n_seqs - n
    width = width or max(len(t) for t in tables)
    if n_seqs < n or n_tok < len(ids):
        raise ValueError(f"padding to {n_seqs} sequences and {n_tok} rows cannot hold the step's {n} sequences and "
                         f"{len(ids)} tokens")
    if any(len(t) > width for t in tables):
        raise ValueError(f"a sequence holds {max(len(t) for t in tables)} blocks, more than the block tables' "
                         f"width={width}")
    longs = np.zeros((3, n_tok), dtype=np.int64)
    longs[:, :len(ids)] = (ids, pos, slots)
    longs[2, len(ids):] = scratch_block * bs
    n_logits = n_tok if all_logits else n_seqs
    ints = np.full(2 * n_seqs + 1 + n_logits + n_seqs * width, scratch_block, dtype=np.int32)
    c, q, g, t0 = layout(n_seqs, n_logits)
    ints[c:q] = 1
    ints[c:c + n] = ctx
    ints[q] = 0
    ints[q + 1:q + 1 + n] = np.cumsum(num_tokens)
    ints[q + 1 + n:g] = len(ids)
    if all_logits:
        ints[g:t0] = np.arange(n_tok)
    else:
        ints[g:t0] = 0
        ints[g:g + n] = ints[q + 1:q + 1 + n] - 1
    rows = ints[t0:].reshape(n_seqs, width)
    for r, t in enumerate(tables):
        rows[r, :len(t)] = t
    return longs, ints
