"""The naive KV cache: one slab of ``max_len`` token slots reserved per sequence, whatever its length.

This is how early serving systems (and HF's ``StaticCache``) hold K/V: ``k_caches[layer]`` is
``[max_seqs, max_len, num_kv_heads, head_dim]`` and a sequence owns one row from admission to completion.
Since the final length of a request is unknown when it is admitted, the row must cover the longest possible
one; every slot past the sequence's current length is reserved but empty. That reservation is what the paged
cache removes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from labkit.checks import check_bool, check_device, check_int, check_positive_int
from labkit.kvcache.block_allocator import CacheFullError
from labkit.kvcache.metrics import KVCacheStats
from labkit.kvcache.quant import kv_format


class ContiguousKVCache:
    """``max_seqs`` slabs of ``max_len`` slots per layer, in ``dtype`` (fp32, bf16 or fp16)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 allocate_pools: bool = True):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("max_seqs", max_seqs), ("max_len", max_len)):
            check_positive_int(name, v)
        fmt = kv_format(dtype, "dtype")
        if fmt.quantised:
            raise ValueError(f"dtype={dtype!r}: the contiguous baseline stores fp32, bf16 or fp16")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_seqs, self.max_len = max_seqs, max_len
        self.dtype, self.device = fmt.storage_dtype, check_device("device", device)
        self.bytes_per_token = fmt.bytes_per_token(num_layers, num_kv_heads, head_dim)
        self.rows: dict[Hashable, int] = {}
        self.lens: dict[Hashable, int] = {}
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        shape = (max_seqs, max_len, num_kv_heads, head_dim)
        n = num_layers if check_bool("allocate_pools", allocate_pools) else 0
        self.k_caches = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(n)]
        self.v_caches = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(n)]

    @property
    def num_free_slabs(self) -> int:
        return len(self._free_rows)

    def _check_len(self, seq_id: Hashable, n: int) -> None:
        if n > self.max_len:
            raise CacheFullError(f"sequence {seq_id!r} would hold {n} tokens but a slab holds max_len="
                                 f"{self.max_len}")

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Give a sequence a slab and reserve ``num_tokens`` slots in it; returns their slots."""
        if seq_id in self.rows:
            raise ValueError(f"seq_id={seq_id!r} is already in the cache")
        self._check_len(seq_id, num_tokens)
        if not self._free_rows:
            raise CacheFullError(f"all {self.max_seqs} slabs of {self.max_len} tokens are taken")
        self.rows[seq_id] = self._free_rows.pop()
        self.lens[seq_id] = 0
        return self.append_slots(seq_id, num_tokens)

    def append_slots(self, seq_id: Hashable, n: int = 1) -> list[int]:
        """Reserve ``n`` more slots of a sequence's slab (``row * max_len + position``); returns them."""
        if seq_id not in self.rows:
            raise KeyError(f"seq_id={seq_id!r} is not in the cache")
        start = self.lens[seq_id]
        self._check_len(seq_id, start + n)
        self.lens[seq_id] = start + n
        base = self.rows[seq_id] * self.max_len
        return list(range(base + start, base + start + n))

    def free(self, seq_id: Hashable) -> None:
        if seq_id not in self.rows:
            raise KeyError(f"seq_id={seq_id!r} is not in the cache")
        self._free_rows.append(self.rows.pop(seq_id))
        del self.lens[seq_id]

    def check_layer(self, layer: int) -> None:
        """Refuse a layer index that is not an int in ``[0, num_layers)`` (a negative one would pick a layer
        from the end)."""
        check_int("layer", layer, 0, len(self.k_caches))

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[num_tokens, kv_heads, head_dim]`` at ``slot_mapping``."""
        self.check_layer(layer)
        slots = slot_mapping.to(device=self.device, dtype=torch.long)
        flat = (self.max_seqs * self.max_len, self.num_kv_heads, self.head_dim)
        self.k_caches[layer].view(flat)[slots] = k.to(self.dtype)
        self.v_caches[layer].view(flat)[slots] = v.to(self.dtype)

    def attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                  scale: float | None = None) -> torch.Tensor:
        """Decode attention of ``q`` ``[num_seqs, num_heads, head_dim]`` over each sequence's slab.

        Computed the way a contiguous cache is used: over the padded ``[num_seqs, max_len]`` slabs at once,
        with slots past each length masked out (float32 arithmetic, output in ``q``'s dtype).
        """
        self.check_layer(layer)
        rows = torch.tensor([self.rows[s] for s in seq_ids], device=self.device)
        lens = torch.tensor([self.lens[s] for s in seq_ids], device=self.device)
        group = q.shape[1] // self.num_kv_heads
        k = self.k_caches[layer][rows].float().repeat_interleave(group, dim=2)  # [S, L, H, D]
        v = self.v_caches[layer][rows].float().repeat_interleave(group, dim=2)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = torch.einsum("shd,slhd->shl", q.float(), k) * scale
        valid = torch.arange(self.max_len, device=self.device)[None, :] < lens[:, None]  # [S, L]
        # Empty slots hold whatever was there before (even NaN); 0 * NaN is NaN, so zero them, not just
        # give them weight 0.
        v = v.masked_fill(~valid[:, :, None, None], 0.0)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        return torch.einsum("shl,slhd->shd", scores.softmax(dim=-1), v).to(q.dtype)

    def stats(self) -> KVCacheStats:
        held = sum(self.lens.values())
        return KVCacheStats(num_seqs=len(self.rows), tokens_held=held,
                            slots_reserved=len(self.rows) * self.max_len, slots_total=self.max_seqs * self.max_len,
                            bytes_per_slot=self.bytes_per_token,
                            logical_tokens=held)
