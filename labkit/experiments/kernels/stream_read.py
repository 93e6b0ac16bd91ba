"""A kernel that only reads: how long a kernel that must read ``B`` bytes takes on this device, at best.

The copy bandwidth of a large buffer says ``B / bandwidth``; a kernel of a few tens of megabytes pays more than
that: its launch, the first loads' latency before the stream fills, and the tail where the last programs finish
alone. ``stream_read`` reads a buffer of int32 words and stores one XOR per program (so no load can be dropped),
with nothing else to do: the time any kernel reading those bytes once can hope for, measured the same way as
the kernel it is compared with. ``READ_TILES`` are a few shapes of it; the floor is the fastest.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from labkit.kernels.common import check_tensor

# (words a step, steps a program, warps): 2-8 KB a step, every step's loads in flight at once (the loop unrolls)
READ_TILES = ((512, 2, 2), (1024, 4, 4), (2048, 8, 8))


def stream_read_ref(words: torch.Tensor) -> int:
    """The XOR of every word of ``words`` (any shape, int32): what the programs' XORs of ``stream_read``
    combine to."""
    return int(np.bitwise_xor.reduce(words.reshape(-1).cpu().numpy()))


@triton.jit
def _stream_read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def stream_read(words: torch.Tensor, block: int = 1024, steps: int = 4, num_warps: int = 4,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Read every word of the contiguous int32 tensor ``words``: program ``p`` reads ``steps`` blocks of
    ``block`` words from word ``p * block * steps``. Returns each program's XOR, int32 ``[programs]`` (into
    ``out`` if given, e.g. to keep a captured graph's buffer)."""
    check_tensor("words", words, (torch.int32,))
    if not words.is_contiguous():
        raise ValueError("words must be contiguous")
    if block < 1 or block & (block - 1) or steps < 1:
        raise ValueError(f"block={block} must be a power of two and steps={steps} at least 1")
    programs = max(1, triton.cdiv(words.numel(), block * steps))
    if out is None:
        out = torch.empty(programs, dtype=torch.int32, device=words.device)
    elif out.shape != (programs,) or out.dtype != torch.int32 or out.device != words.device:
        raise ValueError(f"out must be int32 [{programs}] on {words.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    _stream_read_kernel[(programs,)](words, out, words.numel(), BLOCK=block, STEPS=steps, num_warps=num_warps)
    return out
