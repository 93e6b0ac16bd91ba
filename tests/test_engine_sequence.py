"""Sequence bookkeeping: stop tokens, EOS (and ignore_eos), max_tokens, metrics, bad requests."""

import pytest

from labkit.engine.sampling import SamplingParams
from labkit.engine.sequence import FinishReason, Request, Sequence, SequenceStatus


def test_finishes_at_stop_eos_or_length():
    seq = Sequence(Request(0, [5, 6, 7], SamplingParams(max_tokens=4, stop_token_ids=(99,))), seed=1, eos_token_id=2)
    assert seq.status is SequenceStatus.WAITING and seq.max_kv_tokens == 6
    assert not seq.append_token(10, 0.5)
    assert seq.append_token(2, 0.7) and seq.finish_reason is FinishReason.STOP  # EOS
    assert seq.token_ids == [5, 6, 7, 10, 2]
    m = seq.metrics()
    assert (m.first_token_s, m.finish_s, m.output_tokens, m.prompt_tokens) == (0.5, 0.7, 2, 3)
    with pytest.raises(RuntimeError, match="finished"):
        seq.append_token(3, 0.8)

    seq = Sequence(Request(1, [5], SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=(99,))), 1, 2)
    assert not seq.append_token(2, 0.1) and not seq.append_token(4, 0.2)
    assert seq.append_token(4, 0.3) and seq.finish_reason is FinishReason.LENGTH

    seq = Sequence(Request(2, [5], SamplingParams(max_tokens=9, stop_token_ids=(99,))), 1, None)
    assert seq.append_token(99, 0.1) and seq.finish_reason is FinishReason.STOP


def test_bad_requests():
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Request(0, [])
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        Request(0, [1], params={"max_tokens": 3})
    with pytest.raises(ValueError, match="no token yet"):
        Sequence(Request(0, [1]), 0).metrics()
