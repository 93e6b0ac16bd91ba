"""Proposers for speculative decoding: who guesses the next ``k`` tokens that the target then verifies.

``Proposer.propose(seq_ids, contexts, ks, temperatures, generators)`` returns, per sequence, up to ``ks[i]`` token ids
and the distribution each was drawn from (``q``, float32 ``[n_i, vocab]`` on the CPU, or ``None`` where the proposal
is deterministic, i.e. ``q`` is one-hot on the proposed token). A proposer may propose fewer than asked (prompt
lookup finds no match, the draft's cache is full): that sequence then takes a plain decode step in the same batch.
``release(seq_id)`` forgets a sequence (the engine's scheduler calls it whenever the sequence's blocks are taken
back: it finished, was aborted, failed or was preempted).

* ``PromptLookupProposer``: n-gram match of the context's last ``n`` tokens against the prompt and output so far
  (vLLM's ``ngram`` method, its ``prompt_lookup_max`` / ``prompt_lookup_min``); no model, no memory, free.
* ``DraftModelProposer``: a small ``labkit.model.CausalLM`` (or an HF Llama-family model, adopted) with the target's
  vocabulary, on its own ``PagedKVCache`` (a ``kvcache.SeqBlocks`` per sequence there); it runs ``k`` batched
  one-token steps per target step and rolls its sequence back to the accepted prefix next time (caught up lazily
  from the committed context: after a preemption it prefills the whole context again).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from labkit.checks import check_int, check_positive_int
from labkit.kvcache import CacheFullError, SeqBlocks
from labkit.model import adopt_hf_model
from labkit.model.attention import ModelInput

Proposal = tuple[list[int], torch.Tensor | None]


def check_ks(ks: Sequence[int], n: int) -> None:
    if len(ks) != n or any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in ks):
        raise ValueError(f"ks={list(ks)!r} must hold {n} ints >= 0 (tokens to propose per sequence)")


class Proposer:
    """Interface: ``propose`` and ``release``. Stateless proposers need not override ``release``."""

    name = "proposer"

    def propose(self, seq_ids: Sequence[Hashable], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                temperatures: Sequence[float] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> list[Proposal]:
        """Up to ``ks[i]`` tokens after ``contexts[i]`` for each sequence, and their ``q`` (module docstring);
        ``temperatures[i]`` (default 0: greedy) and ``generators[i]`` (CPU generators) for a proposer that samples."""
        raise NotImplementedError

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence whose blocks the scheduler took back (free its draft cache)."""


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

    def propose(self, seq_ids, contexts, ks, temperatures=None, generators=None) -> list[Proposal]:
        check_ks(ks, len(contexts))
        return [(self.lookup(c, k), None) for c, k in zip(contexts, ks)]


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """One token from float32 ``logits`` ``[vocab]``: argmax at temperature 0 (its ``q`` one-hot), else a draw from
    ``softmax(logits / temperature)`` with ``generator`` (a CPU generator; the draw is made on the CPU); returns
    ``(token, q [vocab])`` with ``q`` on the CPU."""
    logits = logits.float().cpu()
    if temperature == 0:
        tok = int(logits.argmax())
        q = torch.zeros_like(logits)
        q[tok] = 1.0
        return tok, q
    q = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(q, 1, generator=generator)), q


class DraftModelProposer(Proposer):
    """A small model with the target's vocabulary proposes ``k`` tokens autoregressively (greedy at temperature 0,
    else sampled at the request's temperature, its distributions returned as ``q``), on a cache of its own of
    ``num_blocks`` blocks of ``block_size`` tokens. A sequence the cache cannot hold proposes nothing this step (a
    plain decode step), never an error."""

    name = "draft"

    def __init__(self, draft, num_blocks: int = 256, block_size: int = 16):
        check_int("num_blocks", num_blocks, 2)
        check_positive_int("block_size", block_size)
        self.draft = adopt_hf_model(draft)
        self.cache = self.draft.make_cache(num_blocks, block_size)
        self.seqs: dict[Hashable, SeqBlocks] = {}  # the draft's copy of each sequence, on its own cache

    def _catch_up(self, sid: Hashable, context: Sequence[int]) -> int:
        """Make the draft's sequence ``sid`` hold ``context``'s tokens, with slots; returns how many of them still
        need a forward (>= 1: the last one's logits are needed). ``CacheFullError`` when its cache is full (the
        sequence is then released)."""
        seq = self.seqs.get(sid)
        same = 0
        if seq is not None:
            for a, b in zip(seq.token_ids, context):
                if a != b:
                    break
                same += 1
            same = min(same, len(context) - 1, seq.num_computed)  # recompute at least the last token
            if same == 0:
                self.release(sid)
        try:
            if same == 0:
                self.seqs[sid] = seq = SeqBlocks(list(context), sid)
                self.cache.allocate(seq)
                return len(context)
            self.cache.rollback(seq, same)  # what the target rejected goes
            seq.token_ids.extend(context[same:])
            self.cache.append_slots(seq)
            return len(context) - same
        except CacheFullError:
            self.release(sid)
            raise

    @torch.inference_mode()
    def propose(self, seq_ids, contexts, ks, temperatures=None, generators=None) -> list[Proposal]:
        check_ks(ks, len(contexts))
        temps = [0.0] * len(ks) if temperatures is None else list(temperatures)
        gens = [None] * len(ks) if generators is None else list(generators)
        out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in contexts]
        query = {}
        for i, k in enumerate(ks):
            if k > 0:
                try:
                    query[i] = self._catch_up(seq_ids[i], contexts[i])
                except CacheFullError:
                    continue  # this one decodes plainly this step
        live = list(query)
        for step in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if len(out[i][0]) < ks[i]]
            if step > 0:
                for i in list(live):
                    seq = self.seqs[seq_ids[i]]
                    seq.token_ids.append(out[i][0][-1])
                    try:
                        self.cache.append_slots(seq)
                        query[i] = 1
                    except CacheFullError:  # keep what it proposed so far
                        seq.token_ids.pop()
                        live.remove(i)
            if not live:
                break
            seqs = [self.seqs[seq_ids[i]] for i in live]
            logits = self.draft.forward_paged(ModelInput.build(self.cache, seqs, [query[i] for i in live]),
                                              self.cache)
            for row, (i, seq) in enumerate(zip(live, seqs)):
                self.cache.mark_computed(seq, seq.num_tokens)
                tok, q = sample(logits[row], temps[i], gens[i])
                out[i][0].append(tok)
                out[i][1].append(q)
        return [(toks, torch.stack(qs) if qs and temps[i] > 0 else None) for i, (toks, qs) in enumerate(out)]

    def release(self, seq_id: Hashable) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and seq.block_table:
            self.cache.free(seq)
