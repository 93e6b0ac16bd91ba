"""Async scheduling (``EngineConfig.async_scheduling``): the host prepares step n+1 while the device runs step n.

Without it, a step is: schedule, copy the inputs, launch the forward and the sampling, wait for the sampled tokens,
postprocess; the device idles while the host schedules and postprocesses (``engine.decode_b{b}_host_frac`` measures
that share). With it (vLLM's async scheduling, SGLang's overlap scheduler), each ``LLMEngine.step()`` call:

1. **schedules** step n+1 on the sequences as they stand: a token that step n samples is *pending*, its place in the
   sequence held by a placeholder id (``labkit.model.attention.placeholder``), and gets a cache slot as any token;
2. **launches** step n+1 (``LLMEngine._launch``): the inputs are packed on the host and copied without waiting (pinned
   memory on CUDA); a row whose input is a pending token reads it from step n's sampled tokens on the device
   (``fill_placeholders``, a gather by row); the forward and the sampling (on the device: ``Sampler.sample``) queue
   behind step n, and the sampled tokens start their copy to the host (``SampledTokens``: pinned memory, CUDA event);
3. **reads** step n's tokens (waits for step n's event: the device is busy with step n+1 meanwhile), writes them over
   the placeholders, checks the stop conditions and streams them: each token comes out one call later;
4. **commits** step n+1: its sequences' computed counts advance (full blocks enter the prefix cache now, every token
   they hash being resolved) and each of its sampling rows leaves a placeholder in its sequence.

What stays exact (``tests/test_engine_async.py`` runs the same workloads both ways):

* a sequence that stops on a stop token at step n is already in step n+1: that row's token is discarded
  (``EngineStats.discarded_tokens``), its computed count is not committed, and its blocks are freed at 3 while
  step n+1 may still write the row's K/V into them; a later step that reuses the blocks runs after it (one stream);
* a sequence whose pending token is its ``max_tokens``-th (``max_model_len`` bounds prompt + ``max_tokens``) is not
  scheduled again (the scheduler's one rule for async scheduling); it finishes at 3;
* a pending sequence preempted at 1 holds its placeholder in the queue (recompute) or the swap space until 3
  resolves it, before any step can bring it back (no step admits or swaps in after a preemption); if it stopped it is
  removed from there (``Scheduler.remove``);
* an aborted sequence drops its pending token (``Sequence.finish``): it ends with the tokens it streamed;
* a step that raises at launch: step n is read first, then the failing step's sequences are run one at a time and
  read at once (``LLMEngine._isolate``, as without overlap); nothing stays in flight.

On the CPU torch's ops are synchronous, so a step is done when it is launched; the bookkeeping is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.engine.sampling import SampledTokens
from labkit.engine.scheduler import ScheduledBatch
from labkit.engine.sequence import TokenOutput
from labkit.model.attention import placeholder


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read: its batch and its ``SampledTokens`` (the batch's sampling
    rows in order: row ``j``'s sequence holds ``placeholder(j)``)."""

    batch: ScheduledBatch
    tokens: SampledTokens


class AsyncStepLoop:
    """``LLMEngine.step`` under async scheduling (module docstring): one step in flight at most (``in_flight``)."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: InFlight | None = None

    def step(self) -> list[TokenOutput]:
        """Schedule and launch the next step, then read the one in flight; returns the tokens read (empty while the
        first step of a run is in flight, or when idle)."""
        e = self.engine
        batch = e.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            sampled = self._sampled_for(batch)  # outside the try: a bookkeeping error is the engine's, not a request's
            try:
                launched = e._launch(batch, sampled)
            except Exception as error:  # noqa: BLE001 (one request's failure must not take the others down)
                return self._fail(batch, error)
        outs = self._read()
        if launched is not None:
            self._commit(batch)
            e._count(batch)
            self.in_flight = InFlight(batch, launched)
        return outs

    def drop(self) -> None:
        """Forget the step in flight (a new run starts: every sequence in it has finished; the device finishes it
        on its own, before any later step in stream order)."""
        self.in_flight = None

    def _sampled_for(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step in flight's sampled tokens on the device if a sequence of ``batch`` waits for one, else None.
        Every pending token is one of the step in flight's (the previous ones were read before this step was
        scheduled); a ``RuntimeError`` says otherwise rather than feed another row's token."""
        pending = [s for s in batch.seqs if s.num_pending]
        if not pending:
            return None
        f = self.in_flight
        ours = {id(s) for s, smp in zip(f.batch.seqs, f.batch.sample) if smp} if f is not None else set()
        stray = [s.seq_id for s in pending if id(s) not in ours]
        if stray:
            raise RuntimeError(f"sequences {stray} wait for tokens that are not the step in flight's")
        return f.tokens.device

    def _read(self) -> list[TokenOutput]:
        """Wait for the tokens of the step in flight and resolve them: stop checks, finished sequences taken out
        (wherever they are now) and their blocks freed; a row of a sequence that finished meanwhile is discarded."""
        f, self.in_flight = self.in_flight, None
        if f is None:
            return []
        e = self.engine
        tokens = f.tokens.tolist()  # the host waits here, for step n only
        now = e.clock()
        outs = []
        sampling = [s for s, smp in zip(f.batch.seqs, f.batch.sample) if smp]
        for j, (seq, tok) in enumerate(zip(sampling, tokens, strict=True)):
            if seq.is_finished:  # stopped a step earlier, or aborted: this token was never the request's
                e.stats.discarded_tokens += 1
                continue
            if seq.token_ids[-1] != placeholder(j):
                raise RuntimeError(f"sequence {seq.seq_id}: pending token is {seq.token_ids[-1]}, expected "
                                   f"placeholder {placeholder(j)} of row {j}")
            done = seq.resolve(tok, now)
            if done:
                e.scheduler.remove(seq)
            outs.append(TokenOutput(seq.seq_id, tok, now, done))
        e.stats.output_tokens += len(outs)
        return outs

    def _commit(self, batch: ScheduledBatch) -> None:
        """The launched ``batch``'s sequences that still run (not stopped by the tokens just read) advance their
        computed counts; each sampling row leaves its placeholder."""
        cache, j = self.engine.cache, 0
        for seq, n, smp in zip(batch.seqs, batch.num_tokens, batch.sample):
            if not seq.is_finished:
                cache.mark_computed(seq, seq.num_computed + n)
                if smp:
                    seq.append_pending(placeholder(j))
            j += smp

    def _fail(self, batch: ScheduledBatch, error: Exception) -> list[TokenOutput]:
        """``batch`` raised at launch: read the step in flight (computed before the failure), then run ``batch``'s
        sequences that still run one at a time and read them at once, as without async scheduling."""
        e = self.engine
        outs = self._read()
        keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
        if not keep:
            return outs
        alive = ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_tokens[i] for i in keep],
                               [batch.sample[i] for i in keep], sum(i < batch.num_decode for i in keep),
                               batch.preempted)
        kept, tokens = e._isolate(alive, error)
        outs += e.scheduler.postprocess(kept, tokens, e.clock())
        e._count(kept, len(tokens))
        return outs
