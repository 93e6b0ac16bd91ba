"""Proposers for speculative decoding: who guesses the next ``k`` tokens that the target then verifies.

``Proposer.propose(seq_ids, contexts, ks, temperature, generator)`` returns, per sequence, up to ``ks[i]`` token
ids and the distribution each was drawn from (``q``, float32 ``[n_i, vocab]``, or ``None`` where the proposal is
deterministic, i.e. ``q`` is one-hot on the proposed token). A proposer may propose fewer than asked (prompt
lookup finds no match): that sequence then takes a plain decode step in the same batch.

* ``PromptLookupProposer``: n-gram match of the context's last ``n`` tokens against the prompt and output so far
  (vLLM's ``ngram`` method); no model, no memory, free.
* ``DraftModelProposer``: a small ``labkit.model.CausalLM`` with the target's vocabulary, on its own
  ``PagedKVCache`` (a ``kvcache.SeqBlocks`` per sequence there); it runs ``k`` batched one-token steps per target
  step and rolls its sequence back to the accepted prefix next time (caught up lazily from the committed context).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from labkit.checks import check_positive_int
from labkit.kvcache import SeqBlocks
from labkit.model.attention import ModelInput
from labkit.model.model import CausalLM

Proposal = tuple[list[int], torch.Tensor | None]


def check_ks(ks: Sequence[int], n: int) -> None:
    if len(ks) != n or any(not isinstance(k, int) or k < 0 for k in ks):
        raise ValueError(f"ks={list(ks)!r} must hold {n} ints >= 0 (tokens to propose per sequence)")


class Proposer:
    """Interface: ``propose`` and ``release``. Stateless proposers need not override ``release``."""

    name = "proposer"

    def propose(self, seq_ids: Sequence[Hashable], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                temperature: float = 0.0, generator: torch.Generator | None = None) -> list[Proposal]:
        raise NotImplementedError

    def release(self, seq_id: Hashable) -> None:
        """Forget a finished sequence (free its draft cache)."""


class PromptLookupProposer(Proposer):
    """Propose the ``k`` tokens that followed the most recent earlier occurrence of the context's last ``n``
    tokens, trying ``n = max_ngram .. min_ngram`` (longest match first). Deterministic: ``q`` is ``None``."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not check_positive_int("min_ngram", min_ngram) <= check_positive_int("max_ngram", max_ngram):
            raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        ctx = list(context)
        if k == 0:
            return []
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # most recent match first
                if ctx[start:start + n] == tail:
                    return ctx[start + n:start + n + k]
        return []

    def propose(self, seq_ids, contexts, ks, temperature=0.0, generator=None) -> list[Proposal]:
        check_ks(ks, len(contexts))
        return [(self.lookup(c, k), None) for c, k in zip(contexts, ks)]


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """One token from float32 ``logits`` ``[vocab]``: argmax at temperature 0 (its ``q`` one-hot), else a draw from
    ``softmax(logits / temperature)``; returns ``(token, q [vocab])``."""
    if temperature == 0:
        tok = int(logits.argmax())
        q = torch.zeros_like(logits)
        q[tok] = 1.0
        return tok, q
    q = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(q, 1, generator=generator)), q


class DraftModelProposer(Proposer):
    """A small model with the target's vocabulary proposes ``k`` tokens autoregressively (greedy at temperature 0,
    else sampled at the target's temperature, its distributions returned as ``q``)."""

    name = "draft"

    def __init__(self, draft: CausalLM, num_blocks: int = 256, block_size: int = 16):
        self.draft = draft
        self.cache = draft.make_cache(num_blocks, block_size)
        self.seqs: dict[Hashable, SeqBlocks] = {}  # the draft's copy of each sequence, on its own cache

    def _catch_up(self, sid: Hashable, context: Sequence[int]) -> int:
        """Make the draft's sequence ``sid`` hold ``context``'s tokens, with slots; returns how many of them still
        need a forward (>= 1: the last one's logits are needed)."""
        seq = self.seqs.get(sid)
        same = 0
        if seq is not None:
            for a, b in zip(seq.token_ids, context):
                if a != b:
                    break
                same += 1
            same = min(same, len(context) - 1)  # recompute at least the last token
            if same == 0:
                self.release(sid)
        if same == 0:
            self.seqs[sid] = seq = SeqBlocks(list(context), sid)
            self.cache.allocate(seq)
            return len(context)
        self.cache.rollback(seq, same)  # what the target rejected goes
        seq.token_ids.extend(context[same:])
        self.cache.append_slots(seq)
        return len(context) - same

    @torch.inference_mode()
    def propose(self, seq_ids, contexts, ks, temperature=0.0, generator=None) -> list[Proposal]:
        check_ks(ks, len(contexts))
        out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in contexts]
        live = [i for i, k in enumerate(ks) if k > 0]
        query = {i: self._catch_up(seq_ids[i], contexts[i]) for i in live}
        for step in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if len(out[i][0]) < ks[i]]
            if not live:
                break
            seqs = [self.seqs[seq_ids[i]] for i in live]
            if step > 0:
                for i, seq in zip(live, seqs):
                    seq.token_ids.append(out[i][0][-1])
                    self.cache.append_slots(seq)
                    query[i] = 1
            logits = self.draft.forward_paged(ModelInput.build(self.cache, seqs, [query[i] for i in live]),
                                              self.cache)
            for row, (i, seq) in enumerate(zip(live, seqs)):
                self.cache.mark_computed(seq, seq.num_tokens)
                tok, q = sample(logits[row], temperature, generator)
                out[i][0].append(tok)
                out[i][1].append(q)
        return [(toks, torch.stack(qs) if qs and temperature > 0 else None) for toks, qs in out]

    def release(self, seq_id: Hashable) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and seq.block_table:
            self.cache.free(seq)

    @property
    def memory_bytes(self) -> int:
        """Bytes the draft adds: its weights plus its KV pool."""
        w = sum(p.numel() * p.element_size() for p in self.draft.parameters())
        kv = sum(t.numel() * t.element_size() for t in self.cache.k_caches + self.cache.v_caches)
        return w + kv
