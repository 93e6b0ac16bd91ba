"""Sampler and SamplingParams: greedy is argmax, top-k/top-p against a per-row reference, seeded draws follow the
distribution and do not depend on the batch a request sits in."""

import math

import pytest
import torch

from labkit.engine.sampling import Sampler, SamplingParams, apply_top_k_top_p


def top_k_top_p_ref(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """One row, step by step: keep the k largest, then the smallest prefix (by probability) reaching p."""
    order = sorted(range(row.numel()), key=lambda i: -row[i].item())
    keep = order[:k] if k else order
    probs = torch.softmax(row[keep], dim=0).tolist()
    kept, mass = [], 0.0
    for i, pr in zip(keep, probs):
        if kept and mass >= p:
            break
        kept.append(i)
        mass += pr
    out = torch.full_like(row, float("-inf"))
    out[kept] = row[kept]
    return out


@pytest.mark.parametrize("k,p", [(0, 1.0), (3, 1.0), (0, 0.5), (5, 0.8), (1, 0.3), (37, 0.99)])
def test_top_k_top_p_matches_reference(k, p):
    g = torch.Generator().manual_seed(k * 100 + int(p * 10))
    logits = torch.randn(4, 37, generator=g) * 3
    out = apply_top_k_top_p(logits, torch.full((4,), k), torch.full((4,), p))
    for r in range(4):
        ref = top_k_top_p_ref(logits[r], k, p)
        assert torch.equal(out[r].isinf(), ref.isinf())
        assert torch.equal(out[r][~ref.isinf()], ref[~ref.isinf()])


def test_greedy_is_argmax_and_seeds_ignore_batch_composition():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 101, generator=g)
    sampler = Sampler()
    greedy = SamplingParams()
    hot = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)
    seeds, idx = [7, 8, 9, 10, 11], [0, 3, 1, 4, 2]
    mixed = [greedy, hot, hot, greedy, hot]
    tokens = sampler(logits, mixed, seeds, idx)
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()
    # each sampled row alone, and in reversed order, draws the same token
    for r in (1, 2, 4):
        assert sampler(logits[r:r + 1], [hot], [seeds[r]], [idx[r]]) == [tokens[r]]
    rev = sampler(logits.flip(0), mixed[::-1], seeds[::-1], idx[::-1])
    assert rev[::-1] == tokens


def test_seeded_samples_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sampler = Sampler()
    n = 3000

    def freq(params):
        counts = torch.zeros(6)
        for s in range(n):
            counts[sampler(logits, [params], [s], [0])[0]] += 1
        return counts / n

    t = 0.7
    want = torch.softmax(logits[0] / t, dim=0)
    got = freq(SamplingParams(temperature=t))
    # 4.5 standard errors per cell: fails by chance with probability ~1e-5
    assert ((got - want).abs() <= 4.5 * (want * (1 - want) / n).sqrt() + 1e-9).all(), (got, want)
    top2 = freq(SamplingParams(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0 and abs(top2[0] - 1 / (1 + math.exp(-1))) < 0.04
    nucleus = freq(SamplingParams(temperature=1.0, top_p=0.3))
    assert nucleus[0] == 1.0  # the most likely token alone holds more than 30 %


def test_same_seed_and_index_repeat_other_index_differs():
    logits = torch.zeros(1, 1000)  # uniform: the token is the noise's choice alone
    sampler, p = Sampler(), SamplingParams(temperature=1.0)
    a = [sampler(logits, [p], [3], [i])[0] for i in range(8)]
    assert a == [sampler(logits, [p], [3], [i])[0] for i in range(8)]
    assert len(set(a)) > 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature=-1"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(seed=-1), "seed=-1"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
    (dict(temperature="0.7"), "temperature='0.7'"),
    (dict(max_tokens=3.0), "max_tokens=3.0 must be an int"),
    (dict(max_tokens=True), "max_tokens=True must be an int"),
    (dict(top_p="1"), "top_p='1' must be a number"),
    (dict(ignore_eos="no"), "ignore_eos='no' must be True or False"),
    (dict(stop_token_ids=(1.5,)), r"stop_token_ids\[0\] is 1.5 \(float\); token ids must be ints"),
    (dict(stop_token_ids="2"), "stop_token_ids must be a list of token ids"),
    (dict(eos_token_ids=[-1]), r"eos_token_ids\[0\] is -1, outside the vocabulary"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_row_count_mismatch():
    with pytest.raises(ValueError, match="one params, seed and index per row"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [0], [0])


def test_token_ids_take_a_list_never_one_id():
    for name in ("eos_token_ids", "stop_token_ids"):  # one id is refused, not wrapped (issue 41)
        with pytest.raises(TypeError, match=f"{name} must be a list of token ids .ints., got int 5"):
            SamplingParams(**{name: 5})
    assert SamplingParams(eos_token_ids=[128001, 128009]).eos_token_ids == (128001, 128009)
    assert SamplingParams().eos_token_ids is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sample_keeps_the_tokens_on_the_device(device):
    """``Sampler.sample``: the tokens ``__call__`` returns, as an int64 tensor on the logits' device (greedy and
    sampled rows mixed, and every row sampled); ``SampledTokens`` brings them to the host."""
    from labkit.engine.sampling import SampledTokens

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(4)).to(device)
    for params in ([SamplingParams(), SamplingParams(temperature=0.8, top_k=7), SamplingParams(),
                    SamplingParams(temperature=1.2, top_p=0.7), SamplingParams()],
                   [SamplingParams(temperature=0.5)] * 5):
        args = (logits, params, [3, 1, 4, 1, 5], [0, 2, 7, 1, 8])
        tokens = Sampler().sample(*args)
        assert tokens.dtype == torch.int64 and tokens.device.type == device
        assert SampledTokens.start(tokens).tolist() == Sampler()(*args)
    assert Sampler().sample(logits[:0], [], [], []).tolist() == []
