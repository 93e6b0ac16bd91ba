"""stream_read: every word read once, on irregular sizes, and clear errors for what it cannot read."""

import pytest
import torch

from labkit.experiments.kernels.stream_read import READ_TILES, stream_read, stream_read_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("numel", [1, 1000, 4097, 3 * 2048 * 8 + 5])
@pytest.mark.parametrize("tile", READ_TILES)
def test_stream_read_xors_every_word(numel, tile):
    words = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(numel)).to(DEVICE)
    out = stream_read(words, *tile)
    block, steps, _ = tile
    assert out.shape == (-(-numel // (block * steps)),)
    assert stream_read_ref(out) == stream_read_ref(words)
    words[numel // 2] ^= 1  # one bit of one word changes the result
    assert stream_read_ref(stream_read(words, *tile)) != stream_read_ref(out)


def test_stream_read_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="words has dtype"):
        stream_read(torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        stream_read(torch.zeros(8, 2, dtype=torch.int32, device=DEVICE).t())
    with pytest.raises(ValueError, match="block=3 must be a power of two"):
        stream_read(torch.zeros(8, dtype=torch.int32, device=DEVICE), block=3)
    with pytest.raises(ValueError, match=r"out must be int32 \[1\]"):
        stream_read(torch.zeros(8, dtype=torch.int32, device=DEVICE), out=torch.empty(2, dtype=torch.int32))
