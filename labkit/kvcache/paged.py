"""The paged KV cache: per-layer K/V pools of fixed-size blocks and the block manager over them (block_manager.py).
Layout (shared with ``labkit.kernels.paged_attention``): ``k_caches[layer]``, ``v_caches[layer]`` ``[num_blocks,
block_size, num_kv_heads, head_dim]`` in the storage dtype of ``kv_dtype`` (fp32/bf16/fp16, or int8/fp8 with
``k_scales``/``v_scales`` ``[num_blocks, block_size, num_kv_heads]`` float32); a sequence's ``block_table`` names
the block of each run of ``block_size`` tokens; a token's *slot* is ``block * block_size + offset`` (``write``
scatters K/V to a ``slot_mapping``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from labkit.checks import check_bool, check_device, check_int, check_positive_int
from labkit.kvcache.block_manager import BlockManager, KVSequence, SeqBlocks
from labkit.kvcache.metrics import KVCacheStats
from labkit.kvcache.quant import KVFormat, dequantize_kv, kv_format, quantize_kv

__all__ = ["PagedKVCache", "SeqBlocks", "KVSequence", "raw"]


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as bytes if it is float8: indexing and scatter kernels for float8 are not implemented on every
    device and torch version, while moving its bytes as uint8 always is (and is the same thing)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class PagedKVCache(BlockManager):
    """K/V pools of ``num_blocks`` blocks of ``block_size`` tokens for ``num_layers`` layers, and the block manager
    over them (module docstring). ``allocate_pools=False`` keeps the bookkeeping only (no tensors): the request-mix
    simulation runs the real block manager that way at full scale on any machine.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, kv_dtype: str | torch.dtype = "fp32",
                 device: str | torch.device = "cpu",
                 enable_prefix_caching: bool = False, allocate_pools: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.fmt: KVFormat = kv_format(kv_dtype)
        self.device = check_device("device", device)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.k_scales: list[torch.Tensor] = []
        self.v_scales: list[torch.Tensor] = []
        if check_bool("allocate_pools", allocate_pools):
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

    # --- data -----------------------------------------------------------------------------------------------
    def _need_pools(self) -> None:
        if not self.k_caches:
            raise RuntimeError("this PagedKVCache was built with allocate_pools=False: it holds no K/V "
                               "tensors")

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              seq: KVSequence | None = None, check: bool | None = None) -> None:
        """Store ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` (integer
        ``[num_tokens]``), quantising them for int8/fp8.

        The slots are checked on the host (``check_slots``: integers, in the pool, in blocks some sequence holds, or
        with ``seq`` in that sequence's blocks) when ``check`` is True, and by default (``None``) when
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
        if check or (check is None and slot_mapping.device.type == "cpu") or seq is not None:
            self.check_slots(slot_mapping, seq)
        slots = slot_mapping.to(device=self.device, dtype=torch.long)
        flat = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        for x, pool, scales in ((k, self.k_caches, self.k_scales), (v, self.v_caches, self.v_scales)):
            if not self.fmt.quantised:  # stored as it is, in the storage dtype
                pool[layer].view(flat)[slots] = x.to(self.fmt.storage_dtype)
                continue
            q, s = quantize_kv(x, self.fmt)
            raw(pool[layer]).view(flat)[slots] = raw(q)
            scales[layer].view(flat[:2])[slots] = s

    def check_slots(self, slot_mapping: torch.Tensor, seq: KVSequence | None = None) -> None:
        """Refuse slots that are not integers (a float would be truncated), are negative (-1 would write another
        sequence's last slot), lie past the pool, or fall in a block no sequence holds (with ``seq``: outside that
        sequence's blocks). One host copy of the slots."""
        if slot_mapping.dtype.is_floating_point or slot_mapping.dtype.is_complex or slot_mapping.dtype == torch.bool:
            raise TypeError(f"slot_mapping has dtype {slot_mapping.dtype}; slots must be integers (int32 or int64)")
        slots = slot_mapping.tolist()
        cap = self.num_blocks * self.block_size
        bad = next((s for s in slots if not 0 <= s < cap), None)
        if bad is not None:
            raise ValueError(f"slot_mapping holds slot {bad}; allowed: 0 .. {cap - 1} ({self.num_blocks} blocks of "
                             f"{self.block_size})")
        if seq is not None:
            held, whose = set(seq.block_table), f"sequence {seq.seq_id!r}"
        else:
            held, whose = {b for b, n in enumerate(self.allocator.ref_counts) if n > 0}, "any sequence"
        bad = next((s for s in slots if s // self.block_size not in held), None)
        if bad is not None:
            raise ValueError(f"slot_mapping holds slot {bad}, in block {bad // self.block_size}, which {whose} does "
                             f"not hold; write only to slots reserved by allocate/append_slots")

    def check_layer(self, layer: int) -> None:
        """Refuse a layer index that is not an int in ``[0, num_layers)`` (a negative one would pick a layer
        from the end)."""
        check_int("layer", layer, 0, self.num_layers)

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

    def gather(self, seq: KVSequence, layer: int,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``seq``'s slotted tokens as contiguous ``[num_slots, kv_heads, head_dim]`` tensors in
        ``dtype``."""
        self.check_layer(layer)
        k, v = self.read_blocks(layer, torch.tensor(seq.block_table, dtype=torch.long), dtype)
        n = self.num_slots(seq)
        return k.flatten(0, 1)[:n], v.flatten(0, 1)[:n]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V (every layer, scales too; copy on write); a no-op without pools."""
        for pools in (self.k_caches, self.v_caches, self.k_scales, self.v_scales):
            for t in pools:
                raw(t)[dst].copy_(raw(t)[src])

    # --- batch tensors --------------------------------------------------------------------------------------
    def block_tables(self, seqs: Sequence[KVSequence], device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``[len(seqs), max_blocks]``; entries past a sequence's blocks are 0 (never read)."""
        width = max((len(s.block_table) for s in seqs), default=0)
        out = torch.zeros(len(seqs), max(width, 1), dtype=torch.int32)
        for i, s in enumerate(seqs):
            out[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        return out.to(device or self.device)

    def context_lens(self, seqs: Sequence[KVSequence], device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``[len(seqs)]``: tokens each sequence has slots for."""
        return torch.tensor([self.num_slots(s) for s in seqs], dtype=torch.int32, device=device or self.device)

    # --- metrics --------------------------------------------------------------------------------------------
    def stats(self, seqs: Iterable[KVSequence]) -> KVCacheStats:
        """Occupancy now, ``seqs`` being the sequences that hold blocks: a block shared by several sequences counts
        once (it is one piece of memory)."""
        seqs = list(seqs)
        bs = self.block_size
        lens = [self.num_slots(s) for s in seqs]
        logical = sum(lens)
        if sum(len(s.block_table) for s in seqs) == self.allocator.num_used:
            held = logical  # no block is shared: every sequence's tokens are its own
        else:
            fill: dict[int, int] = {}
            for seq, n in zip(seqs, lens):
                for j, b in enumerate(seq.block_table):
                    fill[b] = max(fill.get(b, 0), min(bs, n - j * bs))
            held = sum(fill.values())
        return KVCacheStats(num_seqs=len(seqs), tokens_held=held,
                            slots_reserved=self.allocator.num_used * bs, slots_total=self.num_blocks * bs,
                            bytes_per_slot=self.bytes_per_token,
                            logical_tokens=logical,
                            blocks_used=self.allocator.num_used,
                            blocks_cached_free=self.allocator.num_cached_free)

