"""Requests and sequences: what a user asks for (``Request``), the engine's running state of it (``Sequence``) and
what it gets back (``RequestOutput``).

A ``Sequence`` is the one owner of a request's state: its tokens (prompt + output so far, ``token_ids``), the
sampling parameters, its status and the times its tokens came out (stamped by the engine's clock: the one place
request timestamps are taken), and what the KV cache's block manager keeps on it
(``labkit.kvcache.KVSequence``): its ``block_table``, how many of its tokens have K/V written (``num_computed``,
advanced by the scheduler after each step) and the chained hashes of its computed full blocks. A sequence preempted
by recompute gives its blocks back and is prefilled again from ``token_ids`` when readmitted, so nothing it
generated is lost. Under async scheduling a sequence may hold one *pending* token (``append_pending``, ``resolve``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from labkit.checks import check_int, check_token_ids, check_type
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
    ERROR = "error"  # a step failed on it: ``RequestOutput.error`` says how; the other requests went on
    ABORT = "abort"  # ``LLMEngine.abort_request`` (or ``reset(abort=True)``) took it out


def prompt_token_list(prompt, vocab_size: int | None = None, request_id=None, name: str = "prompt") -> list[int]:
    """``prompt`` (a list, tuple, 1-D integer tensor or array of token ids) as a checked list of ints
    (``labkit.checks.check_token_ids``, ids in ``[0, vocab_size)``); an error names the request and ``name``."""
    return check_token_ids(f"request {request_id}: {name}" if request_id is not None else name, prompt, vocab_size)


@dataclass
class RequestMetrics:
    """A request's times, in seconds on the engine's clock (``LLMEngine.clock``): arrival, first and last token,
    every token; its time to first token (queueing plus prefill), time per output token after the first and
    end-to-end latency derive from them (``labkit.bench.serving`` summarises many)."""

    request_id: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """0 for a one-token output."""
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class Request:
    """One request: an id, prompt token ids, ``SamplingParams`` and its arrival time on the serving clock."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        check_int("request_id", self.request_id, 0)
        self.prompt_token_ids = prompt_token_list(self.prompt_token_ids, request_id=self.request_id,
                                                  name="prompt_token_ids")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"request {self.request_id}: params={self.params!r} must be a SamplingParams, got "
                            f"{type(self.params).__name__}")


class Sequence:
    """A request being served: its tokens, blocks and computed count (``labkit.kvcache.KVSequence``), status,
    preemptions and token times (seconds on the serving clock)."""

    def __init__(self, request: Request, seed: int, eos_token_ids: int | Iterable[int] | None = None):
        self.request = check_type("request", request, Request)
        self.seq_id = request.request_id
        self.params = request.params
        self.seed = check_int("seed", seed, 0)  # the request's own random stream (sampling.token_seed)
        self.token_ids: list[int] = list(request.prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(self.token_ids)
        self.block_table: list[int] = []  # its KV blocks (the block manager's; swap-space blocks while swapped out)
        self.num_computed = 0  # its first tokens whose K/V are written
        self.block_hashes: list[bytes] = []  # chained hashes of its computed full blocks (prefix caching)
        self.num_lookahead = 0  # slots reserved past its tokens for this step's speculative proposals (scheduler.py)
        stop = set(self.params.stop_token_ids)
        if self.params.eos_token_ids is not None:  # the request's own EOS ids replace the engine's
            eos_token_ids = self.params.eos_token_ids
        if isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        if eos_token_ids is not None and not self.params.ignore_eos:
            stop.update(eos_token_ids)  # every EOS id stops it (Llama 3 Instruct: <|end_of_text|> and <|eot_id|>)
        self.stop_token_ids = frozenset(stop)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None  # why a step failed on it (finish_reason ERROR)
        self.num_preemptions = 0
        self.token_times_s: list[float] = []
        self.num_pending = 0  # async scheduling: its last token is sampled but not read yet (0 or 1)

    # --- sizes ----------------------------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_kv_tokens(self) -> int:
        """KV slots it can ever need: the prompt and every output token but the last (never fed back)."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def reached_max_tokens(self) -> bool:
        """It holds ``max_tokens`` output tokens (the last maybe pending): nothing is left to compute for it (the
        scheduler skips it while its last token is read)."""
        return self.num_output_tokens >= self.params.max_tokens

    # --- progress -------------------------------------------------------------------------------------------
    def append_token(self, token: int, now_s: float) -> bool:
        """Add a generated token at time ``now_s``; returns True when the sequence is now finished (the caller
        frees its cache blocks)."""
        if self.is_finished:
            raise RuntimeError(f"sequence {self.seq_id} is finished; it takes no more tokens")
        if self.num_pending:
            raise RuntimeError(f"sequence {self.seq_id} has a pending token; resolve it first")
        self.token_ids.append(int(token))
        return self._stop_check(int(token), now_s)

    def append_pending(self, placeholder: int) -> None:
        """Async scheduling: a step in flight samples its next token; ``placeholder`` (< 0) holds its place until
        ``resolve``."""
        if self.is_finished or self.num_pending or placeholder >= 0:
            raise RuntimeError(f"sequence {self.seq_id}: cannot take placeholder {placeholder} ({self.status.value}, "
                               f"{self.num_pending} pending); one pending token at most, a negative placeholder")
        self.token_ids.append(placeholder)
        self.num_pending = 1

    def resolve(self, token: int, now_s: float) -> bool:
        """Async scheduling: the pending token's id ``token`` reached the host at ``now_s``; it replaces the
        placeholder and the stop conditions are checked as ``append_token`` checks them. Returns True when the
        sequence is now finished (the caller frees its blocks)."""
        if not self.num_pending:
            raise RuntimeError(f"sequence {self.seq_id} has no pending token to resolve")
        self.token_ids[-1] = int(token)
        self.num_pending = 0
        return self._stop_check(int(token), now_s)

    def _stop_check(self, token: int, now_s: float) -> bool:
        self.token_times_s.append(now_s)
        if token in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            self.status = SequenceStatus.FINISHED
        return self.is_finished

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """End it now with ``reason`` (ERROR with the message ``error``, or ABORT); the caller frees its blocks. A
        pending token (async scheduling) is dropped: the request ends with the tokens it streamed."""
        if self.num_pending:
            del self.token_ids[-1]
            self.num_pending = 0
        self.status, self.finish_reason, self.error = SequenceStatus.FINISHED, reason, error

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
    """What ``LLMEngine.generate`` returns per request. ``finish_reason`` 'stop', 'length', 'error' (``error``
    holds the message; ``output_token_ids`` what came out before) or 'abort'. ``metrics`` is ``None`` for a
    request that produced no token."""

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    num_preemptions: int
    metrics: RequestMetrics | None
    text: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """It ended normally (a stop token or its length), not by an error or an abort."""
        return self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)

    @classmethod
    def from_sequence(cls, seq: Sequence, tokenizer=None) -> RequestOutput:
        if seq.finish_reason is None:
            raise ValueError(f"sequence {seq.seq_id} is not finished ({seq.status.value})")
        text = tokenizer.decode(seq.output_token_ids) if tokenizer is not None else None
        return cls(seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.finish_reason.value,
                   seq.num_preemptions, seq.metrics() if seq.token_times_s else None, text, seq.error)


@dataclass(frozen=True)
class TokenOutput:
    """One streamed token: which request, the token, when, and whether the request is now finished."""

    request_id: int
    token_id: int
    time_s: float
    finished: bool
