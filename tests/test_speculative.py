"""Speculative decoding inside LLMEngine: greedy output equals plain engine decoding (and HF greedy) token for token
with both proposers and k in {1, 4}, per-request k (0 included), under preemption by recompute and by swap, with
chunked prefill, with aborts while speculating and under every scheduler; no block of the target's or the draft's
cache leaks; the rejection rule reproduces the target distribution (chi-square on a small vocabulary, through the
engine and alone); bad configurations are refused naming the argument."""

import numpy as np
import pytest
import torch

from labkit.data import sample_prompts
from labkit.engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig, accept
from labkit.engine.proposers import DraftModelProposer, NgramMatcher, PromptLookupProposer, common_prefix_len
from labkit.engine.speculative import accept_greedy, accept_sampled, target_probs
from labkit.kvcache import SeqBlocks
from labkit.model import ModelConfig, from_config

pytestmark = pytest.mark.usefixtures("one_thread")

LENS_OUT = [20, 14, 6, 18, 11, 16]


@pytest.fixture(scope="module")
def draft():
    """The shipped draft model (data/pydocs-llama-draft: the embedded model's tokenizer, a sixth of its size): it
    agrees with the target on part of the tokens, so both acceptance and rejection happen."""
    from labkit.data import DATA_DIR
    from labkit.model import load_checkpoint

    return load_checkpoint(DATA_DIR / "pydocs-llama-draft", dtype=torch.float32)


def small_draft(vocab, seed=1):
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    return from_config(cfg, dtype=torch.float32, seed=seed)


def params_for(lens_out, ks=None):
    ks = ks or [None] * len(lens_out)
    return [SamplingParams(max_tokens=n, ignore_eos=True, num_speculative_tokens=k) for n, k in zip(lens_out, ks)]


def make_engine(model, **kw):
    return LLMEngine(model, **{**dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64), **kw})


def drive(engine, prompts, params, abort_after=None, abort_ids=()):
    """Requests in, steps until done with the invariants checked after each step (target cache, swap space, draft
    cache; the draft holds only running sequences); ``abort_ids`` aborted after ``abort_after`` steps. Returns the
    output token ids by request."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    schedule, budget = engine.scheduler.schedule, engine.config.max_num_batched_tokens

    def checked_schedule():  # a step's tokens, proposals included, stay within the token budget
        batch = schedule()
        if engine.config.scheduler == "continuous":
            assert batch.total_tokens + sum(s.num_lookahead for s in batch.seqs) <= budget
        return batch

    engine.scheduler.schedule = checked_schedule
    steps = 0
    prop = engine.speculator.proposer if engine.speculator is not None else None
    while engine.has_unfinished():
        engine.step()
        steps += 1
        engine.scheduler.check_invariants()
        if isinstance(prop, DraftModelProposer):
            prop.cache.check_invariants(list(prop.seqs.values()))
            assert set(prop.seqs) <= {s.seq_id for s in engine.scheduler.running}
        if steps == abort_after:
            for i in abort_ids:
                engine.abort_request(ids[i])
    return {o.request_id: o for o in engine.outputs()}, ids


def assert_no_leak(engine):
    """Every block back in its pool but a CUDA graph's scratch block (one per runner that captured graphs: the
    target's and the draft's), which the runner holds for the engine's life."""
    def held(runner):
        return 0 if runner.scratch_block is None else 1

    assert engine.cache.allocator.num_free == engine.cache.num_blocks - held(engine.runner)
    assert engine.cache.allocator.num_free == engine.scheduler.usable_blocks
    assert not any(s.block_table for s in engine.seqs.values())
    prop = engine.speculator.proposer if engine.speculator is not None else None
    if isinstance(prop, DraftModelProposer):
        assert not prop.seqs and prop.cache.allocator.num_free == prop.cache.num_blocks - held(prop.runner)


@pytest.fixture(scope="module")
def workload(tiny_model):
    """Six prompts of 5..30 tokens (one repeating itself, so prompt lookup finds matches) and the plain engine's
    greedy outputs, unconstrained."""
    model, tok = tiny_model
    lens_in = [30, 5, 17, 23, 9, 12]
    prompts = [p[:n] for p, n in zip(sample_prompts(tok, 6, 30, seed=21), lens_in, strict=True)]
    prompts[2] = (prompts[2][:8] * 3)[:17]
    outs = make_engine(model, num_blocks=64).generate(prompts, params_for(LENS_OUT), progress=False)
    return prompts, [o.output_token_ids for o in outs]


SPECS = {"prompt_lookup": lambda m, d, k: SpeculativeConfig("prompt_lookup", k),
         "draft": lambda m, d, k: SpeculativeConfig("draft", k, draft_model=d),
         "draft_random": lambda m, d, k: SpeculativeConfig("draft", k, draft_model=small_draft(m.config.vocab_size)),
         "draft_self": lambda m, d, k: SpeculativeConfig("draft", k, draft_model=m)}


def test_plain_reference_is_hf_greedy(tiny_model, draft, workload):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=64, speculative=SPECS["draft"](model, draft, 4))
    outs = engine.generate(prompts[:2], params_for(LENS_OUT[:2]), progress=False)
    for p, o, n in zip(prompts[:2], outs, LENS_OUT):
        hf = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.output_token_ids == hf[0, len(p):].tolist()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("which", list(SPECS))
def test_greedy_equals_plain_engine(tiny_model, draft, workload, which, k):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=64, speculative=SPECS[which](model, draft, k))
    outs, ids = drive(engine, prompts, params_for(LENS_OUT))
    assert [outs[i].output_token_ids for i in ids] == ref
    s = engine.run_stats()
    assert s["draft_tokens"] > 0 and s["spec_decodes"] > 0
    if which == "draft_self":  # the target as its own draft: everything is accepted
        assert s["accepted_tokens"] == s["draft_tokens"]
        plain = make_engine(model, num_blocks=64)
        plain.generate(prompts, params_for(LENS_OUT), progress=False)
        assert s["steps"] < plain.run_stats()["steps"]  # several tokens per step
    if which in ("draft", "prompt_lookup"):  # some accepted, some rejected: both sides of the rollback exercised
        assert 0 < s["accepted_tokens"] < s["draft_tokens"]
    if which == "draft_random":
        assert s["accepted_tokens"] < s["draft_tokens"]
    assert_no_leak(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("which", ["prompt_lookup", "draft"])
def test_oversubscribed_cache_preempts_and_matches(tiny_model, draft, workload, which, mode):
    model, _ = tiny_model
    prompts, ref = workload
    # 13 blocks of 4 = 52 slots; the longest request needs 49 at its end, the six together 238
    engine = make_engine(model, num_blocks=13, preemption_mode=mode, speculative=SPECS[which](model, draft, 3))
    outs, ids = drive(engine, prompts, params_for(LENS_OUT))
    assert [outs[i].output_token_ids for i in ids] == ref
    s = engine.run_stats()
    assert s["preemptions"] > 0 and 0 < s["accepted_tokens"] < s["draft_tokens"] and s["peak_blocks_used"] <= 13
    if mode == "swap":
        assert s["swapped_out_blocks"] > 0
    assert_no_leak(engine)


def test_prefix_caching_under_preemption(tiny_model, draft, workload):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=13, enable_prefix_caching=True, speculative=SPECS["draft"](model, draft, 4))
    outs, ids = drive(engine, [*prompts, prompts[0]], params_for([*LENS_OUT, LENS_OUT[0]]))
    assert [outs[i].output_token_ids for i in ids] == [*ref, ref[0]]
    s = engine.run_stats()
    assert s["preemptions"] > 0 and s["prefix_hit_tokens"] > 0 and s["accepted_tokens"] > 0
    assert not any(s.block_table for s in engine.seqs.values())


@pytest.mark.parametrize("which", ["prompt_lookup", "draft"])
def test_chunked_prefill_small_budget(tiny_model, draft, workload, which):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                         speculative=SPECS[which](model, draft, 4))
    outs, ids = drive(engine, prompts, params_for(LENS_OUT))
    assert [outs[i].output_token_ids for i in ids] == ref
    assert 0 < engine.run_stats()["accepted_tokens"] < engine.run_stats()["draft_tokens"]
    assert_no_leak(engine)


@pytest.mark.parametrize("scheduler", ["fifo", "static"])
def test_other_schedulers(tiny_model, draft, workload, scheduler):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=64, scheduler=scheduler, speculative=SPECS["draft"](model, draft, 2))
    outs, ids = drive(engine, prompts, params_for(LENS_OUT))
    assert [outs[i].output_token_ids for i in ids] == ref and engine.run_stats()["accepted_tokens"] > 0
    assert_no_leak(engine)


def test_abort_while_speculating(tiny_model, draft, workload):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=13, speculative=SPECS["draft"](model, draft, 4))
    outs, ids = drive(engine, prompts, params_for(LENS_OUT), abort_after=6, abort_ids=(0, 3))
    for j, i in enumerate(ids):
        got = outs[i].output_token_ids
        if j in (0, 3):
            assert outs[i].finish_reason == "abort" and got == ref[j][:len(got)] and len(got) < LENS_OUT[j]
        else:
            assert outs[i].output_token_ids == ref[j]
    assert_no_leak(engine)
    engine.add_request(prompts[1], params_for(LENS_OUT)[1])  # reset(abort=True) frees the draft's blocks too
    engine.step()
    engine.step()
    engine.reset(abort=True)
    assert_no_leak(engine)


def test_per_request_k(tiny_model, draft, workload):
    model, _ = tiny_model
    prompts, ref = workload
    engine = make_engine(model, num_blocks=13, speculative=SPECS["draft"](model, draft, 4))
    outs, ids = drive(engine, prompts, params_for(LENS_OUT, [0, 1, None, 3, 0, 2]))
    assert [outs[i].output_token_ids for i in ids] == ref
    assert engine.run_stats()["draft_tokens"] > 0
    engine.reset()
    outs, ids = drive(engine, prompts, params_for(LENS_OUT, [0] * 6))  # k = 0 for every request: plain decoding
    assert [outs[i].output_token_ids for i in ids] == ref
    assert engine.run_stats()["draft_tokens"] == engine.run_stats()["spec_decodes"] == 0
    assert_no_leak(engine)
    plain = make_engine(model, num_blocks=64)
    with pytest.raises(ValueError, match="num_speculative_tokens=2 but the engine does not speculate"):
        plain.add_request(prompts[0], SamplingParams(num_speculative_tokens=2))


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
    for t in range(draws):
        d = 0 if deterministic else int(torch.multinomial(q[0], 1, generator=g))
        n, x = accept(logits, [d], None if deterministic else q, 1.0, (t, 0))  # each draw its own stream
        counts[d if n == 1 else x] += 1
        accepted += n
    assert chi_square(counts, p0) < 20.5
    # Acceptance probability is sum_x min(p, q) (1 - TV distance); for a fixed proposal d it is p(d).
    alpha = float(p0[0]) if deterministic else float(torch.minimum(p0, q[0]).sum())
    assert abs(accepted / draws - alpha) < 4 * (alpha * (1 - alpha) / draws) ** 0.5


@pytest.mark.parametrize("method,top_k", [("draft", 0), ("draft", 3), ("prompt_lookup", 0)])
def test_sampled_engine_output_follows_target(method, top_k):
    # A tiny target and a different draft, vocabulary 5, k=3, through the engine (its scheduler, lookahead slots,
    # rollback): the joint law of the first two new tokens of 2,000 requests (each its own seed) equals the
    # target's (25 cells, chi-square with at most 24 degrees of freedom, p=0.001: 51.2).
    sampled_output_follows_target(method, top_k, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("method,top_k", [("draft", 0), ("draft", 3)])
def test_sampled_engine_output_follows_target_on_cuda(method, top_k):
    """The same law on CUDA, where the draft's draws, its ``q`` and the acceptance's residual stay on the device
    (inverse-CDF draws at uniforms from each sequence's CPU generator)."""
    sampled_output_follows_target(method, top_k, "cuda")


def sampled_output_follows_target(method: str, top_k: int, device: str) -> None:
    cfg = ModelConfig(model_type="llama", vocab_size=5, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    tgt = from_config(cfg, device=device, dtype=torch.float32, seed=0, std=0.5)
    draft = from_config(cfg, device=device, dtype=torch.float32, seed=7, std=0.5)
    prompt = [1, 3, 2, 1, 3, 2, 1]  # repeats: prompt lookup proposes
    sp = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)
    with torch.no_grad():
        p1 = target_probs(tgt(torch.tensor([prompt], device=device))[0, -1:], sp)[0].cpu()
        seconds = target_probs(tgt(torch.tensor([[*prompt, t] for t in range(5)], device=device))[:, -1], sp).cpu()
    joint = (p1[:, None] * seconds).flatten()
    spec = SpeculativeConfig(method, 3, draft_model=draft if method == "draft" else None)
    engine = LLMEngine(tgt, block_size=4, num_blocks=1200, max_num_seqs=256, max_num_batched_tokens=2048,
                       speculative=spec, seed=3)
    outs = engine.generate([prompt] * 2000, sp, progress=False)
    counts = torch.zeros(25)
    for o in outs:
        counts[o.output_token_ids[0] * 5 + o.output_token_ids[1]] += 1
    s = engine.run_stats()
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]
    assert chi_square(counts, joint) < 51.2
    assert_no_leak(engine)


def test_prompt_lookup():
    p = PromptLookupProposer(max_ngram=2)
    assert p.lookup([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    assert p.lookup([1, 2, 3], 2) == []
    assert p.lookup([1, 9, 2, 1, 9], 5) == [2, 1, 9]
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(max_ngram=1, min_ngram=2)


def test_lookahead_slots_and_rollback():
    model = small_draft(64)
    cache = model.make_cache(16, block_size=4)
    s = SeqBlocks(list(range(6)), "s")
    cache.allocate(s)
    assert cache.can_append(s, 9) and not cache.can_append(s, 4 * 16)
    cache.append_slots(s, 9)  # 6 tokens + 9 lookahead slots: 4 blocks
    assert cache.allocator.num_used == 4
    s.token_ids += [1, 2, 3]
    cache.rollback(s, 7)
    assert cache.allocator.num_used == 2 and s.token_ids == list(range(6)) + [1]
    cache.check_invariants([s])
    with pytest.raises(ValueError, match="lookahead=-1"):
        cache.append_slots(s, -1)
    with pytest.raises(ValueError, match="num_tokens=0"):
        cache.rollback(s, 0)


def test_bad_configuration(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="method='medusa' is unknown; allowed"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens=0 must be an int >= 1"):
        SpeculativeConfig("prompt_lookup", 0)
    with pytest.raises(ValueError, match="a draft model goes with method='draft'"):
        SpeculativeConfig("draft", 2)
    with pytest.raises(ValueError, match="prompt_lookup_min=4"):
        SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=4)
    with pytest.raises(ValueError, match="vocabulary of 64 tokens"):
        LLMEngine(model, num_blocks=16, speculative=SpeculativeConfig("draft", 2, draft_model=small_draft(64)))
    with pytest.raises(ValueError, match="speculative='ngram' must be a SpeculativeConfig"):
        EngineConfig(speculative="ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens=-1 must be an int >= 0"):
        SamplingParams(num_speculative_tokens=-1)


def test_draw_rows_batched_equals_per_row():
    """The draft's batched draws: greedy rows take the argmax, sampled rows the inverse-CDF draw of a per-row softmax
    at their temperature and their uniform, with that softmax as their row of ``q``."""
    from labkit.engine.proposers import draw_rows

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    temps, uniforms = [0.0, 0.7, 0.0, 1.3], [0.5, 0.31, 0.9, 0.77]
    tokens, q = draw_rows(logits, temps, uniforms)
    assert q.shape == (2, 50) and tokens.dtype == torch.int64
    for r in range(4):
        if temps[r] == 0:
            assert int(tokens[r]) == int(logits[r].argmax())
            continue
        want = torch.softmax(logits[r] / temps[r], dim=-1)
        assert torch.allclose(q[[1, 3].index(r)], want, rtol=1e-6, atol=1e-7)
        assert int(tokens[r]) == int((want.cumsum(0) > uniforms[r] * want.sum()).nonzero()[0])
    assert draw_rows(logits, [0.0] * 4, [0.0] * 4)[1] is None
    with pytest.raises(ValueError, match="one temperature and one uniform per row"):
        draw_rows(logits, temps[:3], uniforms[:3])


def test_token_uniforms_are_uniform_and_depend_on_seed_and_index_alone():
    """``token_uniforms``: the same (seed, index) gives the same number in any batch; over many pairs the numbers
    fill [0, 1) evenly (a chi-square over 20 bins) with no correlation between neighbouring indices."""
    from labkit.engine.sampling import token_uniforms

    seeds = np.repeat(np.arange(200), 100)
    index = np.tile(np.arange(100), 200)
    u = token_uniforms(seeds, index)
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert token_uniforms(seeds[::-7], index[::-7]).tolist() == u[::-7].tolist()
    counts = np.bincount((u * 20).astype(int), minlength=20)
    expected = len(u) / 20
    assert ((counts - expected) ** 2 / expected).sum() < 43.8  # 19 degrees of freedom, p = 0.001
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.03
    with pytest.raises(ValueError, match="one index per seed"):
        token_uniforms([1, 2], [0])


def test_inverse_cdf_draws_each_token_at_its_probability():
    """``inverse_cdf``: an unnormalised row's zero-probability tokens are never drawn; at a uniform grid of ``u`` the
    tokens come out in proportion to their probability (to the grid's resolution), and the edge ``u`` -> 1 stays in
    the vocabulary."""
    from labkit.engine.sampling import inverse_cdf

    row = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])  # sums to 4: tokens 1, 3, 4 at 1/2, 1/4, 1/4
    n = 4000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    drawn = inverse_cdf(row.expand(n, -1), u)
    counts = torch.bincount(drawn, minlength=6).tolist()
    assert counts == [0, n // 2, 0, n // 4, n // 4, 0]
    assert int(inverse_cdf(row[None], torch.tensor([1 - 2 ** -24]))[0]) == 4
    assert int(inverse_cdf(torch.zeros(1, 6), torch.tensor([0.3]))[0]) in range(6)
    with pytest.raises(ValueError, match="uniforms"):
        inverse_cdf(row[None], torch.tensor([0.1, 0.2]))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["prompt_lookup", "draft"])
def test_speculating_engine_replays_cuda_graphs(method):
    """On CUDA (the embedded model, float32): verify steps replay their graphs and the draft its decode and catch-up
    (token-count) graphs, and greedy output equals plain decoding token for token. With the target as its own draft
    every proposal is accepted, so nearly every step is a verify step: all but the prefill step must have
    replayed."""
    from labkit.model import load_model

    model = load_model(device="cuda")[0]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=128)
    want = [o.output_token_ids for o in LLMEngine(model, **kw).generate(prompts, params, progress=False)]
    spec = SpeculativeConfig(method, 3, draft_model=model if method == "draft" else None)
    engine = LLMEngine(model, speculative=spec, **kw)
    assert [o.output_token_ids for o in engine.generate(prompts, params, progress=False)] == want
    st = engine.stats
    assert st.spec_decodes > 0
    if method == "draft":
        assert st.accepted_tokens == st.draft_tokens > 0
        assert st.graph_steps >= st.steps - 1, (st.graph_steps, st.steps)
        draft = engine.speculator.proposer.runner
        assert draft.graph_batch_sizes and draft.graphs.token_sizes  # its decode and catch-up graphs


def test_greedy_acceptance_from_argmaxes_equals_accept():
    """The engine accepts greedy rows from one batched argmax (``accept_greedy``): the same rule as ``accept`` at
    temperature 0 on each sequence's logits, for every number of matching proposals."""
    g = torch.Generator().manual_seed(11)
    for k in (1, 3, 5):
        p = torch.randn(k + 1, 50, generator=g)
        best = p.argmax(dim=-1).tolist()
        for n_match in range(k + 1):
            proposal = best[:n_match] + [(t + 1) % 50 for t in best[n_match:k]]
            assert accept_greedy(best, proposal) == accept(p, proposal, None) == (n_match, best[n_match])


def test_sampled_acceptance_of_a_batch_equals_one_sequence_at_a_time():
    """The engine accepts its sampled rows together (``accept_sampled``: two copies to the host for the batch): each
    sequence's outcome is the one it gets alone from the same generator state, whatever its neighbours' ``k``,
    ``q`` (a draft's or none) and sampling parameters."""
    g = torch.Generator().manual_seed(5)
    vocab = 40
    cases = []
    for k, drafted, prm in [(1, True, SamplingParams(temperature=0.7)), (4, False, SamplingParams(temperature=1.3)),
                            (3, True, SamplingParams(temperature=1.0, top_k=5)),
                            (2, False, SamplingParams(temperature=0.9, top_p=0.8))]:
        logits = torch.randn(k + 1, vocab, generator=g) * 2
        q = torch.softmax(torch.randn(k, vocab, generator=g), -1) if drafted else None
        proposal = torch.randint(vocab, (k,), generator=g).tolist()
        cases.append((logits, proposal, q, prm))
    for seed in range(30):
        alone = [accept_sampled([x], [d], [q], [prm], [(seed + i, 3 * i)])[0]
                 for i, (x, d, q, prm) in enumerate(cases)]
        together = accept_sampled([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases],
                                  [c[3] for c in cases], [(seed + i, 3 * i) for i in range(len(cases))])
        assert together == alone
        for (x, d, _, prm), (n, tok) in zip(cases, together):
            assert 0 <= n <= len(d) and 0 <= tok < vocab
            assert target_probs(x, prm)[n, tok] > 0  # the next token is one the target can emit at its position
    assert accept_sampled([], [], [], [], []) == []


def _scan_lookup(ctx: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup by scanning the context (the definition the matcher must agree with)."""
    if k == 0:
        return []
    for n in range(min(max_ngram, len(ctx) - 1), min_ngram - 1, -1):
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == ctx[-n:]:
                return ctx[start + n:start + n + k]
    return []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_ngram_matcher_follows_appends_and_rollbacks(max_ngram, min_ngram):
    """The proposer's per-sequence tokens, synced to a context that grows (past the array's first capacity), is cut
    back (rejected proposals) and grows again, propose what a scan of the whole context proposes, at every step; a
    fresh context for the same sequence (nothing in common) replaces them."""
    g = torch.Generator().manual_seed(max_ngram * 10 + min_ngram)
    matcher = NgramMatcher(max_ngram, min_ngram)
    ctx: list[int] = []
    for step in range(600):
        r = int(torch.randint(10, (), generator=g))
        if r < 6:
            ctx += torch.randint(5, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()
        elif r < 9:
            del ctx[max(0, len(ctx) - int(torch.randint(1, 6, (), generator=g))):]
        elif step % 50 == 9:
            ctx = torch.randint(5, (30,), generator=g).tolist()
        if step == 300:
            ctx += torch.randint(5, (300,), generator=g).tolist()
        matcher.sync(tuple(ctx) if step % 7 == 0 else ctx)
        assert matcher.tokens == ctx and matcher.array[:len(ctx)].tolist() == ctx
        for k in (0, 1, 4):
            assert matcher.propose(k) == _scan_lookup(ctx, k, max_ngram, min_ngram), (ctx, k)


def test_prompt_lookup_proposer_keeps_a_matcher_per_sequence_until_released():
    p = PromptLookupProposer()
    a, b = [1, 2, 3, 1, 2], [7, 8, 7]
    assert p.propose(["a", "b"], [a, b], [2, 2]) == [([3, 1], None), ([8, 7], None)]
    assert p.propose(["a"], [a + [3]], [3]) == [([1, 2, 3], None)]
    p.release("a")
    assert set(p.matchers) == {"b"}


def _greedy_continuation(model, context: list[int], k: int) -> list[int]:
    """``k`` greedy tokens after ``context`` by the dense forward (no cache): the reference for a draft's proposal."""
    ids = list(context)
    for _ in range(k):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(context):]


def test_greedy_draft_proposals_stay_on_the_device_and_match_dense_greedy(draft):
    """The draft's greedy steps feed each other on the device (placeholder ids) and are read once: the proposals
    are the draft's dense greedy continuations, round after round as the target keeps part of them (the draft's
    copies hold real tokens again, so it rolls back and catches up right), with a different ``k`` per row; a row
    the draft's cache cannot extend keeps the proposals it made."""
    g = torch.Generator().manual_seed(3)
    vocab = draft.config.vocab_size
    contexts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 14, 6)]
    ks = [4, 2, 3]
    prop = DraftModelProposer(draft, num_blocks=64, block_size=4, max_num_seqs=4, cuda_graphs=False)
    for _ in range(3):
        out = prop.propose(["a", "b", "c"], contexts, ks)
        for ctx, k, (toks, q) in zip(contexts, ks, out):
            assert q is None and toks == _greedy_continuation(draft, ctx, k)
        for i, (toks, _) in enumerate(out):  # the target keeps i of them and adds a token of its own
            contexts[i] = contexts[i] + toks[:i] + [5 + i]
    assert all(t >= 0 for sid in "abc" for t in prop.seqs[sid].token_ids)
    # a cache of 5 blocks of 4 (slots 0..19) and an 18-token context: proposals 2 and 3 take slots 18 and 19; the
    # 4th would need slot 20
    small = DraftModelProposer(draft, num_blocks=5, block_size=4, max_num_seqs=2, cuda_graphs=False)
    ctx = torch.randint(3, vocab, (18,), generator=g).tolist()
    (toks, _), = small.propose(["x"], [ctx], [4])
    assert toks == _greedy_continuation(draft, ctx, 3)


def _sampled_continuation(model, context: list[int], temperature: float, uniforms) -> tuple[list[int], torch.Tensor]:
    """Tokens drawn one by one after ``context`` by the dense forward at ``temperature``, the ``j``-th by inverting
    the softmax's cumulative sum at ``uniforms[j]``; returns them and their distributions ``[len(uniforms), vocab]``:
    the reference for a sampled draft's proposal and its ``q``."""
    ids, qs = list(context), []
    for u in uniforms:
        q = torch.softmax(model(torch.tensor([ids]))[0, -1].float() / temperature, dim=-1)
        qs.append(q)
        ids.append(int((q.cumsum(0) > float(u) * q.sum()).nonzero()[0]))
    return ids[len(context):], torch.stack(qs)


def test_sampled_draft_proposals_match_dense_sampling(draft):
    """The draft's sampled steps feed each other on the device as the greedy ones do: beside a greedy row, each
    sampled row's proposals are the dense forward's draws at its temperature and its stream's uniforms
    (``token_uniforms(seed, index + j)``), its ``q`` the dense softmaxes, round after round as the target keeps part of
    them; without streams a sampled proposal is refused."""
    from labkit.engine.sampling import token_uniforms

    g = torch.Generator().manual_seed(4)
    vocab = draft.config.vocab_size
    contexts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (11, 7, 15)]
    ks, temps = [3, 4, 2], [0.8, 0.0, 1.3]
    prop = DraftModelProposer(draft, num_blocks=64, block_size=4, max_num_seqs=4, cuda_graphs=False)
    for rnd in range(3):
        streams = [(17 + i, 10 * rnd) for i in range(3)]
        out = prop.propose(["a", "b", "c"], contexts, ks, temps, streams)
        for ctx, k, t, (seed, index), (toks, q) in zip(contexts, ks, temps, streams, out):
            if t == 0:
                assert q is None and toks == _greedy_continuation(draft, ctx, k)
                continue
            want, want_q = _sampled_continuation(draft, ctx, t, token_uniforms([seed] * k, range(index, index + k)))
            assert toks == want
            torch.testing.assert_close(q, want_q, rtol=1e-4, atol=1e-6)
        for i, (toks, _) in enumerate(out):  # the target keeps i of them and adds a token of its own
            contexts[i] = contexts[i] + toks[:i] + [5 + i]
    with pytest.raises(ValueError, match="need streams"):
        prop.propose(["a"], [contexts[0]], [2], [0.7])


@pytest.mark.gpu
def test_sampled_speculation_syncs_do_not_grow_with_the_batch():
    """On CUDA a sampled speculative round (the draft's k steps, then ``accept_sampled``) synchronises the host with
    the GPU a fixed number of times, whatever the batch: the draws, ``q`` and the residual stay on the device, and the
    host reads tokens and ``p``/``q`` values in a few batched copies (counted by torch's sync debug mode)."""
    import warnings

    from labkit.data import DATA_DIR
    from labkit.model import load_checkpoint

    cuda_draft = load_checkpoint(DATA_DIR / "pydocs-llama-draft", dtype=torch.float32, device="cuda")
    vocab = cuda_draft.config.vocab_size
    prop = DraftModelProposer(cuda_draft, num_blocks=256, block_size=16, max_num_seqs=32, cuda_graphs=False)
    g = torch.Generator().manual_seed(8)
    sp = SamplingParams(temperature=0.9)

    def syncs(n: int, rnd: int) -> int:
        ids = [f"{n}-{i}" for i in range(n)]
        contexts = [torch.randint(3, vocab, (20 + i,), generator=g).tolist() for i in range(n)]
        streams = [(i, rnd) for i in range(n)]
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = prop.propose(ids, contexts, [3] * n, [sp.temperature] * n, streams)
                logits = [torch.randn(len(t) + 1, vocab, device="cuda") for t, _ in out]
                accept_sampled(logits, [t for t, _ in out], [q for _, q in out], [sp] * n, streams)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for i in ids:
            prop.release(i)
        return sum("synchroniz" in str(w.message) for w in caught)

    syncs(2, 0)  # first use: allocations, kernel selection
    few, many = syncs(2, 1), syncs(16, 2)
    assert many == few and 0 < few <= 10, (few, many)


def test_common_prefix_len():
    g = torch.Generator().manual_seed(8)
    for _ in range(300):
        a = torch.randint(3, (int(torch.randint(0, 200, (), generator=g)),), generator=g).tolist()
        b = list(a[:int(torch.randint(0, len(a) + 1, (), generator=g))])
        if b and int(torch.randint(2, (), generator=g)):  # a difference anywhere: near the tail or far from it
            b[int(torch.randint(len(b), (), generator=g))] += 5
        b += torch.randint(3, (int(torch.randint(0, 5, (), generator=g)),), generator=g).tolist()
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == expected
