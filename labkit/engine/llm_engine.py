"""LLMEngine: requests in, tokens out. A scheduler picks each step's work, the ModelRunner computes it on the paged
cache, the Sampler picks the tokens, and the step's tokens are streamed back.

* offline: ``generate(prompts, params)`` queues every prompt at once and steps until all are done
* online: ``add_request`` + ``step()`` (each call returns the tokens it produced, ``TokenOutput``); a benchmark
  replays a workload's arrivals against ``step`` (``labkit.bench.serving.serve``)

Each request's arrival and each token are stamped with ``clock`` (a function returning seconds, ``time.perf_counter``
by default; a benchmark may lend its own): the one place the engine reads a time. Nothing else is timed here.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Hashable, Iterable

import torch
from tqdm.auto import tqdm

from labkit.device import host_to_device
from labkit.engine.async_step import AsyncStepLoop
from labkit.engine.config import EngineConfig, EngineStats, default_eos_token_ids, engine_config, vocab_size
from labkit.engine.cuda_graph import default_graph_batch_sizes, default_graph_token_sizes, default_graph_verify_sizes
from labkit.engine.model_runner import ModelRunner
from labkit.engine.policies import make_scheduler
from labkit.engine.sampling import SampledTokens, Sampler, SamplingParams, token_seed
from labkit.engine.scheduler import ScheduledBatch
from labkit.engine.sequence import FinishReason, Request, RequestOutput, Sequence, TokenOutput, prompt_token_list
from labkit.engine.speculative import Speculator
from labkit.kvcache import PagedKVCache
from labkit.model import FusionPlan, adopt_hf_model

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "EngineConfig", "EngineStats"]


class LLMEngine:
    """The serving engine over one model and one paged KV cache. ``LLMEngine(model, tokenizer, scheduler=...)``:
    keyword arguments override fields of ``config`` (an ``EngineConfig``)."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, **overrides):
        self.config = cfg = engine_config(model, config, overrides)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.max_model_len = (model.config.max_position_embeddings if cfg.max_model_len is None
                              else cfg.max_model_len)
        if self.max_model_len > model.config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{model.config.max_position_embeddings}")
        self.cache = PagedKVCache.for_model(model, self._num_blocks(model), cfg.block_size, kv_dtype=cfg.kv_dtype,
                                            enable_prefix_caching=cfg.enable_prefix_caching)
        sizes = cfg.graph_batch_sizes or default_graph_batch_sizes(cfg.seqs_per_step)
        resolved = adopt_hf_model(model).use(cfg.kernels, self.cache)  # the plan, resolved once for this engine
        self.runner = ModelRunner(resolved, self.cache, None, cfg.cuda_graphs, cfg.seqs_per_step,
                                  self.max_model_len, sizes, graph_token_sizes=self._token_sizes(resolved.plan),
                                  graph_verify_sizes=self._verify_sizes(resolved.plan))
        self.scheduler = make_scheduler(cfg.scheduler, self.cache, max_num_seqs=cfg.max_num_seqs,
                                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                                        chunked_prefill=cfg.chunked_prefill, static_batch_size=cfg.static_batch_size,
                                        max_model_len=self.max_model_len, min_admit=cfg.min_admit,
                                        preemption_mode=cfg.preemption_mode, num_cpu_blocks=self._num_cpu_blocks(),
                                        num_speculative_tokens=getattr(cfg.speculative, "num_speculative_tokens", None))
        self.sampler = Sampler()
        self.vocab_size = vocab_size(model)
        self.speculator = Speculator(self, cfg.speculative) if cfg.speculative else None  # speculative.py
        self.eos_token_ids = (cfg.eos_token_ids if cfg.eos_token_ids is not None
                              else default_eos_token_ids(model, tokenizer))
        self.clock: Callable[[], float] = time.perf_counter
        # how a step's sampled tokens start their copy to the host (a simulated device may lend its own)
        self.to_host: Callable[[torch.Tensor], SampledTokens] = SampledTokens.start
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self._async = AsyncStepLoop(self) if cfg.async_scheduling else None
        self.reset()

    def _token_sizes(self, plan: FusionPlan) -> tuple[int, ...]:
        """Token counts of the captured steps with prefill chunks: by default the continuous scheduler's (most of
        its steps carry one), up to its token budget, where the runner's Triton path can capture them."""
        cfg = self.config
        if cfg.graph_token_sizes is not None:
            return cfg.graph_token_sizes
        if cfg.scheduler != "continuous" or not plan.uses_triton:
            return ()
        return tuple(default_graph_token_sizes(cfg.max_num_batched_tokens))

    def _verify_sizes(self, plan: FusionPlan) -> tuple[int, ...]:
        """Token counts of the captured verify steps (speculative decoding, every row's logits): when the engine
        speculates, ``default_graph_verify_sizes`` of its sequences per step and ``k`` (up to its token budget), where
        the runner's Triton path can capture them."""
        spec = self.config.speculative
        if spec is None or not plan.uses_triton:
            return ()
        sizes = default_graph_verify_sizes(self.config.seqs_per_step, spec.num_speculative_tokens)
        return tuple(sorted({min(t, self.config.max_num_batched_tokens) for t in sizes}))  # a step holds no more

    def _num_cpu_blocks(self) -> int | None:
        """Blocks of the swap space: ``swap_space`` GiB, at most as many as the device cache holds (``None``
        without swapping: no swap space is allocated)."""
        if self.config.preemption_mode != "swap":
            return None
        n = min(self.cache.num_blocks, int(self.config.swap_space * (1 << 30)) // self.cache.bytes_per_block)
        if n < 1:
            raise ValueError(f"swap_space={self.config.swap_space} GiB holds no KV block of "
                             f"{self.cache.bytes_per_block} bytes; give it more")
        return n

    def _num_blocks(self, model) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        probe = PagedKVCache.for_model(model, 1, cfg.block_size, kv_dtype=cfg.kv_dtype, allocate_pools=False)
        want = -(-cfg.seqs_per_step * self.max_model_len // cfg.block_size) + 1  # + the graphs' scratch block
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(2, min(want, int(cfg.gpu_memory_utilization * free) // probe.bytes_per_block))
        return max(2, min(want, (1 << 30) // probe.bytes_per_block))

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (HF's single-id name; the engine stops on every id of ``eos_token_ids``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def reset(self, abort: bool = False) -> None:
        """Start a new run: fresh statistics. Requests still unfinished are refused (``RuntimeError``) unless
        ``abort=True``, which aborts them (finish reason 'abort', blocks freed) first."""
        if self.scheduler.has_unfinished():
            if not abort:
                n = sum(not s.is_finished for s in self.seqs.values())
                raise RuntimeError(f"{n} requests are still unfinished; step until they finish, abort_request(id) "
                                   "them, or reset(abort=True)")
            self.scheduler.abort_all()
        if self._async is not None:
            self._async.drop()
        self.stats = EngineStats()
        self.scheduler.reset_stats()
        self.seqs = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Iterable[int], params: SamplingParams | None = None,
                    arrival_s: float | None = None, request_id: int | None = None) -> int:
        """Queue a prompt (text needs the tokenizer); returns its request id. Refuses (``TypeError`` /
        ``ValueError`` / ``CacheFullError``, naming the request and the bad value) a request that could never run:
        token ids not ints or outside ``[0, vocab)``, an empty prompt, prompt + ``max_tokens`` over
        ``max_model_len`` or the whole cache, ``params`` not a ``SamplingParams``, an id in use."""
        seq = self._sequence(prompt, params, arrival_s, request_id)
        self._enqueue(seq)
        return seq.seq_id

    def check_request(self, prompt: str | Iterable[int], params: SamplingParams | None = None,
                      request_id: int | None = None) -> None:
        """Raise as ``add_request`` would for this request, without queueing it (to check a batch before any runs)."""
        self._sequence(prompt, params, 0.0, request_id)

    def abort_request(self, request_id: Hashable) -> bool:
        """Take an unfinished request out (queued, running or swapped out): its blocks are freed and its result
        says finish reason 'abort'. Returns False for a request that had finished already; ``KeyError`` for an
        unknown id."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request_id={request_id!r} is unknown; known: {sorted(self.seqs)[:10]}")
        if seq.is_finished:
            return False
        self.scheduler.finish_early(seq, FinishReason.ABORT)
        return True

    def _sequence(self, prompt, params: SamplingParams | None, arrival_s: float | None,
                  request_id: int | None) -> Sequence:
        """A checked sequence for a request (not queued): see ``add_request`` for what is refused."""
        rid = self._next_id if request_id is None else request_id
        if not isinstance(rid, numbers.Integral) or isinstance(rid, bool) or rid < 0:
            raise ValueError(f"request_id={rid!r} must be an int >= 0")
        if rid in self.seqs:
            raise ValueError(f"request_id={rid} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid}: prompt is a string but the engine has no tokenizer; pass token "
                                 "ids or a tokenizer")
            prompt = self.tokenizer(prompt)["input_ids"]
        prompt = prompt_token_list(prompt, self.vocab_size, rid)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {rid}: params={params!r} must be a SamplingParams (or None for the default), "
                            f"got {type(params).__name__}")
        if arrival_s is not None and (not isinstance(arrival_s, numbers.Real) or not math.isfinite(arrival_s)):
            raise ValueError(f"request {rid}: arrival_s={arrival_s!r} must be a finite number of seconds")
        seed = params.seed if params.seed is not None else token_seed(self.config.seed, rid) % (1 << 31)
        req = Request(int(rid), prompt, params, self.clock() if arrival_s is None else float(arrival_s))
        seq = Sequence(req, seed, self.eos_token_ids)
        self.scheduler.check(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.seqs[seq.seq_id] = seq
        self._next_id = max(self._next_id, seq.seq_id + 1)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule, run and sample one step; returns the tokens it produced (empty if idle), stamped by ``clock``.

        A step that raises is run again one sequence at a time: a sequence that fails alone is finished with
        finish reason 'error' (the message on its result) and its blocks are freed; the others go on (vLLM's
        failure isolation). A failing step therefore costs one extra pass, never the batch.

        With ``async_scheduling``: ``AsyncStepLoop.step`` (launch this step, then read the previous one's tokens:
        they come back one call late; the last call of a run may return none)."""
        if self._async is not None:
            return self._async.step()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        try:
            tokens = self._run(batch)
        except Exception as e:  # noqa: BLE001 (any error of one request must not take the others down)
            batch, tokens = self._isolate(batch, e)
        outs = self.scheduler.postprocess(batch, tokens, self.clock())
        self._count(batch, len(outs))
        return outs

    def _count(self, batch: ScheduledBatch, output_tokens: int = 0) -> None:
        """Count a computed step in ``stats`` (``output_tokens``: the tokens it delivered, if read already)."""
        s = self.stats
        s.steps += 1
        s.decode_tokens += batch.num_decode
        s.prefill_tokens += batch.num_prefill_tokens
        s.output_tokens += output_tokens
        s.scheduled_seqs += len(batch.seqs)
        s.graph_steps += int(self.runner.last_step_replayed)

    def _launch(self, batch: ScheduledBatch, sampled: torch.Tensor | None = None) -> SampledTokens:
        """Queue ``batch``'s forward and the sampling of its sampling rows on the device; returns their tokens on
        their way to the host (in row order), without waiting for them. ``sampled``: the tokens of the step in
        flight on the device, where ``batch``'s placeholder inputs are read (async scheduling)."""
        extra = {} if sampled is None else {"sampled": sampled}
        logits = self.runner.execute(batch.seqs, batch.num_tokens, batch.num_decode, **extra)
        rows = [i for i, smp in enumerate(batch.sample) if smp]
        if len(rows) < len(batch.seqs):  # a device index: a host list would make the host wait for the device
            logits = logits.index_select(0, host_to_device(torch.tensor(rows, dtype=torch.long), logits.device))
        seqs = [batch.seqs[i] for i in rows]
        tokens = self.sampler.sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                     [s.num_output_tokens for s in seqs])
        return self.to_host(tokens)

    def _run(self, batch: ScheduledBatch) -> list[int] | list[list[int]]:
        """Compute ``batch`` and sample its sampling rows: their tokens, in order, read on the host (with
        speculation, a list per row: ``Speculator.run``)."""
        if self.speculator is not None:
            return self.speculator.run(batch)
        return self._launch(batch).tolist()

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> tuple[ScheduledBatch, list[int]]:
        """After ``batch`` raised ``error``: each sequence alone (no computed count advanced, so the rerun writes the
        same slots); those that fail again are finished with an error. Returns the batch of the survivors and
        their tokens."""
        kept, tokens = ScheduledBatch(preempted=batch.preempted), []
        for seq, n, smp in zip(batch.seqs, batch.num_tokens, batch.sample):
            one = ScheduledBatch([seq], [n], [smp], int(n == 1))
            try:
                out = self._run(one) if len(batch.seqs) > 1 else None
            except Exception as e:  # noqa: BLE001
                error = e
                out = None
            if out is None:
                msg = f"{type(error).__name__}: {error}"
                log.warning("request %s failed in a step and was finished with an error: %s", seq.seq_id, msg)
                self.scheduler.finish_early(seq, FinishReason.ERROR, msg)
                continue
            kept.seqs.append(seq)
            kept.num_tokens.append(n)
            kept.sample.append(smp)
            kept.num_decode += int(n == 1)
            tokens += out
        return kept, tokens

    # --- the offline loop and a run's results ----------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = True) -> list[RequestOutput]:
        """Offline: every prompt queued at once; returns one ``RequestOutput`` per prompt, in order.

        ``prompts``: a list of strings (with a tokenizer) or of token-id lists, never one bare string. Every request
        is checked before any is queued (see ``add_request``): a bad one raises and nothing runs. A request that
        fails inside a step comes back with ``finish_reason='error'`` and ``error`` set; the others complete.
        """
        if isinstance(prompts, (str, bytes)):
            raise TypeError(f"prompts={prompts!r} is one string; pass a list of prompts, e.g. [{prompts!r}]")
        if not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a list of prompts (strings or token-id lists), got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(params, (list, tuple)):
            plist = list(params)
        elif params is None or isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            raise TypeError(f"params={params!r} must be a SamplingParams, a list of them (one per prompt) or None, "
                            f"got {type(params).__name__}")
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} for {len(prompts)} prompts; give one, or one per prompt")
        self.reset()
        now = self.clock()
        seqs = [self._sequence(p, sp, now, self._next_id + i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        for seq in seqs:  # every request checked: queue them all
            self._enqueue(seq)
        total = sum(seq.params.max_tokens for seq in seqs)
        with tqdm(total=total, desc=f"generate ({self.config.scheduler})", unit="tok", disable=not progress) as bar:
            self._loop(lambda: bar.update(len(self.step())))
        return [RequestOutput.from_sequence(seq, self.tokenizer) for seq in seqs]

    def _loop(self, body: Callable[[], None]) -> None:
        """Call ``body`` while requests are unfinished; if it raises (an interrupt, a scheduler error) every
        unfinished request is aborted first, so the engine is never left wedged."""
        try:
            while self.has_unfinished():
                body()
        except BaseException:
            self.scheduler.abort_all()
            raise

    def outputs(self) -> list[RequestOutput]:
        """A ``RequestOutput`` for every finished request of the current run (failed and aborted ones included), by
        request id."""
        seqs = sorted((s for s in self.seqs.values() if s.is_finished), key=lambda s: s.seq_id)
        return [RequestOutput.from_sequence(s, self.tokenizer) for s in seqs]

    def run_stats(self) -> dict:
        """What the current run did: the engine's counts (``EngineStats``), the scheduler's (preemptions, prefix
        hits, peaks, swaps) and the requests that failed."""
        return {**self.stats.to_dict(), **self.scheduler.stats(),
                "errors": sum(s.finish_reason is FinishReason.ERROR for s in self.seqs.values())}
