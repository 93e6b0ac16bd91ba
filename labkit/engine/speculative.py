"""Speculative decoding inside ``LLMEngine``: propose ``k`` tokens cheaply, verify them with one forward of the
target, keep the longest accepted prefix plus one token of the target's own.

    from labkit.engine import LLMEngine, SamplingParams, SpeculativeConfig
    engine = LLMEngine(model, tok, speculative=SpeculativeConfig("prompt_lookup", num_speculative_tokens=4))
    engine = LLMEngine(model, tok, speculative=SpeculativeConfig("draft", 4, draft_model=draft))
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, num_speculative_tokens=2))  # per request k

Everything else stays the engine's: admission, chunked prefill, preemption (recompute and swap), aborts, failure
isolation. A step with speculation:

1. the scheduler gives every decoding sequence its slot as usual, then *lookahead slots* for up to ``k`` proposals
   from the blocks and token budget left (``seq.num_lookahead``; ``Scheduler.speculative_tokens``: the request's
   ``k`` or the engine's, never past ``max_tokens``);
2. ``Speculator.run`` asks the proposer for each such sequence's ``d_1 .. d_n`` (``n <= num_lookahead``; a prompt
   lookup that finds nothing proposes none), appends them, and runs *one* target forward over the batch: plain
   decodes (one row), speculating decodes (``1 + n`` rows, all of whose logits come back) and prefill chunks;
3. ``accept`` keeps ``d_1 .. d_m`` and draws one more token ``x`` (the correction, or the bonus when all ``n``
   were accepted): greedy, ``d_j`` is kept while it equals the target's argmax, so the output is plain greedy
   decoding's token for token; sampled, by the rejection rule of Leviathan et al. (2023) / Chen et al. (2023):
   keep ``d_j`` with probability ``min(1, p(d_j) / q(d_j))``, on the first rejection draw ``x`` from
   ``max(0, p - q)`` renormalised, so every emitted token follows the target's distribution ``p`` (its
   temperature, top-k and top-p);
4. ``cache.rollback`` cuts the sequence back to its pending token and ``d_1 .. d_m`` (the rejected tokens' slots
   and any block past them return to the allocator; nothing of them was hashed), and the scheduler's
   ``postprocess`` takes ``d_1 .. d_m, x`` as the step's tokens (up to a stop token).

Rows without proposals are sampled by the engine's ``Sampler`` exactly as without speculation (so ``k = 0`` is plain
decoding, also sampled). The draft model's cache is its own (``SpeculativeConfig.draft_num_blocks``); the scheduler
calls ``Proposer.release`` whenever it takes a sequence's blocks back (finished, aborted, failed, preempted by
recompute or by swap), so the draft holds KV only for running sequences; a preempted sequence's draft prefills its
context again when it next speculates. On CUDA with the Triton kernels a verify step without a prefill chunk beside it
replays a *verify* CUDA graph (every row's logits, per token-count bucket up to ``max_num_seqs * (k + 1)``:
``labkit.engine.cuda_graph``); one with a prefill chunk runs eagerly; steps without proposals replay graphs as usual.
The draft model runs on a ``ModelRunner`` of its own, whose one-token steps replay its decode graphs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from labkit.checks import check_choice, check_int, check_positive_int
from labkit.device import host_to_device
from labkit.engine.proposers import DraftModelProposer, PromptLookupProposer, Proposer
from labkit.engine.sampling import SamplingParams, apply_top_k_top_p, inverse_cdf, token_uniforms
from labkit.engine.scheduler import ScheduledBatch
from labkit.engine.sequence import Sequence

SPEC_METHODS = ("prompt_lookup", "draft")
"""Proposers of ``SpeculativeConfig.method``: n-gram lookup in the context (vLLM's 'ngram'), or a draft model."""
# the draft's draws, the acceptance tests and the last draw of a verify step: random streams of their own
_DRAFT_SALT, _ACCEPT_SALT, _RESAMPLE_SALT = 0x5BEC1, 0x5BEC2, 0x5BEC3


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (vLLM's names where it has them).

    * ``method``: 'prompt_lookup' (no model) or 'draft' (``draft_model``: a ``labkit.model.CausalLM`` or an HF
      Llama-family model with the target's vocabulary, on its device)
    * ``num_speculative_tokens``: ``k``, tokens proposed per step (a request overrides it:
      ``SamplingParams.num_speculative_tokens``, 0 turning speculation off for it)
    * ``prompt_lookup_max`` / ``prompt_lookup_min``: the n-gram lengths prompt lookup tries, longest first
    * ``draft_num_blocks``: blocks of the draft's own KV cache (default: as many as the target's cache, of the same
      block size); a sequence it cannot hold decodes plainly
    """

    method: str = "prompt_lookup"
    num_speculative_tokens: int = 4
    draft_model: object = None
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    draft_num_blocks: int | None = None

    def __post_init__(self) -> None:
        check_choice("method", self.method, SPEC_METHODS)
        check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        check_positive_int("prompt_lookup_max", self.prompt_lookup_max)
        check_int("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max + 1)
        check_int("draft_num_blocks", self.draft_num_blocks, 2, none_ok=True)
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(f"method={self.method!r} with draft_model={type(self.draft_model).__name__}: a draft "
                             "model goes with method='draft' and only with it")

    def make_proposer(self, target_vocab: int, device: torch.device, num_blocks: int, block_size: int,
                      max_num_seqs: int = 256, max_model_len: int | None = None,
                      cuda_graphs: bool | str = "auto", kernels: str = "auto") -> Proposer:
        """The proposer this config names, checked against the target (vocabulary, device); a draft's runner holds
        ``max_num_seqs`` sequences of up to ``max_model_len`` tokens (the target engine's), runs ``kernels`` ('auto'
        | 'torch' | 'triton': the target's path) and captures CUDA graphs unless ``cuda_graphs`` is False (the
        engine's setting: 'auto' where it is not False)."""
        if self.method == "prompt_lookup":
            return PromptLookupProposer(self.prompt_lookup_max, self.prompt_lookup_min)
        prop = DraftModelProposer(self.draft_model, self.draft_num_blocks or num_blocks, block_size, max_num_seqs,
                                  max_model_len, "auto" if cuda_graphs is not False else False,
                                  kernels, self.num_speculative_tokens)
        vocab, dev = prop.draft.config.vocab_size, prop.draft.device
        if vocab != target_vocab:
            raise ValueError(f"draft_model has a vocabulary of {vocab} tokens, the target {target_vocab}: a draft "
                             "must share the target's tokenizer")
        if dev.type != device.type:
            raise ValueError(f"draft_model is on {dev}, the target on {device}: put both on one device")
        return prop


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the engine's ``Sampler`` draws from for ``params``, per row of float ``logits`` ``[n,
    vocab]``: ``softmax`` of the logits over the temperature, cut by top-k and top-p (``apply_top_k_top_p``)."""
    n = logits.shape[0]
    x = logits.float() / params.temperature
    if params.top_k or params.top_p < 1:
        x = apply_top_k_top_p(x, torch.full((n,), params.top_k, dtype=torch.long, device=x.device),
                              torch.full((n,), params.top_p, dtype=torch.float32, device=x.device))
    return torch.softmax(x, dim=-1)


def accept_greedy(best: Seq[int], proposal: Seq[int]) -> tuple[int, int]:
    """``accept`` at temperature 0 from the target's argmax of each row, ``best`` (``k + 1`` token ids): proposals
    are kept while they equal it; the next token is the target's at the first mismatch (or after the last)."""
    n = 0
    while n < len(proposal) and proposal[n] == best[n]:
        n += 1
    return n, best[n]


def accept(p: torch.Tensor, proposal: Seq[int], q: torch.Tensor | None, temperature: float = 0.0,
           stream: tuple[int, int] = (0, 0), top_k: int = 0, top_p: float = 1.0) -> tuple[int, int]:
    """``(n_accepted, next_token)`` for one sequence.

    ``p``: float target logits ``[k + 1, vocab]`` (row ``j`` predicts the token after ``d_j``; row 0 after the
    pending token); ``proposal``: ``k`` token ids; ``q``: float32 draft probabilities ``[k, vocab]`` (on ``p``'s
    device) or ``None`` (deterministic proposals: ``q`` one-hot on ``d_j``). At ``temperature`` 0 the rule is argmax
    equality; above it the target's distribution is ``target_probs`` with ``top_k`` / ``top_p``, and ``stream``
    (``(seed, index)``) names the uniforms (``accept_sampled``)."""
    k = len(proposal)
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [k + 1 = {k + 1}, vocab], got {tuple(p.shape)}")
    if temperature == 0:
        return accept_greedy(p.argmax(dim=-1).tolist(), proposal)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return accept_sampled([p], [proposal], [q], [params], [stream])[0]


def accept_sampled(logits: Seq[torch.Tensor], proposals: Seq[Seq[int]], qs: Seq[torch.Tensor | None],
                   params: Seq[SamplingParams], streams: Seq[tuple[int, int]]) -> list[tuple[int, int]]:
    """The rejection rule (module docstring) for many sampled sequences at once: ``(n_accepted, next_token)`` each.

    ``logits[i]``: float ``[k_i + 1, vocab]``; ``qs[i]``: float32 ``[>= k_i, vocab]`` (a draft's rows) or ``None``;
    on one device. ``streams[i] = (seed, index)``: the test of ``d_j`` is at ``token_uniforms(seed ^ A, index + j)``
    and the last draw at ``token_uniforms(seed ^ B, index + m)`` (two salts: independent of each other, of the
    draft's draws and of the sampler's). Probabilities never leave the device: the host reads ``p(d_j)`` and
    ``q(d_j)`` of every proposal in one copy and runs the tests, then one batched device op forms each sequence's last
    distribution (the bonus row, or ``max(0, p - q)`` at the first rejection) and draws from it (``inverse_cdf``); a
    second copy reads the tokens: two syncs and ``2k + 1`` numbers a sequence, for any vocabulary."""
    if not logits:
        return []
    probs = torch.cat([target_probs(x, prm) for x, prm in zip(logits, params)])  # [sum(k_i + 1), vocab]
    dev, vocab = probs.device, probs.shape[1]
    first = list(itertools.accumulate((len(d) + 1 for d in proposals), initial=0))  # each sequence's first row
    drafted = [i for i, q in enumerate(qs) if q is not None]
    q_all = torch.cat([qs[i].to(dev, torch.float32) for i in drafted]) if drafted else None
    q_first = dict(zip(drafted, itertools.accumulate((qs[i].shape[0] for i in drafted), initial=0)))
    flat_p = np.array([(first[i] + j) * vocab + t for i, d in enumerate(proposals) for j, t in enumerate(d)],
                      dtype=np.int64)  # p(d_j) of every proposal, as indices into the flattened probabilities
    flat_q = np.array([(q_first[i] + j) * vocab + t for i in drafted for j, t in enumerate(proposals[i])],
                      dtype=np.int64)
    picked = probs.view(-1)[host_to_device(flat_p, dev)]
    if len(flat_q):
        picked = torch.cat([picked, q_all.view(-1)[host_to_device(flat_q, dev)]])
    values = np.array(picked.tolist(), dtype=np.float64)
    p_of_d, q_of_d = values[:len(flat_p)], np.ones(len(flat_p))
    if drafted:  # q(d_j) in proposal order; 1 where the proposal is deterministic
        has_q = np.concatenate([np.full(len(d), qs[i] is not None) for i, d in enumerate(proposals)]).astype(bool)
        q_of_d[has_q] = values[len(flat_p):]
    seeds = np.array([s for s, _ in streams], dtype=np.uint64)
    index = np.array([i for _, i in streams], dtype=np.uint64)
    owner = np.repeat(np.arange(len(proposals)), [len(d) for d in proposals])
    position = np.concatenate([np.arange(len(d)) for d in proposals]).astype(np.uint64)
    u = token_uniforms(seeds[owner] ^ np.uint64(_ACCEPT_SALT), index[owner] + position)
    kept = u * q_of_d < p_of_d  # accept d_j with probability min(1, p / q)
    stops = []
    for i, d in enumerate(proposals):  # the first rejected position, or the bonus row
        seg = kept[first[i] - i:first[i] - i + len(d)]
        stops.append(len(d) if seg.all() else int(np.argmin(seg)))
    rows = probs.index_select(0, host_to_device(np.array([first[i] + j for i, j in enumerate(stops)]), dev))
    rows = _residuals(rows, stops, proposals, [q_first.get(i) for i in range(len(qs))], q_all)
    last = token_uniforms(seeds ^ np.uint64(_RESAMPLE_SALT), index + np.array(stops, dtype=np.uint64))
    tokens = inverse_cdf(rows, host_to_device(torch.from_numpy(last), dev)).tolist()
    return list(zip(stops, tokens))


def _residuals(rows: torch.Tensor, stops: list[int], proposals: Seq[Seq[int]], q_first: list[int | None],
               q_all: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's last distribution, on the device: its bonus row of ``rows`` (``[n, vocab]``, the target's
    probabilities at ``stops[i]``) where every proposal was kept, else ``max(0, p - q)`` at the first rejection
    (``q``: row ``q_first[i] + stops[i]`` of ``q_all``, or one-hot on the rejected token where ``q_first[i]`` is
    None); left unnormalised (``inverse_cdf`` draws in proportion)."""
    rejected = [i for i, (j, d) in enumerate(zip(stops, proposals)) if j < len(d)]
    if not rejected:
        return rows
    dev = rows.device
    sub = torch.zeros_like(rows)
    with_q = [i for i in rejected if q_first[i] is not None]
    if with_q:
        src = host_to_device(torch.tensor([q_first[i] + stops[i] for i in with_q]), dev)
        sub.index_copy_(0, host_to_device(torch.tensor(with_q), dev), q_all.index_select(0, src))
    one_hot = [(i, proposals[i][stops[i]]) for i in rejected if q_first[i] is None]
    if one_hot:
        sub.index_put_(tuple(host_to_device(torch.tensor(c), dev) for c in zip(*one_hot)),
                       torch.full((len(one_hot),), float("inf"), device=dev))  # a fill: no copy, no sync
    is_rejected = torch.zeros(len(stops), dtype=torch.bool)
    is_rejected[rejected] = True
    residual = (rows - sub).clamp_min(0.0)
    # p == q exactly gives a rejection probability 0 and an empty residual: guard against rounding
    usable = host_to_device(is_rejected, dev)[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
    return torch.where(usable, residual, rows)


class Speculator:
    """The engine's speculative step (module docstring): ``run(batch)`` in place of a plain step's forward and
    sampling. Built by ``LLMEngine`` from ``EngineConfig.speculative``; registers the proposer's ``release`` with the
    scheduler. Counts go to the engine's ``EngineStats`` (``draft_tokens``, ``accepted_tokens``, ``spec_decodes``)."""

    def __init__(self, engine, config: SpeculativeConfig):
        self.engine, self.config = engine, config
        cache = engine.cache
        cfg = engine.config
        self.proposer = config.make_proposer(engine.vocab_size, engine.device, cache.num_blocks, cache.block_size,
                                             cfg.seqs_per_step, engine.max_model_len, cfg.cuda_graphs,
                                             "triton" if engine.runner.plan.uses_triton else "torch")
        engine.scheduler.release_hooks.append(lambda seq: self.proposer.release(seq.seq_id))

    def run(self, batch: ScheduledBatch) -> list[list[int]]:
        """Propose, verify in one target forward and accept, for the sequences of ``batch`` given lookahead slots;
        returns each sampling row's tokens (a list: the accepted proposals and the target's token) and leaves each
        speculating row's ``batch.num_tokens`` at the rows it keeps (1 + accepted). Raises as the forward does, with
        every sequence as it was (proposals removed, lookahead slots returned)."""
        rows = [i for i, s in enumerate(batch.seqs) if s.num_lookahead > 0 and batch.num_tokens[i] == 1
                and batch.sample[i]]
        pending = {i: batch.seqs[i].num_tokens for i in rows}  # tokens before the proposals: the pending one last
        # each row's random stream: the request's seed and the output index of its first proposal, so a run is
        # reproducible whatever the batch (as the sampler's draws); salted apart for the draft and the acceptance
        streams = {i: (batch.seqs[i].seed, batch.seqs[i].num_output_tokens) for i in rows}
        try:
            proposals = self._propose(batch, rows, streams)
            logits, props = self._verify(batch, proposals)
            tokens = self._accept(batch, logits, props, streams)
        except BaseException:
            for i in rows:
                self._cut(batch.seqs[i], pending[i])
            raise
        for i in rows:  # rejected proposals go; kept ones come back through postprocess with the target's token
            seq, keep = batch.seqs[i], len(tokens[i]) - 1
            self._cut(seq, pending[i] + keep)
            del seq.token_ids[pending[i]:]
            batch.num_tokens[i] = 1 + keep
        return [tokens[i] for i in range(len(batch.seqs)) if batch.sample[i]]

    def _cut(self, seq: Sequence, num_tokens: int) -> None:
        del seq.token_ids[num_tokens:]
        self.engine.cache.rollback(seq, num_tokens)
        seq.num_lookahead = 0

    def _propose(self, batch: ScheduledBatch, rows: list[int],
                 streams: dict[int, tuple[int, int]]) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        if not rows:
            return {}
        seqs = [batch.seqs[i] for i in rows]
        out = self.proposer.propose([s.seq_id for s in seqs], [list(s.token_ids) for s in seqs],
                                    [s.num_lookahead for s in seqs], [s.params.temperature for s in seqs],
                                    [(streams[i][0] ^ _DRAFT_SALT, streams[i][1]) for i in rows])
        stats = self.engine.stats
        stats.spec_decodes += len(rows)
        proposals = {}
        for i, seq, (toks, q) in zip(rows, seqs, out):
            toks = list(toks)[:seq.num_lookahead]
            seq.token_ids.extend(toks)  # their slots are reserved (lookahead)
            proposals[i] = (toks, q)
            stats.draft_tokens += len(toks)
        return proposals

    def _verify(self, batch: ScheduledBatch, proposals: dict) -> tuple[dict[int, torch.Tensor], dict]:
        """One target forward: plain decodes first (one row), then speculating ones (1 + n rows, every row's
        logits), then prefill chunks; returns each row's logits (``[1 or 1 + n, vocab]``) by batch row. Without a
        prefill chunk every row's logits are wanted: the runner replays a verify graph where one is captured."""
        props = {i: p for i, p in proposals.items() if p[0]}
        n = len(batch.seqs)
        order = [i for i in range(batch.num_decode) if i not in props] + sorted(props) + \
            list(range(batch.num_decode, n))
        counts = [1 + len(props[i][0]) if i in props else 1 for i in order]
        ntok = [counts[j] if i in props else batch.num_tokens[i] for j, i in enumerate(order)]
        runner = self.engine.runner
        logits = runner.execute([batch.seqs[i] for i in order], ntok, batch.num_decode - len(props),
                                logits_per_seq=counts if props else None)
        return dict(zip(order, logits.split(counts))), props

    def _accept(self, batch: ScheduledBatch, logits: dict[int, torch.Tensor], props: dict,
                streams: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
        """Tokens per sampling row: ``accept`` for rows with a proposal, the engine's sampler for the others."""
        plain = [i for i in range(len(batch.seqs)) if batch.sample[i] and i not in props]
        tokens: dict[int, list[int]] = {}
        if plain:
            seqs = [batch.seqs[i] for i in plain]
            sampled = self.engine.sampler(torch.cat([logits[i] for i in plain]), [s.params for s in seqs],
                                          [s.seed for s in seqs], [s.num_output_tokens for s in seqs])
            tokens.update((i, [t]) for i, t in zip(plain, sampled))
        decided: dict[int, tuple[int, int]] = {}
        greedy = [i for i in props if batch.seqs[i].params.greedy]
        if greedy:  # one argmax over every greedy row and one copy to the host, not one sync per sequence
            rows = [len(props[i][0]) + 1 for i in greedy]
            best = torch.cat([logits[i] for i in greedy]).argmax(dim=-1).tolist()
            for i, a, n in zip(greedy, itertools.accumulate(rows, initial=0), rows):
                decided[i] = accept_greedy(best[a:a + n], props[i][0])
        sampled = [i for i in props if i not in decided]
        if sampled:  # two copies to the host for all of them (accept_sampled)
            seqs = [batch.seqs[i] for i in sampled]
            decided.update(zip(sampled, accept_sampled(
                [logits[i] for i in sampled], [props[i][0] for i in sampled], [props[i][1] for i in sampled],
                [s.params for s in seqs], [streams[i] for i in sampled])))
        for i, (toks, _) in props.items():
            m, x = decided[i]
            tokens[i] = toks[:m] + [x]
            self.engine.stats.accepted_tokens += m
        return tokens
