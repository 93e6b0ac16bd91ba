"""ContiguousKVCache: slabs, max_len and full errors, reservation metrics, and its attention against the paged
cache holding the same K/V."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kvcache import CacheFullError, ContiguousKVCache, PagedKVCache, SeqBlocks
from labkit.kvcache.attention import decode_attention


def test_slabs_reserve_max_len_whatever_the_length():
    c = ContiguousKVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_seqs=3, max_len=10,
                          allocate_pools=False)
    assert c.allocate("a", 3) == [c.rows["a"] * 10 + i for i in range(3)]
    c.allocate("b", 1)
    c.append_slots("b", 2)
    s = c.stats()
    assert (s.tokens_held, s.slots_reserved, s.slots_total) == (6, 20, 30)
    assert s.waste_frac == pytest.approx(14 / 20) and s.bytes_per_slot == 2 * 2 * 1 * 4 * 4
    c.free("a")
    assert c.stats().slots_reserved == 10


def test_full_and_too_long():
    c = ContiguousKVCache(1, 1, 2, max_seqs=2, max_len=4, allocate_pools=False)
    with pytest.raises(CacheFullError, match="would hold 5 tokens but a slab holds max_len=4"):
        c.allocate("long", 5)
    assert "long" not in c.rows
    c.allocate("a", 4)
    c.allocate("b", 1)
    with pytest.raises(CacheFullError, match="all 2 slabs of 4 tokens are taken"):
        c.allocate("c", 1)
    with pytest.raises(CacheFullError, match="max_len=4"):
        c.append_slots("a", 1)
    assert c.lens["a"] == 4
    with pytest.raises(ValueError, match="already in the cache"):
        c.allocate("a", 1)
    with pytest.raises(KeyError):
        c.free("zz")
    with pytest.raises(ValueError, match="max_len"):
        ContiguousKVCache(1, 1, 2, max_seqs=2, max_len=0)
    with pytest.raises(ValueError, match="contiguous baseline stores fp32, bf16 or fp16"):
        ContiguousKVCache(1, 1, 2, max_seqs=2, max_len=4, dtype="int8")


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_contiguous_and_paged_attention_agree(block_size):
    """Same K/V written in irregular chunks to both caches; decode attention over each agrees to fp32
    tolerance."""
    g = torch.Generator().manual_seed(block_size)
    kv_heads, heads, d, lens = 3, 6, 24, [1, 7, 33, 16, 50]
    contig = ContiguousKVCache(2, kv_heads, d, max_seqs=len(lens), max_len=64)
    paged = PagedKVCache(2, kv_heads, d, num_blocks=120, block_size=block_size)
    for t in contig.k_caches + contig.v_caches + paged.k_caches + paged.v_caches:
        t.fill_(float("nan"))
    seqs = [SeqBlocks([], sid) for sid in range(len(lens))]
    for seq, n in zip(seqs, lens):
        sid = seq.seq_id
        first = 1 + int(torch.randint(0, n, (1,), generator=g))  # a prompt, then one token at a time
        for i, m in enumerate([first] + [1] * (n - first)):
            seq.token_ids += [0] * m
            if i == 0:
                c_slots = contig.allocate(sid, m)
                paged.allocate(seq)
            else:
                c_slots = contig.append_slots(sid, m)
                paged.append_slots(seq)
            p_slots = paged.slots(seq, seq.num_tokens - m, seq.num_tokens)
            for layer in range(2):
                k, v = torch.randn(2, m, kv_heads, d, generator=g)
                contig.write(layer, torch.tensor(c_slots), k, v)
                paged.write(layer, torch.tensor(p_slots), k, v)
    ids = list(range(len(lens)))
    assert paged.context_lens(seqs).tolist() == lens
    for layer in range(2):
        q = torch.randn(len(lens), heads, d, generator=g)
        ref = contig.attention(layer, q, ids)
        out = decode_attention(q, paged.k_caches[layer], paged.v_caches[layer], paged.block_tables(seqs),
                               paged.context_lens(seqs), backend="torch")
        assert not ref.isnan().any() and relative_error(out, ref) <= 1e-5


def test_negative_layer_is_refused():
    c = ContiguousKVCache(2, 1, 4, max_seqs=1, max_len=4)
    c.allocate("a", 2)
    with pytest.raises(ValueError, match=r"layer=-1 must be an int in \[0, 2\)"):
        c.write(-1, torch.tensor([0, 1]), torch.randn(2, 1, 4), torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match=r"layer=2 must be an int in \[0, 2\)"):
        c.attention(2, torch.randn(1, 1, 4), ["a"])
