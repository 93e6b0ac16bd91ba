"""Paged prefill attention (prefill chunks and decode rows in one launch) against ``paged_prefill_attention_ref``."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.paged_prefill_attention import paged_prefill_attention
from labkit.kvcache.attention import paged_prefill_attention_ref

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA


def _case(heads, kv_heads, head_dim, block_size, seqs, dtype, seed, pad_tokens=0, device=DEVICE):
    """``seqs``: (query_len, context_len) per sequence. Random q and pools; block tables scatter each sequence
    over shuffled physical blocks, with a spare column of garbage entries."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(m for m, _ in seqs) + pad_tokens
    max_blocks = max(-(-n // block_size) for _, n in seqs) + 1
    num_blocks = len(seqs) * max_blocks + 3
    q = torch.randn(num_tokens, heads, head_dim, generator=g)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: len(seqs) * max_blocks].view(len(seqs), max_blocks)
    qsl = torch.tensor([0] + [m for m, _ in seqs], dtype=torch.int32).cumsum(0).int()
    ctx = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    return [t.to(dtype).to(device) for t in (q, k, v)] + [t.to(device) for t in (tables.int(), qsl, ctx)]


CASES = [
    # decode rows, a whole prompt, a chunk over a cached prefix, a chunk ending mid-block
    (4, 2, 64, 16, [(1, 37), (1, 1), (23, 23), (40, 107), (5, 70)]),
    (6, 2, 48, 8, [(70, 70), (1, 9), (17, 33)]),  # group of 3 (not a power of two), head_dim 48
    (4, 4, 32, 16, [(130, 200), (3, 3)]),          # MHA, a chunk longer than one query tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seqs", CASES)
def test_paged_prefill_attention(dtype, heads, kv_heads, head_dim, block_size, seqs):
    q, k, v, tables, qsl, ctx = _case(heads, kv_heads, head_dim, block_size, seqs, dtype, seed=len(seqs))
    out = paged_prefill_attention(q, k, v, tables, qsl, ctx)
    ref = paged_prefill_attention_ref(q.double(), k.double(), v.double(), tables, qsl, ctx)
    assert relative_error(out, ref) < TOL[dtype]


def test_padding_sequences_and_rows_are_left_alone():
    """A captured step pads with sequences of no queries and with rows past the last sequence: the kernel must
    neither write those rows nor be confused by the empty sequences around the real ones."""
    seqs = [(0, 1), (9, 20), (0, 1), (1, 5), (0, 1)]
    q, k, v, tables, qsl, ctx = _case(4, 2, 32, 16, seqs, torch.float32, seed=3, pad_tokens=7)
    out = torch.full_like(q, 123.0)
    paged_prefill_attention(q, k, v, tables, qsl, ctx, out=out)
    ref = paged_prefill_attention_ref(q, k, v, tables, qsl, ctx)
    assert relative_error(out[:10], ref[:10]) < TOL[torch.float32]
    assert torch.all(out[10:] == 123.0)


def test_equals_decode_attention_for_single_token_rows():
    from labkit.kernels.paged_attention import paged_attention

    seqs = [(1, n) for n in (1, 17, 64, 300)]
    q, k, v, tables, qsl, ctx = _case(8, 2, 64, 16, seqs, torch.float32, seed=4)
    out = paged_prefill_attention(q, k, v, tables, qsl, ctx, scale=0.2)
    dec = paged_attention(q, k, v, tables, ctx, scale=0.2, num_splits=1)
    assert relative_error(out, dec) < TOL[torch.float32]


def test_bad_inputs():
    q, k, v, tables, qsl, ctx = _case(4, 2, 32, 16, [(3, 5)], torch.float32, seed=1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k, v, tables, qsl.long(), ctx)
    with pytest.raises(ValueError, match="num_seqs"):
        paged_prefill_attention(q, k, v, tables, qsl[:1], ctx)
    with pytest.raises(ValueError, match="multiple"):
        paged_prefill_attention(q[:, :3], k, v, tables, qsl, ctx)
    with pytest.raises(ValueError, match="k_cache"):
        paged_prefill_attention(q, k.half(), v, tables, qsl, ctx)
    with pytest.raises(ValueError, match="out"):
        paged_prefill_attention(q, k, v, tables, qsl, ctx, out=q[:2])


def test_index_data_is_checked_on_the_host():
    q, k, v, tables, qsl, ctx = _case(4, 2, 32, 16, [(3, 5), (2, 20)], torch.float32, seed=2)  # 3 blocks wide
    i32 = dict(dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"context_lens\[1\]=49 must be in 1 \.\. 48"):
        paged_prefill_attention(q, k, v, tables, qsl, torch.tensor([5, 49], **i32))
    t = tables.clone()
    t[1, 1] = k.shape[0]
    with pytest.raises(ValueError, match=rf"block_tables\[1\] holds block id {k.shape[0]}"):
        paged_prefill_attention(q, k, v, t, qsl, ctx)
    with pytest.raises(ValueError, match="query_start_loc=\\[0, 3, 9\\] must rise from 0 to at most num_tokens=5"):
        paged_prefill_attention(q, k, v, tables, torch.tensor([0, 3, 9], **i32), ctx)
    with pytest.raises(ValueError, match=r"sequence 0 has 3 query rows but context_lens\[0\]=2"):
        paged_prefill_attention(q, k, v, tables, qsl, torch.tensor([2, 20], **i32))
    out = paged_prefill_attention(q, k, v, tables, qsl, ctx, check=False)
    assert relative_error(out, paged_prefill_attention_ref(q, k, v, tables, qsl, ctx)) < TOL[torch.float32]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's bfloat16 tl.dot is refused on the CPU only")
def test_bf16_is_refused_on_the_cpu():
    q, k, v, tables, qsl, ctx = _case(4, 2, 32, 16, [(3, 5)], torch.float32, seed=1)
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        paged_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, qsl, ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_prefill_attention_gpu(dtype):
    seqs = [(1, 4000), (1, 17), (512, 512), (300, 2300), (1100, 1100)]
    q, k, v, tables, qsl, ctx = _case(32, 8, 128, 16, seqs, dtype, seed=6, device="cuda")
    out = paged_prefill_attention(q, k, v, tables, qsl, ctx)
    ref = paged_prefill_attention_ref(q, k, v, tables, qsl, ctx)
    assert relative_error(out, ref) < TOL[dtype]
