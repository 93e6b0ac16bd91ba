"""Sampling: ``SamplingParams`` per request and a ``Sampler`` that turns a batch of logits into next tokens.

Greedy (``temperature == 0``) takes the argmax. Otherwise the logits are divided by the temperature, cut to the
``top_k`` largest and then to the smallest set whose probability reaches ``top_p`` (nucleus), and one token is
drawn with the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exponential(1)`` picks token ``i`` with
probability ``p_i`` (the Gumbel-max trick in another form, as nano-vllm samples).

Why the noise is seeded per token: the ``E_i`` of a request's ``n``-th output token come from a generator seeded
with ``(seed, n)`` alone, so what a request samples does not depend on which other requests share its batch, in
which row it sits, how often it was preempted, or what the scheduler did. Only the logits can differ with the batch
(float rounding of a different batch shape), never the random stream.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads (seed, index) pairs over the seed space


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one request (vLLM's names).

    * ``temperature``: 0 is greedy; > 0 samples from ``softmax(logits / temperature)``
    * ``top_k``: keep the ``k`` most likely tokens (0: all); ``top_p``: keep the smallest set reaching ``p``
    * ``max_tokens``: output tokens at most (the request ends earlier at a stop token)
    * ``stop_token_ids``: tokens that end the request (kept in the output); the model's EOS is one too unless
      ``ignore_eos``
    * ``seed``: the request's random stream (``None``: the engine derives one from its own seed and the request
      id, so a run is still reproducible)
    * ``eos_token_ids``: the end-of-sequence ids of this request (``None``: the engine's, which default to every
      EOS id of the model's config and its generation config, e.g. Llama 3 Instruct's 128001 and 128009)
    * ``num_speculative_tokens``: tokens proposed per step for this request when the engine speculates
      (``EngineConfig.speculative``): ``None`` the engine's ``num_speculative_tokens``, ``0`` plain decoding

    Every field is checked when built: a wrong type or a value out of range is a ``ValueError`` naming it.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 = no top-k cut)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1] (1 = no nucleus cut)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be None or an int >= 0")
        if self.num_speculative_tokens is not None and (not _is_int(self.num_speculative_tokens)
                                                        or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be None (the engine's) or "
                             "an int >= 0 (0: no speculation for this request)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        object.__setattr__(self, "stop_token_ids", token_id_tuple("stop_token_ids", self.stop_token_ids))
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", token_id_tuple("eos_token_ids", self.eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def token_id_tuple(arg: str, ids: int | Iterable[int]) -> tuple[int, ...]:
    """``ids`` (one id or several) as a tuple of ints >= 0; a ``ValueError`` naming ``arg`` for anything else
    (a float, a bool, a negative id, a string)."""
    if _is_int(ids):
        ids = (ids,)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{arg}={ids!r} must be an int or a sequence of ints >= 0")
    ids = tuple(ids)
    bad = [t for t in ids if not _is_int(t) or t < 0]
    if bad:
        raise ValueError(f"{arg}={ids!r}: {bad[0]!r} is not a token id; allowed: ints >= 0")
    return tuple(int(t) for t in ids)


def token_seed(seed: int, index: int) -> int:
    """The seed of the noise for output token ``index`` of a request with ``seed`` (a 63-bit mix of both)."""
    return ((seed * _MIX) ^ (index * 0xBF58476D1CE4E5B9 + 1)) % (1 << 63)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to ``-inf``) every logit outside each row's top-k, then outside its nucleus of mass ``top_p``.

    ``logits`` float32 ``[n, vocab]``; ``top_k`` int64 ``[n]`` (0 = off); ``top_p`` float32 ``[n]`` (1 = off).
    The most likely token always survives. Returns a new ``[n, vocab]`` tensor.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (so the first one always stays)
    outside = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler:
    """Next tokens for a batch of rows, each with its own ``SamplingParams``, seed and output index."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def noise(self, seed: int, index: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Exponential(1) noise ``[vocab]`` float32 for output token ``index`` of the request seeded ``seed``."""
        g = self._generator(device).manual_seed(token_seed(seed, index))
        return torch.empty(vocab, device=device, dtype=torch.float32).exponential_(generator=g)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                 indices: Sequence[int]) -> list[int]:
        """One token per row of ``logits`` (float ``[n, vocab]``); ``seeds[i]`` and ``indices[i]`` (the output
        position being sampled) name row ``i``'s noise. Returns ``n`` token ids."""
        n = logits.shape[0]
        if not len(params) == len(seeds) == len(indices) == n:
            raise ValueError(f"need one params, seed and index per row of logits ({n} rows), got "
                             f"{len(params)}, {len(seeds)}, {len(indices)}")
        if n == 0:
            return []
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            tokens[rows] = self._sample(logits[rows], [params[i] for i in rows], [seeds[i] for i in rows],
                                        [indices[i] for i in rows])
        return tokens.tolist()

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                indices: list[int]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], device=dev, dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
        logits = logits / temp[:, None]
        if any(p.top_k or p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.stack([self.noise(s, i, logits.shape[-1], dev) for s, i in zip(seeds, indices)])
        return (probs / noise).argmax(dim=-1)
