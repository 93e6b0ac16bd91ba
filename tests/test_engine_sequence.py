"""Sequence bookkeeping: stop tokens, EOS (and ignore_eos), max_tokens, metrics, bad requests."""

import numpy as np
import pytest
import torch

from labkit.engine.sampling import SamplingParams
from labkit.engine.sequence import FinishReason, Request, RequestOutput, Sequence, SequenceStatus, prompt_token_list


def test_finishes_at_stop_eos_or_length():
    seq = Sequence(Request(0, [5, 6, 7], SamplingParams(max_tokens=4, stop_token_ids=(99,))), seed=1, eos_token_ids=2)
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
    with pytest.raises(ValueError, match="request 0: prompt_token_ids is empty"):
        Request(0, [])
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        Request(0, [1], params={"max_tokens": 3})
    with pytest.raises(ValueError, match="no token yet"):
        Sequence(Request(0, [1]), 0).metrics()
    with pytest.raises(TypeError, match=r"prompt_token_ids\[1\] is 2.5 \(float\)"):
        Request(0, [1, 2.5])  # was truncated to 2
    with pytest.raises(TypeError, match=r"prompt_token_ids\[0\] is True"):
        Request(0, [True])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is -5, outside the vocabulary; allowed: >= 0"):
        Request(0, [1, -5])
    with pytest.raises(TypeError, match="got str"):
        Request(0, "hello")


def test_prompt_token_list_checks_the_vocabulary_and_types():
    assert prompt_token_list(torch.tensor([3, 4]), 8) == [3, 4]
    assert prompt_token_list(np.array([3, 4], dtype=np.int32), 8) == [3, 4]
    assert prompt_token_list((np.int64(7),), 8) == [7]
    with pytest.raises(ValueError, match=r"request 3: prompt\[1\] is 8, outside the vocabulary; allowed: \[0, 8\)"):
        prompt_token_list([0, 8], 8, request_id=3)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        prompt_token_list(torch.tensor([1.0, 2.0]), 8)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        prompt_token_list(torch.tensor([[1, 2]]), 8)
    with pytest.raises(TypeError, match="got int"):
        prompt_token_list(5, 8)


def test_every_eos_id_stops_and_request_eos_overrides():
    for eos in (128001, 128009):  # Llama 3 Instruct: <|end_of_text|> and <|eot_id|>
        seq = Sequence(Request(0, [1], SamplingParams(max_tokens=9)), 0, eos_token_ids=[128001, 128009])
        assert not seq.append_token(5, 0.1) and seq.append_token(eos, 0.2) and seq.finish_reason is FinishReason.STOP
    seq = Sequence(Request(0, [1], SamplingParams(max_tokens=9, eos_token_ids=[7])), 0, eos_token_ids=[128001])
    assert seq.stop_token_ids == {7}


def test_finish_with_error_gives_an_output_without_metrics():
    seq = Sequence(Request(4, [1, 2]), 0)
    seq.finish(FinishReason.ERROR, "IndexError: boom")
    out = RequestOutput.from_sequence(seq)
    assert (out.finish_reason, out.error, out.metrics, out.ok) == ("error", "IndexError: boom", None, False)
    with pytest.raises(ValueError, match="not finished"):
        RequestOutput.from_sequence(Sequence(Request(5, [1]), 0))
