import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.kernels.quantized_matmul.packing import dequantize_int4, dequantize_int8, pack_int4, unpack_int4


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), half_k=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_int4_pack_round_trip(n, half_k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, 2 * half_k), generator=g, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (n, half_k)
    assert torch.equal(unpack_int4(packed), q)
    # documented nibble order: even k in the low nibble, odd k in the high nibble
    assert torch.equal(packed & 0x0F, q[:, 0::2]) and torch.equal(packed >> 4, q[:, 1::2])


def test_dequantize_int4_matches_formula():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (5, 48), generator=g)
    scales = torch.rand(5, 3, generator=g) + 0.1
    zeros = torch.randint(0, 16, (5, 3), generator=g).float()
    w = dequantize_int4(pack_int4(q), scales, zeros, 16)
    ref = (q.float() - zeros.repeat_interleave(16, dim=1)) * scales.repeat_interleave(16, dim=1)
    assert torch.equal(w, ref)


def test_dequantize_int8_matches_formula():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (7, 13), generator=g, dtype=torch.int8)
    scale = torch.rand(7, generator=g) + 0.01
    assert torch.equal(dequantize_int8(q, scale), q.float() * scale[:, None])


@pytest.mark.parametrize("q,match", [(torch.zeros(2, 3, dtype=torch.uint8), "even"),
                                     (torch.full((2, 4), 16), r"\[0, 15\]"),
                                     (torch.full((2, 4), -1), r"\[0, 15\]")])
def test_pack_int4_rejects_bad_input(q, match):
    with pytest.raises(ValueError, match=match):
        pack_int4(q)


def test_dequantize_rejects_bad_shapes():
    packed = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size"):
        dequantize_int4(packed, torch.ones(4, 3), torch.ones(4, 3), 5)
    with pytest.raises(ValueError, match="uint8"):
        unpack_int4(packed.int())
    with pytest.raises(ValueError, match="int8"):
        dequantize_int8(torch.zeros(3, 4), torch.ones(3))


def test_the_quantisers_read_the_kernels_formats():
    """The formats live beside the kernels that read them; ``labkit.quant.packing`` re-exports the same functions."""
    import labkit.quant.packing as qp

    assert (qp.pack_int4, qp.unpack_int4, qp.dequantize_int4, qp.dequantize_int8) == (
        pack_int4, unpack_int4, dequantize_int4, dequantize_int8)
