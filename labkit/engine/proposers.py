"""Proposers for speculative decoding: who guesses the next ``k`` tokens that the target then verifies.

``Proposer.propose(seq_ids, contexts, ks, temperatures, streams)`` returns, per sequence, up to ``ks[i]`` token ids
and the distribution each was drawn from (``q``, float32 ``[n_i, vocab]`` on the device, or ``None`` where the proposal
is deterministic, i.e. ``q`` is one-hot on the proposed token). A proposer may propose fewer than asked (prompt
lookup finds no match, the draft's cache is full): that sequence then takes a plain decode step in the same batch.
``release(seq_id)`` forgets a sequence (the engine's scheduler calls it whenever the sequence's blocks are taken
back: it finished, was aborted, failed or was preempted).

* ``PromptLookupProposer``: n-gram match of the context's last ``n`` tokens against the prompt and output so far
  (vLLM's ``ngram`` method, its ``prompt_lookup_max`` / ``prompt_lookup_min``); no model, only each running
  sequence's tokens kept to match against (``NgramMatcher``, 8 bytes a token).
* ``DraftModelProposer``: a small ``labkit.model.CausalLM`` (or an HF Llama-family model, adopted) with the target's
  vocabulary, on its own ``PagedKVCache`` (a ``kvcache.SeqBlocks`` per sequence there), run by a ``ModelRunner`` of
  its own (so its one-token steps replay CUDA graphs on CUDA); it runs ``k`` batched steps per target step (the
  first catches up, the others are one-token decodes) and rolls its sequence back to the accepted prefix next time
  (caught up lazily from the committed context: after a preemption it prefills the whole context again). Each step
  draws its rows batched on the device (``draw_rows``: an argmax, or an inverse-CDF draw at the sequence's
  ``token_uniforms``) and feeds them to the next step there; the host reads every token once, after the last step, and
  the sampled rows' ``q`` never leave the device.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from labkit.checks import check_int, check_positive_int
from labkit.device import host_to_device
from labkit.engine.cuda_graph import default_graph_token_sizes
from labkit.engine.model_runner import ModelRunner
from labkit.engine.sampling import inverse_cdf, token_uniforms
from labkit.kvcache import CacheFullError, SeqBlocks
from labkit.model import adopt_hf_model
from labkit.model.attention import placeholder

Proposal = tuple[list[int], torch.Tensor | None]


def check_ks(ks: Sequence[int], n: int) -> None:
    if len(ks) != n or any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in ks):
        raise ValueError(f"ks={list(ks)!r} must hold {n} ints >= 0 (tokens to propose per sequence)")


class Proposer:
    """Interface: ``propose`` and ``release``. Stateless proposers need not override ``release``."""

    name = "proposer"

    def propose(self, seq_ids: Sequence[Hashable], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                temperatures: Sequence[float] | None = None,
                streams: Sequence[tuple[int, int]] | None = None) -> list[Proposal]:
        """Up to ``ks[i]`` tokens after ``contexts[i]`` for each sequence, and their ``q`` (module docstring);
        ``temperatures[i]`` (default 0: greedy) and ``streams[i] = (seed, index)`` for a proposer that samples: its
        draw at step ``j`` is at ``sampling.token_uniforms(seed, index + j)``."""
        raise NotImplementedError

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence whose blocks the scheduler took back (free its draft cache)."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens lists ``a`` and ``b`` share. A proposer's copy of a sequence differs from the engine's
    at the tail (rejected proposals, new tokens), so the lists are compared whole in C first and, where they differ,
    position by position only over the last 64 shared positions when the rest is equal (a Python loop over a long
    context every step would cost more than the step)."""
    common = min(len(a), len(b))
    if a[:common] == b[:common]:
        return common
    lo = max(0, common - 64)
    if a[:lo] != b[:lo]:
        lo = 0
    return next(i for i in range(lo, common) if a[i] != b[i])


class NgramMatcher:
    """One sequence's tokens, kept for prompt lookup as they grow and are rolled back: a Python list and the same
    tokens in a numpy array (8 bytes a token), so that a proposal is one vectorised comparison over the context
    (where the last token occurred before) and a check of the few hits, not a Python scan of every position
    (at batch 16 and 500-token contexts the scan was 5x the rest of a step's host work).

    ``sync(context)`` makes the held tokens ``context`` (it extends them, or shares a prefix with them: the rest is
    replaced); ``propose(k)``: the ``k`` tokens that followed the most recent earlier occurrence of the last ``n``
    tokens, ``n = max_ngram .. min_ngram`` (longest match first)."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.array = np.empty(256, dtype=np.int64)

    def sync(self, context: Sequence[int]) -> None:
        ctx, toks = (context if isinstance(context, list) else list(context)), self.tokens
        common = common_prefix_len(ctx, toks)
        new = ctx[common:]
        del toks[common:]
        toks.extend(new)
        if len(toks) > len(self.array):
            grown = np.empty(max(2 * len(self.array), len(toks)), dtype=np.int64)
            grown[:common] = self.array[:common]
            self.array = grown
        self.array[common:len(toks)] = new

    def propose(self, k: int) -> list[int]:
        n_tok = len(self.tokens)
        if k == 0 or n_tok < 2:
            return []
        a = self.array[:n_tok]
        hits = np.flatnonzero(a[:-1] == a[-1])  # earlier positions p holding the last token: p + 1 follows
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            p = hits[hits >= n - 1]
            for j in range(1, n):  # the n-gram ending at p equals the last n tokens
                p = p[a[p - j] == a[n_tok - 1 - j]]
            if p.size:
                s = int(p[-1]) + 1
                return self.tokens[s:s + k]
        return []


class PromptLookupProposer(Proposer):
    """Propose the ``k`` tokens that followed the most recent earlier occurrence of the context's last ``n``
    tokens, trying ``n = max_ngram .. min_ngram`` (longest match first). Deterministic: ``q`` is ``None``. Keeps an
    ``NgramMatcher`` per sequence (forgotten by ``release``)."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not check_positive_int("min_ngram", min_ngram) <= check_positive_int("max_ngram", max_ngram):
            raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.matchers: dict[Hashable, NgramMatcher] = {}

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """The proposal for ``context`` alone (a matcher made for it and dropped)."""
        matcher = NgramMatcher(self.max_ngram, self.min_ngram)
        matcher.sync(context)
        return matcher.propose(k)

    def propose(self, seq_ids, contexts, ks, temperatures=None, streams=None) -> list[Proposal]:
        check_ks(ks, len(contexts))
        out = []
        for sid, c, k in zip(seq_ids, contexts, ks):
            matcher = self.matchers.get(sid)
            if matcher is None:
                matcher = self.matchers[sid] = NgramMatcher(self.max_ngram, self.min_ngram)
            matcher.sync(c)
            out.append((matcher.propose(k), None))
        return out

    def release(self, seq_id: Hashable) -> None:
        self.matchers.pop(seq_id, None)


def draw_rows(logits: torch.Tensor, temperatures: Sequence[float],
              uniforms: Sequence[float] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of float ``logits`` ``[n, vocab]``, batched and on ``logits``' device: the argmax of a row at
    temperature 0; for the others, the draw of ``softmax(logits / temperature)`` at ``uniforms[r]`` (``inverse_cdf``;
    a greedy row's uniform is not used). The host sends the sampled rows' temperatures and uniforms in one
    non-blocking copy each.

    Returns ``tokens`` int64 ``[n]`` and ``q``, the sampled rows' distributions (float32 ``[n_sampled, vocab]``, in
    row order), or ``None`` when every row is greedy; both stay on the device (nothing is read back)."""
    temps = list(temperatures)
    if len(temps) != logits.shape[0] or len(uniforms) != len(temps):
        raise ValueError(f"need one temperature and one uniform per row of logits {tuple(logits.shape)}, got "
                         f"{len(temps)} and {len(uniforms)}")
    drawn = [r for r, t in enumerate(temps) if t != 0]
    if not drawn:
        return logits.argmax(dim=-1), None
    dev = logits.device
    every = len(drawn) == len(temps)
    idx = None if every else host_to_device(torch.tensor(drawn), dev)
    rows = logits if every else logits.index_select(0, idx)
    t, u = host_to_device(torch.tensor([[temps[r] for r in drawn], [float(uniforms[r]) for r in drawn]],
                                       dtype=torch.float32), dev)
    q = torch.softmax(rows.float() / t[:, None], dim=-1)
    picks = inverse_cdf(q, u)
    return (picks if every else logits.argmax(dim=-1).index_copy(0, idx, picks)), q


def group_rows(blocks: list[torch.Tensor], rows_of: dict[int, list[int]], n: int) -> list[torch.Tensor | None]:
    """Each sequence's rows of the stacked ``blocks`` (``[m_j, vocab]`` each, on one device): ``rows_of[i]`` lists
    sequence ``i``'s rows in ``torch.cat(blocks)``. One gather puts every sequence's rows together on the device;
    returns ``n`` entries, a slice ``[len(rows_of[i]), vocab]`` of it for each sequence with rows, else ``None``."""
    out: list[torch.Tensor | None] = [None] * n
    if not blocks:
        return out
    stacked = torch.cat(blocks)
    order = [r for i in sorted(rows_of) for r in rows_of[i]]
    grouped = stacked.index_select(0, host_to_device(torch.tensor(order, dtype=torch.long), stacked.device))
    start = 0
    for i in sorted(rows_of):
        if rows_of[i]:
            out[i] = grouped[start:start + len(rows_of[i])]
            start += len(rows_of[i])
    return out


class DraftModelProposer(Proposer):
    """A small model with the target's vocabulary proposes ``k`` tokens autoregressively (greedy at temperature 0,
    else sampled at the request's temperature, its distributions returned as ``q``), on a cache of its own of
    ``num_blocks`` blocks of ``block_size`` tokens. A sequence the cache cannot hold proposes nothing this step (a
    plain decode step), never an error.

    Its steps run through ``self.runner``, a ``ModelRunner`` of its own (``kernels``, ``cuda_graphs``: as the runner
    takes them; on CUDA the one-token steps replay decode graphs of batch sizes up to ``max_num_seqs``, the target's,
    with block tables ``max_model_len`` wide, the target engine's; its scratch block comes from this cache). With
    ``num_speculative_tokens`` (the config's ``k``) and the Triton path, each round's first step (the catch-up: up
    to ``k + 1`` tokens a sequence, what the target accepted and its bonus token) replays token-count graphs up to
    ``max_num_seqs * (k + 1)`` tokens; without them it runs eagerly, a launch per op (09 on an H100: the verify
    and decode steps replayed, this one did not)."""

    name = "draft"

    def __init__(self, draft, num_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 256,
                 max_model_len: int | None = None, cuda_graphs: bool | str = "auto", kernels: str = "auto",
                 num_speculative_tokens: int = 0):
        check_int("num_blocks", num_blocks, 2)
        check_positive_int("block_size", block_size)
        check_int("num_speculative_tokens", num_speculative_tokens, 0)
        self.draft = adopt_hf_model(draft)
        self.cache = self.draft.make_cache(num_blocks, block_size)
        model = self.draft.use(kernels, self.cache)
        token_sizes = default_graph_token_sizes(max_num_seqs * (num_speculative_tokens + 1)) \
            if num_speculative_tokens and model.plan.uses_triton else ()
        self.runner = ModelRunner(model, self.cache, None, cuda_graphs, max_num_seqs, max_model_len,
                                  graph_token_sizes=token_sizes)
        self.seqs: dict[Hashable, SeqBlocks] = {}  # the draft's copy of each sequence, on its own cache

    def _catch_up(self, sid: Hashable, context: Sequence[int]) -> int:
        """Make the draft's sequence ``sid`` hold ``context``'s tokens, with slots; returns how many of them still
        need a forward (>= 1: the last one's logits are needed). ``CacheFullError`` when its cache is full (the
        sequence is then released)."""
        seq = self.seqs.get(sid)
        context = context if isinstance(context, list) else list(context)
        same = 0
        if seq is not None:
            same = common_prefix_len(seq.token_ids, context)
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
    def propose(self, seq_ids, contexts, ks, temperatures=None, streams=None) -> list[Proposal]:
        """Up to ``ks[i]`` draft steps for each sequence, batched: each step's tokens (``draw_rows``: argmax or a
        draw) stay on the device and feed the next step's input (``placeholder`` ids filled on the device, as async
        scheduling does), so the steps run without a sync and the host prepares step ``j + 1`` while the GPU runs
        step ``j``; one copy reads every token at the end. A sampled sequence's ``q`` (its rows' distributions,
        float32 ``[n_i, vocab]``) stays on the device for the acceptance test."""
        check_ks(ks, len(contexts))
        temps = [0.0] * len(ks) if temperatures is None else list(temperatures)
        if streams is None and any(t != 0 for t in temps):
            raise ValueError("sampled proposals (a temperature > 0) need streams: one (seed, index) per sequence")
        if streams is not None and len(streams) != len(ks):
            raise ValueError(f"need one stream per sequence ({len(ks)}), got {len(streams)}")
        seeds, first = (np.array(c, dtype=np.uint64) for c in zip(*streams)) if streams else (None, None)
        query = {}
        for i, k in enumerate(ks):
            if k > 0:
                try:
                    query[i] = self._catch_up(seq_ids[i], contexts[i])
                except CacheFullError:
                    continue  # this one decodes plainly this step
        live = list(query)
        steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, their tokens on the device) per step
        q_steps: list[torch.Tensor] = []  # the sampled rows' distributions, step after step
        q_rows: dict[int, list[int]] = {i: [] for i in live if temps[i] != 0}  # each sampled row's, in q_steps' rows
        n_q = 0
        made = dict.fromkeys(live, 0)
        for step in range(max((ks[i] for i in live), default=0)):
            live = [i for i in live if made[i] < ks[i]]
            if step > 0:
                row_of = {i: j for j, i in enumerate(steps[-1][0])}
                live = self._append(seq_ids, {i: placeholder(row_of[i]) for i in live}, query)
            if not live:
                break
            logits = self._step(seq_ids, live, query, sampled=steps[-1][1] if step > 0 else None)
            u = token_uniforms(seeds[live], first[live] + np.uint64(step)) if seeds is not None \
                else np.zeros(len(live), np.float32)
            tokens, q = draw_rows(logits, [temps[i] for i in live], u)
            steps.append((live, tokens))
            if q is not None:
                q_steps.append(q)
                for i in (i for i in live if temps[i] != 0):
                    q_rows[i].append(n_q)
                    n_q += 1
            for i in live:
                made[i] += 1
        flat = torch.cat([t for _, t in steps]).tolist() if steps else []
        out: list[list[int]] = [[] for _ in ks]
        at = 0
        for rows, _ in steps:
            for i in rows:
                out[i].append(flat[at])
                at += 1
        for i in made:  # the draft's copies hold the real tokens again (placeholders stood for the last k - 1)
            toks = self.seqs[seq_ids[i]].token_ids
            n = len(out[i]) - 1
            if n > 0:
                toks[len(toks) - n:] = out[i][:n]
        qs = group_rows(q_steps, q_rows, len(ks))
        return [(toks, q) for toks, q in zip(out, qs)]

    def _append(self, seq_ids, next_ids: dict[int, int], query: dict[int, int]) -> list[int]:
        """Append ``next_ids[i]`` to row ``i``'s draft sequence with its slot; a row whose slot the cache cannot
        give stops proposing (it keeps what it has). Returns the rows still live."""
        kept = []
        for i, tok in next_ids.items():
            seq = self.seqs[seq_ids[i]]
            seq.token_ids.append(tok)
            try:
                self.cache.append_slots(seq)
            except CacheFullError:
                seq.token_ids.pop()
                continue
            query[i] = 1
            kept.append(i)
        return kept

    def _step(self, seq_ids, live: list[int], query: dict[int, int], sampled: torch.Tensor | None = None):
        """One draft forward over the live rows (``query[i]`` tokens each): float32 logits ``[len(live), vocab]``."""
        seqs = [self.seqs[seq_ids[i]] for i in live]
        counts = [query[i] for i in live]
        decodes = len(live) if all(c == 1 for c in counts) else 0  # one-token steps: the decode graphs
        logits = self.runner.execute(seqs, counts, decodes, sampled=sampled)
        for seq in seqs:
            self.cache.mark_computed(seq, seq.num_tokens)
        return logits

    def release(self, seq_id: Hashable) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and seq.block_table:
            self.cache.free(seq)
