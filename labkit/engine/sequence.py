"""Requests and sequences: what a user asks for (``Request``), the engine's running state of it (``Sequence``) and
what it gets back (``RequestOutput``).

A ``Sequence`` holds the tokens (prompt + output so far), the sampling parameters, its status and the times its
tokens came out. Which of its tokens have K/V in the cache is the cache's business (``PagedKVCache.seq(id)``:
``num_tokens`` slots reserved, ``num_computed`` written); a preempted sequence leaves the cache and is prefilled
again from ``token_ids`` (prompt + output) when readmitted, so nothing it generated is lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from labkit.engine.metrics import RequestMetrics
from labkit.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: waiting (holds no blocks), running (holds blocks), finished."""

    WAITING = "waiting"  # queued, or preempted and queued again; holds no cache blocks
    RUNNING = "running"  # admitted: holds cache blocks
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a sequence finished."""

    STOP = "stop"  # a stop token (or EOS) came out
    LENGTH = "length"  # max_tokens reached


@dataclass
class Request:
    """One request: an id, prompt token ids, ``SamplingParams`` and its arrival time on the serving clock."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) < 1:
            raise ValueError(f"request {self.request_id}: prompt_token_ids is empty; a prompt needs >= 1 token")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"request {self.request_id}: params must be SamplingParams, got "
                            f"{type(self.params).__name__}")
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]


class Sequence:
    """A request being served: its tokens, status, preemptions and token times (seconds on the serving clock)."""

    def __init__(self, request: Request, seed: int, eos_token_id: int | None = None):
        self.request = request
        self.seq_id = request.request_id
        self.params = request.params
        self.seed = seed  # the request's own random stream (sampling.token_seed)
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        stop = set(self.params.stop_token_ids)
        if eos_token_id is not None and not self.params.ignore_eos:
            stop.add(eos_token_id)
        self.stop_token_ids = frozenset(stop)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.token_times_s: list[float] = []

    # --- sizes ----------------------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_kv_tokens(self) -> int:
        """KV slots it can ever need: the prompt and every output token but the last (never fed back)."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # --- progress -------------------------------------------------------------------------------------------
    def append_token(self, token: int, now_s: float) -> bool:
        """Add a generated token at time ``now_s``; returns True when the sequence is now finished (the caller
        frees its cache blocks)."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.seq_id} is finished; it takes no more tokens")
        self.output_token_ids.append(int(token))
        self.token_times_s.append(now_s)
        if token in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            self.status = SequenceStatus.FINISHED
        return self.is_finished

    def metrics(self) -> RequestMetrics:
        """Its ``RequestMetrics`` (TTFT, TPOT, end-to-end) on the serving clock; needs at least one token."""
        if not self.token_times_s:
            raise ValueError(f"sequence {self.seq_id} has produced no token yet")
        return RequestMetrics(self.seq_id, self.request.arrival_s, self.token_times_s[0], self.token_times_s[-1],
                              self.num_prompt_tokens, self.num_output_tokens, list(self.token_times_s))

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}/{self.params.max_tokens}, preempted={self.num_preemptions})")


@dataclass
class RequestOutput:
    """What ``LLMEngine.generate`` returns per request."""

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    num_preemptions: int
    metrics: RequestMetrics
    text: str | None = None

    @classmethod
    def from_sequence(cls, seq: Sequence, tokenizer=None) -> RequestOutput:
        text = tokenizer.decode(seq.output_token_ids) if tokenizer is not None else None
        return cls(seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.finish_reason.value,
                   seq.num_preemptions, seq.metrics(), text)


@dataclass(frozen=True)
class TokenOutput:
    """One streamed token: which request, the token, when, and whether the request is now finished."""

    request_id: int
    token_id: int
    time_s: float
    finished: bool
