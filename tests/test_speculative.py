"""Speculative decoding: greedy output equals plain greedy decoding token for token (both proposers, k in
{1, 2, 4}, batched with per-sequence k), rejected slots are rolled back without a leak, and the rejection rule
reproduces the target distribution (chi-square on a small vocabulary)."""

import pytest
import torch

from labkit.engine.proposers import DraftModelProposer, PromptLookupProposer
from labkit.engine.speculative import SpeculativeDecoder, accept
from labkit.kvcache import SeqBlocks
from labkit.model import ModelConfig, from_config, load_checkpoint


@pytest.fixture(scope="module")
def target():
    return load_checkpoint(dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from labkit.data import EMBEDDED_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    texts = ["The list type", "To open a file, use :func:`open`. To open a file,", "A decorator is", "x = [1, 2"]
    return [tok(t).input_ids for t in texts]


N_NEW = 12


@pytest.fixture(scope="module")
def reference(target, prompts):
    return [greedy_reference(target, p, N_NEW) for p in prompts]


def greedy_reference(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def small_draft(vocab, seed=1):
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    return from_config(cfg, dtype=torch.float32, seed=seed)


@pytest.mark.parametrize("k,which", [(1, "prompt_lookup"), (2, "prompt_lookup"), (4, "prompt_lookup"),
                                     (1, "draft_random"), (2, "draft_random"), (4, "draft_random"),
                                     (2, "draft_self")])
def test_greedy_equals_plain_greedy(target, prompts, reference, k, which):
    n, ref = N_NEW, reference
    proposer = {"prompt_lookup": lambda: PromptLookupProposer(),
                "draft_random": lambda: DraftModelProposer(small_draft(target.config.vocab_size)),
                "draft_self": lambda: DraftModelProposer(target)}[which]()
    dec = SpeculativeDecoder(target, proposer, k=[k, 0, k, 1][:len(prompts)], block_size=4)
    free = dec.cache.allocator.num_free
    out = dec.generate(prompts, n)
    assert out == ref
    assert dec.cache.allocator.num_free == free  # every block back, rejected ones included
    if which == "draft_self":  # the target as its own draft: everything is accepted
        assert dec.stats.accepted == dec.stats.proposed > 0
    if isinstance(proposer, DraftModelProposer):
        assert proposer.cache.allocator.num_free == proposer.cache.num_blocks


def test_plain_path_equals_reference(target, prompts, reference):
    assert SpeculativeDecoder(target, None).generate(prompts, N_NEW) == reference


def test_rollback_frees_blocks_and_keeps_kv(target):
    cache = target.make_cache(16, block_size=4)
    s = SeqBlocks(list(range(6)), "s")
    cache.allocate(s)
    used = cache.allocator.num_used
    s.token_ids += list(range(9))  # 15 tokens: 4 blocks
    cache.append_slots(s)
    assert cache.allocator.num_used == 4
    cache.rollback(s, 7)
    assert cache.allocator.num_used == used == 2 and s.token_ids == list(range(6)) + [0]
    cache.check_invariants([s])
    with pytest.raises(ValueError, match="num_tokens=0"):
        cache.rollback(s, 0)
    with pytest.raises(ValueError, match="num_tokens=9"):
        cache.rollback(s, 9)


def test_rejected_tokens_do_not_leak(target, prompts):
    dec = SpeculativeDecoder(target, DraftModelProposer(small_draft(target.config.vocab_size, seed=5)), k=4,
                             num_blocks=64, block_size=2)
    dec.generate(prompts, 10)
    assert dec.stats.proposed > dec.stats.accepted  # a random draft is rejected: rollbacks happened
    assert dec.cache.allocator.num_free == 64
    dec.cache.check_invariants([])


def test_prompt_lookup():
    p = PromptLookupProposer(max_ngram=2)
    assert p.lookup([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    assert p.lookup([1, 2, 3], 2) == []
    assert p.lookup([1, 9, 2, 1, 9], 5) == [2, 1, 9]
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_rule_follows_target(deterministic):
    # Vocabulary of 6, one proposed token: the emitted first token must follow p[0] whatever q is. Critical
    # value of chi-square with 5 degrees of freedom at p=0.001: 20.5.
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -3.0], [0.3, 0.1, 0.0, -1.0, 1.0, 0.5]])
    p0 = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.tensor([[2.5, -1.0, 0.5, 0.0, 1.0, 1.0]]), -1)
    counts, accepted = torch.zeros(6), 0
    draws = 20000
    for _ in range(draws):
        d = 0 if deterministic else int(torch.multinomial(q[0], 1, generator=g))
        n, x = accept(logits, [d], None if deterministic else q, 1.0, g)
        counts[d if n == 1 else x] += 1
        accepted += n
    assert chi_square(counts, p0) < 20.5
    # Acceptance probability is sum_x min(p, q) (1 - TV distance); for a fixed proposal d it is p(d).
    alpha = float(p0[0]) if deterministic else float(torch.minimum(p0, q[0]).sum())
    assert abs(accepted / draws - alpha) < 4 * (alpha * (1 - alpha) / draws) ** 0.5


def test_sampled_end_to_end_follows_target():
    # A tiny target and a different draft, vocabulary 5, k=3: the joint law of the first two new tokens equals
    # the target's (25 cells, chi-square 24 degrees of freedom, p=0.001: 51.2).
    cfg = ModelConfig(model_type="llama", vocab_size=5, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    tgt = from_config(cfg, dtype=torch.float32, seed=0, std=0.5)
    draft = from_config(cfg, dtype=torch.float32, seed=7, std=0.5)
    prompt = [1, 3, 2]
    with torch.no_grad():
        p1 = torch.softmax(tgt(torch.tensor([prompt]))[0, -1], -1)
        seconds = torch.softmax(tgt(torch.tensor([[*prompt, t] for t in range(5)]))[:, -1], -1)
    joint = (p1[:, None] * seconds).flatten()
    g = torch.Generator().manual_seed(1)
    dec = SpeculativeDecoder(tgt, DraftModelProposer(draft, num_blocks=256, block_size=4), k=3, num_blocks=256,
                             block_size=4)
    counts = torch.zeros(25)
    for _ in range(100):
        outs = dec.generate([prompt] * 40, 3, temperature=1.0, generator=g)
        for o in outs:
            counts[o[0] * 5 + o[1]] += 1
    assert 0 < dec.stats.accepted < dec.stats.proposed
    assert chi_square(counts, joint) < 51.2
    assert dec.cache.allocator.num_free == 256


def test_bad_input(target):
    dec = SpeculativeDecoder(target, PromptLookupProposer(), k=[1, 2])
    with pytest.raises(ValueError, match="ks="):
        dec.generate([[1, 2]], 4)
    with pytest.raises(ValueError, match="temperature"):
        dec.generate([[1, 2], [3]], 4, temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([[1, 2], [3]], 0)
