"""Sampling: ``SamplingParams`` per request and a ``Sampler`` that turns a batch of logits into next tokens.

Greedy (``temperature == 0``) takes the argmax. Otherwise the logits are divided by the temperature, cut to the
``top_k`` largest and then to the smallest set whose probability reaches ``top_p`` (nucleus), and one token is
drawn by inverting the row's cumulative distribution at one uniform ``u`` (``inverse_cdf``: the first token whose
cumulative probability exceeds ``u``). The whole batch is one ``cumsum`` and one ``searchsorted`` on the device; the
host computes only the ``n`` uniforms and sends them in one non-blocking copy. Speculative decoding's draft and
acceptance draw the same way (``labkit.engine.speculative``).

Why the uniform is a function of the token: the ``u`` of a request's ``n``-th output token is
``token_uniforms(seed, n)``, a hash of ``(seed, n)`` alone, so what a request samples does not depend on which
other requests share its batch, in which row it sits, how often it was preempted, or what the scheduler did. Only
the logits can differ with the batch (float rounding of a different batch shape), never the random stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from labkit.checks import check_bool, check_int, check_number, check_positive_int, check_token_ids
from labkit.device import host_to_device

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads (seed, index) pairs over the seed space
_SPLITMIX_1, _SPLITMIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's multipliers


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

    Every field is checked when built: a wrong type or a value out of range is a ``ValueError`` naming it (a
    single id is not a list of ids: ``stop_token_ids=5`` is refused, not wrapped).
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
        check_number("temperature", self.temperature, 0)  # 0: greedy
        check_int("top_k", self.top_k, 0)  # 0: no top-k cut
        check_number("top_p", self.top_p, 0, 1, low_open=True)  # 1: no nucleus cut
        check_positive_int("max_tokens", self.max_tokens)
        check_int("seed", self.seed, 0, none_ok=True)
        check_bool("ignore_eos", self.ignore_eos)
        if self.num_speculative_tokens is not None:  # None: the engine's; 0: no speculation for this request
            check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        object.__setattr__(self, "stop_token_ids", token_id_tuple("stop_token_ids", self.stop_token_ids))
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", token_id_tuple("eos_token_ids", self.eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def token_id_tuple(name: str, ids) -> tuple[int, ...]:
    """``ids`` (a list or tuple of ints >= 0, maybe empty; ``labkit.checks.check_token_ids``) as a tuple."""
    return tuple(check_token_ids(name, ids, allow_empty=True))


def token_seed(seed: int, index: int) -> int:
    """A 63-bit mix of ``seed`` and ``index``: the engine seeds request ``index`` from its own seed with it."""
    return ((seed * _MIX) ^ (index * _SPLITMIX_1 + 1)) % (1 << 63)


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


def token_uniforms(seeds: Sequence[int] | np.ndarray, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """The uniform in [0, 1) of output token ``indices[i]`` of the random stream ``seeds[i]``: float32 ``[n]``.

    Counter-based (SplitMix64's finaliser over a mix of seed and index, its top 24 bits): a draw depends on
    ``(seed, index)`` alone, whatever else is drawn, and a batch's draws are one vectorised numpy expression (64 rows
    in microseconds, where reseeding a generator per row cost about 7 us a row)."""
    s = np.asarray(seeds, dtype=np.uint64)
    i = np.asarray(indices, dtype=np.uint64)
    if s.shape != i.shape:
        raise ValueError(f"need one index per seed, got {s.shape} and {i.shape}")
    with np.errstate(over="ignore"):  # arithmetic mod 2**64 is the point
        x = (s * np.uint64(_MIX)) ^ (i * np.uint64(_SPLITMIX_1) + np.uint64(1))  # token_seed's mix, mod 2**64
        x ^= x >> np.uint64(30)
        x *= np.uint64(_SPLITMIX_1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_SPLITMIX_2)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (float ``[n, vocab]``, non-negative, any device; a row need not sum to 1), drawn
    by inverting the row's cumulative sum at ``uniforms[i]`` (float32 ``[n]`` in [0, 1), on ``probs``' device) times
    the row's total: token ``t`` has probability ``probs[i, t] / sum(probs[i])``, and one of probability 0 is never
    drawn. Returns int64 ``[n]`` on the device; the vocabulary-wide work never leaves it (the host only draws the
    ``n`` uniforms: ``token_uniforms``)."""
    if probs.dim() != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(f"need probs [n, vocab] and uniforms [n], got {tuple(probs.shape)} and "
                         f"{tuple(uniforms.shape)}")
    cdf = probs.float().cumsum(dim=-1)
    at = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, at, right=True).squeeze(-1)  # the first position whose cdf exceeds u * total
    # u * total rounding up to the total (or a row of zeros) finds no such position: take the row's likeliest token
    return torch.where(tokens < probs.shape[-1], tokens, probs.argmax(dim=-1))


class Sampler:
    """Next tokens for a batch of rows, each with its own ``SamplingParams``, seed and output index."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                 indices: Sequence[int]) -> list[int]:
        """One token per row of ``logits`` (float ``[n, vocab]``); ``seeds[i]`` and ``indices[i]`` (the output
        position being sampled) name row ``i``'s noise. Returns ``n`` token ids (``sample``, read on the host)."""
        return self.sample(logits, params, seeds, indices).tolist()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
               indices: Sequence[int]) -> torch.Tensor:
        """As ``__call__``, but the tokens stay on ``logits``' device: int64 ``[n]``. Nothing is read back to the
        host (no ``.item()`` / ``.tolist()``; the rows' parameters go to the device by non-blocking copies), so on
        CUDA the host returns as soon as the work is queued: what async scheduling needs."""
        n = logits.shape[0]
        if not len(params) == len(seeds) == len(indices) == n:
            raise ValueError(f"need one params, seed and index per row of logits ({n} rows), got "
                             f"{len(params)}, {len(seeds)}, {len(indices)}")
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) == n and n:
            tokens = self._sample(logits, params, seeds, indices)
        elif rows:
            idx = host_to_device(torch.tensor(rows), logits.device)
            tokens.index_copy_(0, idx, self._sample(logits.index_select(0, idx), [params[i] for i in rows],
                                                    [seeds[i] for i in rows], [indices[i] for i in rows]))
        return tokens

    def _sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                indices: Sequence[int]) -> torch.Tensor:
        dev = logits.device
        temp, top_k, top_p = (host_to_device(torch.tensor([getattr(p, f) for p in params], dtype=dtype), dev)
                              for f, dtype in (("temperature", torch.float32), ("top_k", torch.long),
                                               ("top_p", torch.float32)))
        logits = logits / temp[:, None]
        if any(p.top_k or p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        u = host_to_device(torch.from_numpy(token_uniforms(seeds, indices)), dev)
        return inverse_cdf(logits.softmax(dim=-1), u)


class SampledTokens:
    """One step's sampled tokens on their way to the host.

    * ``device``: int64 ``[k]``, the step's sampling rows in order, where they were sampled (the next step of async
      scheduling gathers its placeholder inputs from it)
    * ``host``: the same tokens in host memory, valid once ``event`` has completed: on CUDA pinned memory filled by a
      non-blocking copy, with a CUDA event recorded after it; on the CPU the tensor itself (torch's CPU ops are
      synchronous: it is ready at once, ``event`` is None)

    ``start`` begins the copy without waiting; ``tolist`` waits for it (the one place the host waits for the device
    in a step) and returns the ids.
    """

    def __init__(self, device: torch.Tensor, host: torch.Tensor, event=None):
        self.device, self.host, self.event = device, host, event

    @classmethod
    def start(cls, tokens: torch.Tensor) -> SampledTokens:
        """Start copying ``tokens`` (int64 ``[k]``) to the host."""
        if tokens.device.type != "cuda":
            return cls(tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(tokens, host, event)

    def __len__(self) -> int:
        return self.device.shape[0]

    def tolist(self) -> list[int]:
        """The token ids, once the copy is done (waits for it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
