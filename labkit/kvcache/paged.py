"""The paged KV cache: per-layer K/V pools of fixed-size blocks, and a block table per sequence.

Layout (shared with ``labkit.kernels.paged_attention``):

* ``k_caches[layer]``, ``v_caches[layer]``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
  storage dtype of ``kv_dtype`` (fp32/bf16/fp16, or int8/fp8 with ``k_scales``/``v_scales`` ``[num_blocks,
  block_size, num_kv_heads]`` float32)
* a sequence's ``block_table``: the physical block of each run of ``block_size`` logical tokens
* a token's *slot*: ``block * block_size + offset``; ``write`` scatters K/V to slots (the ``slot_mapping``)

A sequence reserves one block at a time as it grows, so the only memory reserved but not holding tokens is the
unfilled tail of its last block (internal fragmentation, under ``block_size`` tokens per sequence). Blocks are
shared by reference count: ``fork`` shares every block, and the first append to a shared, partly filled last
block copies it (copy on write). With ``enable_prefix_caching`` a new sequence reuses the full blocks of a
cached prefix (``labkit.kvcache.prefix``).

Token bookkeeping: ``allocate``/``append_slots`` *reserve* slots for tokens; the model runner writes their K/V
and then calls ``mark_computed``, which is when full blocks become findable by the prefix cache (never before
their K/V exist).
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from labkit.kvcache.block_allocator import BlockAllocator, CacheFullError
from labkit.kvcache.metrics import KVCacheStats
from labkit.kvcache.prefix import block_hashes, hash_block
from labkit.kvcache.quant import KVFormat, dequantize_kv, kv_format, quantize_kv


@dataclass
class SeqBlocks:
    """One sequence in the cache: its block table, the tokens it has slots for, and how many are computed."""

    block_table: list[int]
    token_ids: list[int]
    num_computed: int = 0  # tokens whose K/V are written (a prefix of token_ids)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its computed full blocks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as bytes if it is float8: indexing and scatter kernels for float8 are not implemented on every
    device and torch version, while moving its bytes as uint8 always is (and is the same thing)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class PagedKVCache:
    """K/V pools of ``num_blocks`` blocks of ``block_size`` tokens for ``num_layers`` layers.

    ``allocate_pools=False`` keeps the bookkeeping only (no tensors): the request-mix simulation runs the real
    allocator that way at full scale on any machine.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, kv_dtype: str | torch.dtype = "fp32",
                 device: str | torch.device = "cpu",
                 enable_prefix_caching: bool = False, allocate_pools: bool = True):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.fmt: KVFormat = kv_format(kv_dtype)
        self.device = torch.device(device)
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[Hashable, SeqBlocks] = {}
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if allocate_pools:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            for _ in range(num_layers):
                self.k_caches.append(torch.empty(shape, dtype=self.fmt.storage_dtype, device=self.device))
                self.v_caches.append(torch.empty(shape, dtype=self.fmt.storage_dtype, device=self.device))
                if self.fmt.quantised:
                    self.k_scales.append(torch.empty(shape[:3], dtype=torch.float32, device=self.device))
                    self.v_scales.append(torch.empty(shape[:3], dtype=torch.float32, device=self.device))

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16,
                  kv_dtype: str | torch.dtype | None = None, **kwargs) -> PagedKVCache:
        """A cache shaped for a Hugging Face Llama-family model, on its device; ``kv_dtype`` defaults to the
        model's dtype."""
        c = model.config
        p = next(model.parameters())
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.num_key_value_heads or c.num_attention_heads, head_dim, num_blocks,
                   block_size, kv_dtype=p.dtype if kv_dtype is None else kv_dtype, device=p.device, **kwargs)

    # --- sizes ----------------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token slot over all layers (scales included)."""
        return self.fmt.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def seq(self, seq_id: Hashable) -> SeqBlocks:
        if seq_id not in self.seqs:
            raise KeyError(f"seq_id={seq_id!r} is not in the cache")
        return self.seqs[seq_id]

    # --- admission ------------------------------------------------------------------------------------------
    def _prefix_hits(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks for the longest cached prefix of ``token_ids``, and their hashes.

        Only blocks inside the first ``len - 1`` tokens count: the last prompt token is always computed,
        because its logits are what the step is for (vLLM does the same)."""
        if not self.enable_prefix_caching:
            return [], []
        hits, hashes = [], []
        for h in block_hashes(token_ids[: len(token_ids) - 1], self.block_size):
            block = self.allocator.lookup(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
        return hits, hashes

    def _blocks_to_allocate(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes], int]:
        hits, hashes = self._prefix_hits(token_ids)
        new = self.blocks_for(len(token_ids)) - len(hits)
        # A hit on a free (cached, unreferenced) block takes it off the free queue too.
        from_free = new + sum(1 for b in hits if self.allocator.ref_counts[b] == 0)
        return hits, hashes, from_free

    def blocks_needed(self, token_ids: Sequence[int]) -> int:
        """Free blocks ``allocate(_, token_ids)`` would take now (prefix hits on cached free blocks count)."""
        return self._blocks_to_allocate(token_ids)[2]

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether ``allocate(_, token_ids)`` would succeed now."""
        return self.blocks_needed(token_ids) <= self.allocator.num_free

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Add a sequence with slots for ``token_ids`` (its prompt); all blocks or none.

        Returns the number of leading tokens whose K/V are already cached (a multiple of ``block_size``, 0
        without prefix caching): the runner computes only the tokens after them.
        Raises ``CacheFullError`` when too few blocks are free (nothing changes), ``ValueError`` on bad input.
        """
        if seq_id in self.seqs:
            raise ValueError(f"seq_id={seq_id!r} is already in the cache")
        if len(token_ids) < 1:
            raise ValueError("token_ids must hold at least one token")
        need = self.blocks_for(len(token_ids))
        if need > self.num_blocks:
            raise CacheFullError(f"a sequence of {len(token_ids)} tokens needs {need} blocks of "
                                 f"{self.block_size} "
                                 f"but the whole cache has {self.num_blocks}: it can never fit")
        hits, hashes, from_free = self._blocks_to_allocate(token_ids)
        if from_free > self.allocator.num_free:
            raise CacheFullError(f"sequence {seq_id!r} needs {from_free} free blocks, "
                                 f"{self.allocator.num_free} of {self.num_blocks} are free")
        for b in hits:
            self.allocator.take_cached(b)
        table = hits + self.allocator.allocate(need - len(hits))
        cached = len(hits) * self.block_size
        self.seqs[seq_id] = SeqBlocks(table, list(token_ids), num_computed=cached, block_hashes=hashes)
        return cached

    # --- growth ---------------------------------------------------------------------------------------------
    def _append_cost(self, seq: SeqBlocks, n: int) -> tuple[int, bool]:
        new = self.blocks_for(seq.num_tokens + n) - len(seq.block_table)
        cow = (n > 0 and seq.num_tokens % self.block_size != 0
               and self.allocator.ref_counts[seq.block_table[-1]] > 1)
        return new, cow

    def can_append(self, seq_id: Hashable, n: int = 1) -> bool:
        """Whether ``append_slots`` of ``n`` tokens would succeed now."""
        new, cow = self._append_cost(self.seq(seq_id), n)
        return new + cow <= self.allocator.num_free

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int]) -> list[int]:
        """Reserve slots for ``token_ids`` after the sequence's tokens; returns their slots (all or nothing).

        If the last block is partly filled and shared (after ``fork``), it is first copied to a private block:
        copy on write, so the other sequences keep their tokens.
        """
        seq = self.seq(seq_id)
        new, cow = self._append_cost(seq, len(token_ids))
        if new + cow > self.allocator.num_free:
            raise CacheFullError(f"sequence {seq_id!r} needs {new + cow} more blocks, "
                                 f"{self.allocator.num_free} of {self.num_blocks} are free")
        if cow:
            (private,) = self.allocator.allocate(1)
            self.copy_block(seq.block_table[-1], private)
            self.allocator.free(seq.block_table[-1])
            seq.block_table[-1] = private
        seq.block_table += self.allocator.allocate(new)
        start = seq.num_tokens
        seq.token_ids.extend(token_ids)
        return self.slots(seq_id, start, seq.num_tokens)

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slots of the sequence's tokens ``start .. end-1``."""
        seq = self.seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(f"token range [{start}, {end}) is outside sequence {seq_id!r} of "
                             f"{seq.num_tokens} tokens")
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def mark_computed(self, seq_id: Hashable, num_computed: int) -> None:
        """Record that K/V of the first ``num_computed`` tokens are written; full blocks among them become
        findable by the prefix cache."""
        seq = self.seq(seq_id)
        if not seq.num_computed <= num_computed <= seq.num_tokens:
            raise ValueError(f"num_computed={num_computed} must be in [{seq.num_computed}, {seq.num_tokens}]")
        seq.num_computed = num_computed
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for j in range(len(seq.block_hashes), num_computed // bs):
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block(seq.token_ids[j * bs:(j + 1) * bs], prev)
            seq.block_hashes.append(h)
            self.allocator.register_hash(seq.block_table[j], h)

    # --- sharing and release --------------------------------------------------------------------------------
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence ``child_id`` sharing every block of ``parent_id`` (no copy until one of them appends
        to a shared partly-filled block)."""
        parent = self.seq(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"child_id={child_id!r} is already in the cache")
        for b in parent.block_table:
            self.allocator.incref(b)
        self.seqs[child_id] = SeqBlocks(list(parent.block_table), list(parent.token_ids), parent.num_computed,
                                        list(parent.block_hashes))

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks. Tail blocks are released first, so when cached blocks are evicted, a
        prefix's later blocks go before its earlier ones (those are likelier to be shared)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"seq_id={seq_id!r} is not in the cache")
        for b in reversed(seq.block_table):
            self.allocator.free(b)

    # --- data -----------------------------------------------------------------------------------------------
    def _need_pools(self) -> None:
        if not self.k_caches:
            raise RuntimeError("this PagedKVCache was built with allocate_pools=False: it holds no K/V "
                               "tensors")

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              seq_id: Hashable | None = None, check: bool | None = None) -> None:
        """Store ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` (integer
        ``[num_tokens]``), quantising them for int8/fp8.

        The slots are checked on the host (``check_slots``: integers, in the pool, in blocks some sequence holds, or
        with ``seq_id`` in that sequence's blocks) when ``check`` is True, and by default (``None``) when
        ``slot_mapping`` is host memory, where the check is free; a device tensor is trusted by default (the engine
        built it from block tables it checked, and a check would synchronise every layer, or break a graph
        capture)."""
        self._need_pools()
        self.check_layer(layer)
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.ndim != 1:
            raise ValueError(f"slot_mapping must be a 1-D integer tensor, got {type(slot_mapping).__name__} "
                             f"of shape {tuple(getattr(slot_mapping, 'shape', ()))}")
        expect = (slot_mapping.shape[0], self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(f"k and v must have shape {expect}, got {tuple(k.shape)} and {tuple(v.shape)}")
        if check or (check is None and slot_mapping.device.type == "cpu") or seq_id is not None:
            self.check_slots(slot_mapping, seq_id)
        slots = slot_mapping.to(device=self.device, dtype=torch.long)
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        for x, pool, scales in ((k, self.k_caches, self.k_scales), (v, self.v_caches, self.v_scales)):
            q, s = quantize_kv(x, self.fmt)
            raw(pool[layer]).view(flat)[slots] = raw(q)
            if s is not None:
                scales[layer].view(flat[:2])[slots] = s

    def check_slots(self, slot_mapping: torch.Tensor, seq_id: Hashable | None = None) -> None:
        """Refuse slots that are not integers (a float would be truncated), are negative (-1 would write another
        sequence's last slot), lie past the pool, or fall in a block no sequence holds (with ``seq_id``: outside
        that sequence's blocks). One host copy of the slots."""
        if slot_mapping.dtype.is_floating_point or slot_mapping.dtype.is_complex or slot_mapping.dtype == torch.bool:
            raise TypeError(f"slot_mapping has dtype {slot_mapping.dtype}; slots must be integers (int32 or int64)")
        slots = slot_mapping.tolist()
        cap = self.num_blocks * self.block_size
        bad = next((s for s in slots if not 0 <= s < cap), None)
        if bad is not None:
            raise ValueError(f"slot_mapping holds slot {bad}; allowed: 0 .. {cap - 1} ({self.num_blocks} blocks of "
                             f"{self.block_size})")
        if seq_id is not None:
            held, whose = set(self.seq(seq_id).block_table), f"sequence {seq_id!r}"
        else:
            held, whose = {b for b, n in enumerate(self.allocator.ref_counts) if n > 0}, "any sequence"
        bad = next((s for s in slots if s // self.block_size not in held), None)
        if bad is not None:
            raise ValueError(f"slot_mapping holds slot {bad}, in block {bad // self.block_size}, which {whose} does "
                             f"not hold; write only to slots reserved by allocate/append_slots")

    def check_layer(self, layer: int) -> None:
        """Refuse a layer index that is not an int in ``[0, num_layers)`` (a negative one would pick a layer
        from the end)."""
        if not isinstance(layer, numbers.Integral) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r} must be an int in [0, {self.num_layers})")

    def read_blocks(self, layer: int, blocks: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` (int ``[n]``), dequantised to ``dtype``: ``[n, block_size, kv_heads,
        head_dim]``."""
        self._need_pools()
        self.check_layer(layer)
        blocks = blocks.to(device=self.device, dtype=torch.long)
        ks = self.k_scales[layer][blocks] if self.fmt.quantised else None
        vs = self.v_scales[layer][blocks] if self.fmt.quantised else None
        k = raw(self.k_caches[layer])[blocks].view(self.fmt.storage_dtype)
        v = raw(self.v_caches[layer])[blocks].view(self.fmt.storage_dtype)
        return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)

    def gather(self, seq_id: Hashable, layer: int,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V as contiguous ``[num_tokens, kv_heads, head_dim]`` tensors in ``dtype``."""
        seq = self.seq(seq_id)
        k, v = self.read_blocks(layer, torch.tensor(seq.block_table), dtype)
        n = seq.num_tokens
        return k.flatten(0, 1)[:n], v.flatten(0, 1)[:n]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V (every layer, scales too); a no-op without pools."""
        for pools in (self.k_caches, self.v_caches, self.k_scales, self.v_scales):
            for t in pools:
                raw(t)[dst].copy_(raw(t)[src])

    # --- batch tensors --------------------------------------------------------------------------------------
    def block_tables(self, seq_ids: Sequence[Hashable],
                     device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``[len(seq_ids), max_blocks]``; rows past a sequence's blocks are padded with 0 (never
        read)."""
        tables = [self.seq(s).block_table for s in seq_ids]
        width = max((len(t) for t in tables), default=0)
        out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device or self.device)

    def context_lens(self, seq_ids: Sequence[Hashable],
                     device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``[len(seq_ids)]``: tokens each sequence has slots for."""
        return torch.tensor([self.seq(s).num_tokens for s in seq_ids], dtype=torch.int32,
                            device=device or self.device)

    # --- metrics --------------------------------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        """Occupancy now: a block shared by several sequences counts once (it is one piece of memory)."""
        bs = self.block_size
        logical = sum(s.num_tokens for s in self.seqs.values())
        if sum(len(s.block_table) for s in self.seqs.values()) == self.allocator.num_used:
            held = logical  # no block is shared: every sequence's tokens are its own
        else:
            fill: dict[int, int] = {}
            for seq in self.seqs.values():
                for j, b in enumerate(seq.block_table):
                    fill[b] = max(fill.get(b, 0), min(bs, seq.num_tokens - j * bs))
            held = sum(fill.values())
        return KVCacheStats(num_seqs=len(self.seqs), tokens_held=held,
                            slots_reserved=self.allocator.num_used * bs, slots_total=self.num_blocks * bs,
                            bytes_per_slot=self.bytes_per_token,
                            logical_tokens=logical,
                            blocks_used=self.allocator.num_used,
                            blocks_cached_free=self.allocator.num_cached_free)

    def check_invariants(self) -> None:
        """Block tables agree with the allocator's reference counts (tests call this after every
        operation)."""
        self.allocator.check_invariants()
        refs = [0] * self.num_blocks
        for sid, seq in self.seqs.items():
            assert len(seq.block_table) == self.blocks_for(seq.num_tokens), f"seq {sid!r}: table length"
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {sid!r} holds a block twice"
            for b in seq.block_table:
                refs[b] += 1
        assert refs == self.allocator.ref_counts, "reference counts differ from the block tables"
