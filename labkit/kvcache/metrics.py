"""What a KV cache holds versus what it reserves: the numbers behind "paging wastes under 4%".

* ``tokens_held``: tokens whose K/V are stored (a block shared by several sequences counts once: it is memory)
* ``slots_reserved``: token slots set aside for sequences (whole slabs for the contiguous cache, whole blocks
  for the paged one), whether or not a token is in them yet
* ``waste_frac = 1 - tokens_held / slots_reserved``: reservation plus internal fragmentation
* ``utilisation = tokens_held / slots_total``: the share of the whole pool holding tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of a cache's occupancy. ``bytes_per_slot`` counts K and V of every layer (and scales)."""

    num_seqs: int
    tokens_held: int
    slots_reserved: int
    slots_total: int
    bytes_per_slot: int
    logical_tokens: int = 0  # sum of sequence lengths; exceeds tokens_held when blocks are shared
    blocks_used: int = 0
    blocks_cached_free: int = 0  # free blocks still holding a reusable prefix block

    @property
    def bytes_reserved(self) -> int:
        return self.slots_reserved * self.bytes_per_slot

    @property
    def bytes_held(self) -> int:
        return self.tokens_held * self.bytes_per_slot

    @property
    def waste_frac(self) -> float:
        """Reserved slots holding no token, as a fraction of reserved slots (0 when nothing is reserved)."""
        return 1.0 - self.tokens_held / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def utilisation(self) -> float:
        return self.tokens_held / self.slots_total if self.slots_total else 0.0

    @property
    def sharing_saving_frac(self) -> float:
        """Memory saved by sharing: ``1 - tokens_held / logical_tokens`` (0 without sharing)."""
        return 1.0 - self.tokens_held / self.logical_tokens if self.logical_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bytes_reserved=self.bytes_reserved, bytes_held=self.bytes_held, waste_frac=self.waste_frac,
                 utilisation=self.utilisation, sharing_saving_frac=self.sharing_saving_frac)
        return d
