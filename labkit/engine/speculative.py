"""Speculative decoding on ``labkit.model`` and the paged KV cache: propose ``k`` tokens cheaply, verify them with
one forward of the target, keep the longest accepted prefix plus one token of the target's own.

One step for a batch of sequences, each with its own ``k_i`` (``k_i = 0``, or a proposer that finds nothing,
is a plain decode step in the same batch):

1. each sequence (a ``kvcache.SeqBlocks``) holds its committed tokens, all with K/V in the cache except the last
   (``pending``);
2. the proposer gives ``d_1 .. d_k``; appended to the sequence (``append_slots`` reserves their slots), one target
   forward over the flat batch of ``1 + k_i`` query rows per sequence gives the target's logits after each of them
   (``ModelInput.build(..., all_logits=True)``: ``forward_paged`` returns every row's logits);
3. ``accept`` keeps ``d_1 .. d_n`` and draws one more token ``x`` (the correction, or the bonus when all ``k``
   were accepted): greedy, ``d_j`` is kept while it equals the target's argmax, so the output is plain greedy
   decoding's token for token; sampled, by the rejection rule of Leviathan et al. (2023) / Chen et al. (2023):
   keep ``d_j`` with probability ``min(1, p(d_j) / q(d_j))``, on the first rejection draw ``x`` from
   ``max(0, p - q)`` renormalised, which makes every emitted token follow the target's distribution ``p``;
4. ``cache.rollback`` cuts the sequence back to ``pending, d_1 .. d_n`` (the rejected tokens, their slots and any
   block past them return to the allocator) and ``x`` becomes the new ``pending``.

Scope: this is a driver of its own over ``PagedKVCache`` (``SpeculativeDecoder.generate``), batched over a fixed
set of sequences with per-sequence ``k``; it does not plug into ``LLMEngine``'s scheduler (no admission,
preemption or prefix caching while speculating) and runs eagerly (no CUDA graphs: the verify width varies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from labkit.engine.proposers import Proposer, check_ks, sample
from labkit.kvcache import PagedKVCache, SeqBlocks
from labkit.model.attention import ModelInput
from labkit.model.model import CausalLM


def accept(p: torch.Tensor, proposal: Sequence[int], q: torch.Tensor | None, temperature: float,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """``(n_accepted, next_token)`` for one sequence.

    ``p``: float32 target logits ``[k + 1, vocab]`` (row ``j`` predicts the token after ``d_j``; row 0 after
    ``pending``); ``proposal``: ``k`` token ids; ``q``: float32 draft probabilities ``[k, vocab]`` or ``None``
    (deterministic proposals: ``q`` one-hot on ``d_j``). At ``temperature`` 0 the rule is argmax equality."""
    k = len(proposal)
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [k + 1 = {k + 1}, vocab], got {tuple(p.shape)}")
    if temperature == 0:
        best = p.argmax(dim=-1).tolist()
        n = 0
        while n < k and proposal[n] == best[n]:
            n += 1
        return n, best[n]
    probs = torch.softmax(p / temperature, dim=-1)
    for j, d in enumerate(proposal):
        qd = 1.0 if q is None else float(q[j, d])
        pd = float(probs[j, d])
        u = float(torch.rand((), generator=generator))
        if u * qd < pd:  # accept with probability min(1, p/q)
            continue
        if q is None:
            residual = probs[j].clone()
            residual[d] = 0.0
        else:
            residual = (probs[j] - q[j]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q exactly: a rejection has probability 0; guard against rounding
            residual, total = probs[j], 1.0
        return j, int(torch.multinomial(residual / total, 1, generator=generator))
    return k, int(torch.multinomial(probs[k], 1, generator=generator))


@dataclass
class SpecStats:
    """Counts over a run: target steps, tokens proposed / accepted / emitted per sequence-step summed."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (the per-token α of the notebook's model, when proposals are full-k)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class SpeculativeDecoder:
    """Generate with ``target`` over its own ``PagedKVCache``, verifying a ``proposer``'s guesses.

    ``proposer=None`` (or ``k=0``) is plain decoding by the same code: the baseline the speedup is measured
    against. ``k``: an int for every sequence or a list (one per prompt)."""

    def __init__(self, target: CausalLM, proposer: Proposer | None = None, k: int | Sequence[int] = 4,
                 num_blocks: int = 256, block_size: int = 16):
        self.target, self.proposer, self.k = target, proposer, k
        self.cache: PagedKVCache = target.make_cache(num_blocks, block_size)
        self.stats = SpecStats()

    @torch.inference_mode()
    def verify(self, seqs: Sequence[SeqBlocks], proposals: Sequence[list[int]]) -> list[torch.Tensor]:
        """Append each proposal to its sequence (whose last token, the pending one, has no K/V yet) and run one
        target forward over the pending token and the proposal of every sequence; returns float32 logits ``[1 +
        k_i, vocab]`` per sequence."""
        for seq, prop in zip(seqs, proposals):
            seq.token_ids.extend(prop)
            self.cache.append_slots(seq)
        lens = [1 + len(p) for p in proposals]
        inp = ModelInput.build(self.cache, seqs, lens, all_logits=True)
        return list(self.target.forward_paged(inp, self.cache).split(lens))

    @torch.inference_mode()
    def prefill(self, seqs: Sequence[SeqBlocks]) -> torch.Tensor:
        """Blocks for each sequence's prompt and one forward over all of them: logits ``[num_seqs, vocab]``."""
        for seq in seqs:
            self.cache.allocate(seq)
        logits = self.target.forward_paged(ModelInput.build(self.cache, seqs, [s.num_tokens for s in seqs]),
                                           self.cache)
        for seq in seqs:
            self.cache.mark_computed(seq, seq.num_tokens)
        return logits

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None, eos_token_id: int | None = None) -> list[list[int]]:
        """New tokens per prompt (at most ``max_new_tokens``, ending at ``eos_token_id`` if given). All cache
        blocks are freed when it returns."""
        if not prompts or any(len(p) < 1 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
        ks = [self.k] * len(prompts) if isinstance(self.k, int) else list(self.k)
        check_ks(ks, len(prompts))
        if self.proposer is None:
            ks = [0] * len(prompts)
        seqs = [SeqBlocks(list(p), seq_id=i) for i, p in enumerate(prompts)]
        try:
            logits = self.prefill(seqs)
            for i, seq in enumerate(seqs):  # the pending token: emitted, its K/V computed by the next step
                seq.token_ids.append(sample(logits[i], temperature, generator)[0])
            live = [i for i in range(len(seqs)) if not self._done(seqs[i], len(prompts[i]), max_new_tokens,
                                                                  eos_token_id)]
            while live:
                self._step(seqs, live, prompts, ks, max_new_tokens, temperature, generator)
                live = [i for i in live if not self._done(seqs[i], len(prompts[i]), max_new_tokens, eos_token_id)]
        finally:
            for seq in seqs:
                if seq.block_table:
                    self.cache.free(seq)
                if self.proposer is not None:
                    self.proposer.release(seq.seq_id)
        out = [seq.token_ids[len(p):] for seq, p in zip(seqs, prompts)]
        if eos_token_id is not None:
            out = [o[:o.index(eos_token_id) + 1] if eos_token_id in o else o for o in out]
        return [o[:max_new_tokens] for o in out]

    @staticmethod
    def _done(seq: SeqBlocks, num_prompt: int, max_new: int, eos: int | None) -> bool:
        return seq.num_tokens - num_prompt >= max_new or (eos is not None and eos in seq.token_ids[num_prompt:])

    def _step(self, seqs, live, prompts, ks, max_new, temperature, generator) -> None:
        # Never propose past the token budget: the last emitted token is always the target's own.
        want = [min(ks[i], max_new - (seqs[i].num_tokens - len(prompts[i])) - 1) for i in live]
        if self.proposer is not None and any(want):
            contexts = [list(seqs[i].token_ids) for i in live]
            proposals = self.proposer.propose(live, contexts, want, temperature, generator)
        else:
            proposals = [([], None) for _ in live]
        committed = [seqs[i].num_tokens for i in live]  # the pending token included
        logits = self.verify([seqs[i] for i in live], [p for p, _ in proposals])
        for row, i in enumerate(live):
            prop, q = proposals[row]
            n, x = accept(logits[row], prop, q, temperature, generator)
            self.cache.rollback(seqs[i], committed[row] + n)  # the rejected proposals go, with their slots
            self.cache.mark_computed(seqs[i], committed[row] + n)
            seqs[i].token_ids.append(x)
            self.stats.steps += 1
            self.stats.proposed += len(prop)
            self.stats.accepted += n
            self.stats.emitted += n + 1
            self.stats.accepted_per_step.append(n)
