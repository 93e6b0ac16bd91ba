"""Prefix caching: full KV blocks named by a hash chained to the previous block's hash.

Block ``j`` of a sequence is named ``h_j = sha256(h_{j-1} || tokens of block j)`` (``h_{-1}`` empty), as vLLM
and nano-vllm do: equal names mean equal tokens at equal positions *and* an equal prefix before them, so the
block's K/V (which depend on the whole prefix through attention and on positions through RoPE) are equal too.
A cryptographic hash makes a collision negligible, so a hit needs no token-by-token check.

Only full blocks are named; the partial last block of a sequence is never shared through the cache. The
allocator (``BlockAllocator``) keeps the registry and evicts least-recently-freed cached blocks first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from labkit.checks import check_positive_int, check_token_ids


def hash_block(token_ids: Sequence[int], prev_hash: bytes | None = None) -> bytes:
    """The chained hash of one full block: ``sha256(prev_hash || int64 token ids)`` (32 bytes)."""
    return _hash(check_token_ids("token_ids", token_ids), prev_hash)


def _hash(token_ids: Sequence[int], prev_hash: bytes | None) -> bytes:
    h = hashlib.sha256(prev_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, prev_hash: bytes | None = None) -> list[bytes]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block gets none)."""
    check_positive_int("block_size", block_size)
    token_ids = check_token_ids("token_ids", token_ids, allow_empty=True)
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev_hash = _hash(token_ids[start:start + block_size], prev_hash)
        hashes.append(prev_hash)
    return hashes
