"""Workloads: who asks for what, and when. The same seed always gives the same workload.

A workload is a list of ``RequestSpec``: arrival time (Poisson arrivals at ``rate`` requests/s, or all at t=0 for
an offline batch), prompt token ids and the number of tokens to generate. Lengths come from a ``LengthDist``; the
serving recipe of the engine issue is ``LengthDist.fixed(512)`` prompts with ``LengthDist.exponential(128)``
outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

KINDS = ("fixed", "uniform", "exponential", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, clipped to ``[low, high]`` (clipping is part of the distribution).

    ``fixed``: always ``mean``. ``uniform``: integers in ``[low, high]``. ``exponential``: mean ``mean``, the
    classic heavy-ish tail of chat outputs. ``lognormal``: median ``mean`` and shape ``sigma``, heavier tailed.
    """

    kind: str
    mean: float
    low: int = 1
    high: int | None = None
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is unknown; allowed: {list(KINDS)}")
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise ValueError(f"need 1 <= low <= high, got low={self.low}, high={self.high}")
        if self.mean <= 0:
            raise ValueError(f"mean={self.mean} must be positive")

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls("fixed", float(n), low=n, high=n)

    @classmethod
    def uniform(cls, low: int, high: int) -> LengthDist:
        return cls("uniform", (low + high) / 2, low=low, high=high)

    @classmethod
    def exponential(cls, mean: float, low: int = 1, high: int | None = None) -> LengthDist:
        return cls("exponential", mean, low=low, high=high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, low: int = 1, high: int | None = None) -> LengthDist:
        return cls("lognormal", median, low=low, high=high, sigma=sigma)

    def sample(self, n: int, gen: torch.Generator) -> list[int]:
        """``n`` integer lengths drawn with ``gen``."""
        if self.kind == "fixed":
            x = torch.full((n,), self.mean, dtype=torch.float64)
        elif self.kind == "uniform":
            x = torch.randint(self.low, self.high + 1, (n,), generator=gen).double()
        elif self.kind == "exponential":
            x = -self.mean * torch.log1p(-torch.rand(n, generator=gen, dtype=torch.float64))
        else:
            x = self.mean * torch.exp(self.sigma * torch.randn(n, generator=gen, dtype=torch.float64))
        x = x.round().clamp(min=self.low, max=self.high if self.high is not None else math.inf)
        return [int(v) for v in x]

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {int(self.mean)}"
        if self.kind == "uniform":
            return f"uniform [{self.low}, {self.high}]"
        body = f"mean {self.mean:g}" if self.kind == "exponential" else f"median {self.mean:g}, sigma {self.sigma:g}"
        return f"{self.kind} ({body}, clipped to [{self.low}, {self.high if self.high else 'inf'}])"


@dataclass(frozen=True)
class RequestSpec:
    """One request: when it arrives (seconds from the start), its prompt, and how many tokens it wants."""

    request_id: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def poisson_arrivals(n: int, rate: float, gen: torch.Generator) -> list[float]:
    """Arrival times of ``n`` requests of a Poisson process of ``rate`` per second (``inf``: all at 0)."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be positive (math.inf for an offline batch)")
    if math.isinf(rate):
        return [0.0] * n
    gaps = -torch.log1p(-torch.rand(n, generator=gen, dtype=torch.float64)) / rate
    return torch.cumsum(gaps, 0).tolist()


def _prompt_tokens(source, length: int, gen: torch.Generator) -> tuple[int, ...]:
    """A prompt of ``length`` tokens: a random window of a token stream, or random ids below a vocab size."""
    if isinstance(source, int):
        return tuple(torch.randint(3, source, (length,), generator=gen).tolist())
    if length >= len(source):
        raise ValueError(f"prompt length {length} does not fit in a token stream of {len(source)} tokens")
    start = int(torch.randint(0, len(source) - length, (1,), generator=gen))
    return tuple(source[start:start + length].tolist())


def make_workload(n: int, rate: float, prompt_len: LengthDist, output_len: LengthDist, source,
                  seed: int = 0) -> list[RequestSpec]:
    """``n`` requests with Poisson arrivals at ``rate``/s and lengths from the two distributions.

    ``source`` gives prompt tokens: a 1-D token tensor (windows of real text, e.g. ``split_tokens('heldout',
    tok)``) or an int vocabulary size (random ids, for random-weight models). Lengths and prompts depend on the
    seed only, not on ``rate``: the same seed at another rate is the same requests arriving faster.
    """
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    g_len = torch.Generator().manual_seed(seed)
    plens, olens = prompt_len.sample(n, g_len), output_len.sample(n, g_len)
    g_tok = torch.Generator().manual_seed(seed + 1)
    prompts = [_prompt_tokens(source, p, g_tok) for p in plens]
    arrivals = poisson_arrivals(n, rate, torch.Generator().manual_seed(seed + 2))
    return [RequestSpec(i, a, p, o) for i, (a, p, o) in enumerate(zip(arrivals, prompts, olens))]


def at_rate(workload: list[RequestSpec], rate: float, seed: int = 0) -> list[RequestSpec]:
    """The same requests with fresh Poisson arrivals at ``rate`` (prompts and lengths unchanged)."""
    arrivals = poisson_arrivals(len(workload), rate, torch.Generator().manual_seed(seed + 2))
    return [replace(r, arrival_s=a) for r, a in zip(workload, arrivals)]
