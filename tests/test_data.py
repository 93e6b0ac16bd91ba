import pytest

from labkit.data import CORPUS_DIR, SPLITS, read_split, sample_prompts, split_tokens


def test_splits_exist_and_are_disjoint():
    docs = {s: set(read_split(s).split("<|endoftext|>")) for s in SPLITS}
    assert (CORPUS_DIR / "heldout.txt").stat().st_size < 1_000_000
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                shared = {d for d in docs[a] & docs[b] if len(d.strip()) > 200}
                assert not shared, f"{a} and {b} share documents"
    assert (CORPUS_DIR / "LICENSE-python-docs.txt").exists()


def test_tokens_and_prompts(tiny_model):
    _, tok = tiny_model
    ids = split_tokens("heldout", tok, max_tokens=500)
    assert ids.shape == (500,) and int(ids.max()) < tok.vocab_size
    p = sample_prompts(tok, 3, 17, seed=1)
    assert len(p) == 3 and all(len(x) == 17 for x in p) and p == sample_prompts(tok, 3, 17, seed=1)
    with pytest.raises(ValueError, match="split='test' is unknown"):
        read_split("test")
    with pytest.raises(ValueError, match="max_tokens=1"):
        split_tokens("heldout", tok, max_tokens=1)
