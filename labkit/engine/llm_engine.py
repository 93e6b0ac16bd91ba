"""LLMEngine: requests in, tokens out. A scheduler picks each step's work, the ModelRunner computes it on the paged
cache, the Sampler picks the tokens, and the step's tokens are streamed back.

* offline: ``generate(prompts, params)`` queues every prompt at time 0 and steps until all are done
* online: ``add_request`` + ``step()`` (each call returns the tokens it produced, ``TokenOutput``), or
  ``serve(workload)``, which replays a workload's Poisson arrivals against the step loop

The serving clock. ``clock='virtual'`` (the default): each step is timed for real (wall clock, the device
synchronised by the sampled tokens reaching the host) and the clock advances by exactly that; while the engine is
idle the clock jumps to the next arrival instead of sleeping. The queueing is therefore that of a real server
whose steps take what they took, without waiting through idle gaps (which at low load would be most of a run)
and without the noise of a shared machine's sleeps; it is also how ``labkit.experiments.baseline`` replays HF
``generate``, so the two compare on one footing. ``clock='real'`` sleeps until arrivals and stamps tokens with
``perf_counter``: the honest end-to-end mode for a dedicated machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm.auto import tqdm

from labkit.engine.cuda_graph import default_graph_batch_sizes, default_graph_token_sizes
from labkit.engine.metrics import RequestMetrics
from labkit.engine.model_runner import ModelRunner, uses_triton
from labkit.engine.sampling import Sampler, SamplingParams, token_seed
from labkit.engine.scheduler import PREEMPTION_MODES, SCHEDULERS, make_scheduler
from labkit.engine.sequence import Request, RequestOutput, TokenOutput
from labkit.engine.sequence import Sequence as Seq
from labkit.engine.workload import RequestSpec
from labkit.kvcache import PagedKVCache
from labkit.model import FusionPlan

CLOCKS = ("virtual", "real")
"""Serving clocks: 'virtual' (arrivals in model time, reproducible) or 'real' (wall clock)."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (vLLM's names).

    * ``scheduler``: 'fifo', 'static' or 'continuous'; ``static_batch_size`` (default ``max_num_seqs``)
    * ``max_num_seqs``: running sequences at most; ``max_num_batched_tokens``: tokens per step (continuous)
    * ``chunked_prefill``: split long prompts over steps (continuous); ``min_admit``: admit waiting requests in
      groups of at least this many while others decode (continuous; see ``ContinuousBatchingScheduler``)
    * ``max_model_len``: prompt + output tokens at most (default: the model's maximum position)
    * ``block_size``, ``num_blocks``: the paged cache; ``num_blocks=None`` sizes it from
      ``gpu_memory_utilization`` of free device memory on CUDA, and for ``max_num_seqs`` full-length sequences
      (capped at 1 GiB) on the CPU
    * ``kernels``: a ``labkit.model.FusionPlan`` or 'auto' | 'torch' | 'triton' (``FusionPlan.named``);
      ``cuda_graphs``: 'auto' | True | False; ``graph_batch_sizes``:
      the captured all-decode batches (default ``default_graph_batch_sizes``); ``graph_token_sizes``: the
      captured steps with prefill chunks, by token count (default: ``default_graph_token_sizes`` of the token
      budget for the continuous scheduler on the Triton path, none otherwise)
    * ``preemption_mode``: 'recompute' or 'swap' (continuous: what happens to the youngest sequence when blocks run
      out; see ``labkit.engine.scheduler``); ``swap_space``: GiB of CPU memory for swapped blocks (vLLM's name and
      default), at most the device cache's size, allocated only with ``preemption_mode='swap'``
    * ``seed``: seeds requests that bring none (``SamplingParams.seed``)
    """

    scheduler: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    min_admit: int = 1
    static_batch_size: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.85
    kv_dtype: str | None = None
    enable_prefix_caching: bool = False
    kernels: str | FusionPlan = "auto"
    cuda_graphs: bool | str = "auto"
    graph_batch_sizes: tuple[int, ...] | None = None
    graph_token_sizes: tuple[int, ...] | None = None
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r} is unknown; allowed: {SCHEDULERS}")
        FusionPlan.named(self.kernels, "cpu")  # a plan, or one of its names (an unknown name raises)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is unknown; allowed: {PREEMPTION_MODES}")
        if not self.swap_space > 0:
            raise ValueError(f"swap_space={self.swap_space!r} GiB must be > 0")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (or None to size the cache)")

    @property
    def seqs_per_step(self) -> int:
        """Sequences a step can hold under this scheduler."""
        return {"fifo": 1, "static": self.static_batch_size or self.max_num_seqs}.get(self.scheduler,
                                                                                        self.max_num_seqs)


@dataclass
class EngineStats:
    """What the engine did since the last reset: steps, time busy, tokens computed, memory."""

    steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    decode_tokens: int = 0
    output_tokens: int = 0
    graph_steps: int = 0  # steps replayed from a CUDA graph
    peak_device_bytes: int | None = None
    step_s: list[float] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class VirtualClock:
    """Advances by the measured duration of each step; jumps over idle time (see the module docstring)."""

    name = "virtual"

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


class RealClock:
    """Seconds since the run started (``perf_counter``); waiting sleeps."""

    name = "real"

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def advance(self, dt: float) -> float:
        return self.now()

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


@dataclass
class ServeResult:
    """A served workload: per-request metrics and outputs, and what the engine did."""

    metrics: list[RequestMetrics]
    outputs: list[RequestOutput]
    stats: dict


class LLMEngine:
    """The serving engine over one model and one paged KV cache. ``LLMEngine(model, tokenizer, scheduler=...)``:
    keyword arguments override fields of ``config`` (an ``EngineConfig``)."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, **overrides):
        self.config = cfg = replace(config or EngineConfig(), **overrides)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        if self.max_model_len > model.config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{model.config.max_position_embeddings}")
        self.cache = PagedKVCache.for_model(model, self._num_blocks(model), cfg.block_size, kv_dtype=cfg.kv_dtype,
                                            enable_prefix_caching=cfg.enable_prefix_caching)
        sizes = cfg.graph_batch_sizes or default_graph_batch_sizes(cfg.seqs_per_step)
        self.runner = ModelRunner(model, self.cache, cfg.kernels, cfg.cuda_graphs, cfg.seqs_per_step,
                                  self.max_model_len, sizes, graph_token_sizes=self._token_sizes())
        self.scheduler = make_scheduler(cfg.scheduler, self.cache, max_num_seqs=cfg.max_num_seqs,
                                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                                        chunked_prefill=cfg.chunked_prefill, static_batch_size=cfg.static_batch_size,
                                        max_model_len=self.max_model_len, min_admit=cfg.min_admit,
                                        preemption_mode=cfg.preemption_mode, num_cpu_blocks=self._num_cpu_blocks())
        self.sampler = Sampler()
        eos = getattr(model.config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.seqs: dict[int, Seq] = {}
        self._next_id = 0
        self.reset()

    def _token_sizes(self) -> tuple[int, ...]:
        """Token counts of the captured steps with prefill chunks: by default the continuous scheduler's (most of
        its steps carry one), up to its token budget, where the runner's Triton path can capture them."""
        cfg = self.config
        if cfg.graph_token_sizes is not None:
            return cfg.graph_token_sizes
        if cfg.scheduler != "continuous" or not uses_triton(cfg.kernels, self.device):
            return ()
        return tuple(default_graph_token_sizes(cfg.max_num_batched_tokens))

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

    def reset(self, clock: str = "virtual") -> None:
        """Start a new run: a fresh clock and statistics (the cache must be empty)."""
        if clock not in CLOCKS:
            raise ValueError(f"clock={clock!r} is unknown; allowed: {CLOCKS}")
        if self.scheduler.has_unfinished():
            raise RuntimeError("requests are still running; finish them before reset")
        self.clock = VirtualClock() if clock == "virtual" else RealClock()
        self.stats = EngineStats()
        self.scheduler.reset_stats()
        self.seqs = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_s: float | None = None, request_id: int | None = None) -> int:
        """Queue a prompt (text needs the tokenizer); returns its request id. Refuses (``ValueError`` /
        ``CacheFullError``) a request that could never run."""
        seq = self._sequence(prompt, params, arrival_s, request_id)
        self.scheduler.add(seq)
        self.seqs[seq.seq_id] = seq
        self._next_id = max(self._next_id, seq.seq_id + 1)
        return seq.seq_id

    def _sequence(self, prompt, params: SamplingParams | None, arrival_s: float | None,
                  request_id: int | None) -> Seq:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer; pass token ids or a tokenizer")
            prompt = self.tokenizer(prompt)["input_ids"]
        rid = self._next_id if request_id is None else request_id
        if rid in self.seqs:
            raise ValueError(f"request_id={rid} is already in use")
        params = params or SamplingParams()
        seed = params.seed if params.seed is not None else token_seed(self.config.seed, rid) % (1 << 31)
        req = Request(rid, list(prompt), params, self.clock.now() if arrival_s is None else arrival_s)
        return Seq(req, seed, self.eos_token_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule, run and sample one step; returns the tokens it produced (empty if idle)."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        logits = self.runner.execute([s.seq_id for s in batch.seqs], batch.num_tokens, batch.num_decode)
        rows = [i for i, smp in enumerate(batch.sample) if smp]
        seqs = [batch.seqs[i] for i in rows]
        tokens = self.sampler(logits if len(rows) == len(batch.seqs) else logits[rows], [s.params for s in seqs],
                              [s.seed for s in seqs], [s.num_output_tokens for s in seqs])
        if not rows and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing came back to the host: wait for the step itself
        dt = time.perf_counter() - t0
        outs = self.scheduler.postprocess(batch, tokens, self.clock.advance(dt))
        self._count(batch, dt, len(tokens))
        return outs

    def _count(self, batch, dt: float, n_out: int) -> None:
        s = self.stats
        s.steps += 1
        s.busy_s += dt
        s.decode_tokens += batch.num_decode
        s.prefill_tokens += batch.num_prefill_tokens
        s.output_tokens += n_out
        s.graph_steps += int(self.runner.last_step_replayed)
        s.step_s.append(dt)
        s.step_seqs.append(len(batch.seqs))

    # --- offline and online loops ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = True) -> list[RequestOutput]:
        """Offline: every prompt queued at time 0; returns one ``RequestOutput`` per prompt, in order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} for {len(prompts)} prompts; give one, or one per prompt")
        self.reset()
        for i, (p, sp) in enumerate(zip(prompts, plist)):  # refuse a bad request before queueing any
            self.scheduler.check(self._sequence(p, sp, 0.0, self._next_id + i))
        ids = [self.add_request(p, sp, arrival_s=0.0) for p, sp in zip(prompts, plist)]
        total = sum(self.seqs[i].params.max_tokens for i in ids)
        with tqdm(total=total, desc=f"generate ({self.config.scheduler})", unit="tok", disable=not progress) as bar:
            while self.has_unfinished():
                bar.update(len(self.step()))
        return [RequestOutput.from_sequence(self.seqs[i], self.tokenizer) for i in ids]

    def serve(self, workload: Sequence[RequestSpec],
              params: SamplingParams | Callable[[RequestSpec], SamplingParams] | None = None,
              clock: str = "virtual", on_token: Callable[[TokenOutput], None] | None = None,
              progress: bool = True) -> ServeResult:
        """Online: requests arrive at their ``arrival_s`` (Poisson in ``make_workload``) while the engine steps.

        ``params``: one ``SamplingParams``, a function of the ``RequestSpec``, or ``None`` (greedy, exactly
        ``max_new_tokens`` tokens: EOS ignored, as a benchmark wants). ``on_token`` sees every streamed token.
        """
        self.reset(clock)
        pending = sorted(workload, key=lambda r: (r.arrival_s, r.request_id))
        i = 0
        with tqdm(total=len(pending), desc=f"serve ({self.config.scheduler})", unit="req",
                  disable=not progress) as bar:
            while i < len(pending) or self.has_unfinished():
                while i < len(pending) and pending[i].arrival_s <= self.clock.now():
                    r = pending[i]
                    self.add_request(list(r.prompt_ids), _params_for(r, params), r.arrival_s, r.request_id)
                    i += 1
                if not self.has_unfinished():
                    self.clock.wait_until(pending[i].arrival_s)
                    continue
                for out in self.step():
                    bar.update(int(out.finished))
                    if on_token is not None:
                        on_token(out)
        return self.result()

    def result(self) -> ServeResult:
        """Metrics, outputs and statistics of the current run (every request of it finished)."""
        seqs = sorted(self.seqs.values(), key=lambda s: s.seq_id)
        metrics = [s.metrics() for s in seqs]
        if self.device.type == "cuda":
            self.stats.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
        start = min(m.arrival_s for m in metrics)
        makespan = max(m.finish_s for m in metrics) - start
        stats = {**self.stats.to_dict(), **self.scheduler.stats(), "clock": self.clock.name,
                 "makespan_s": makespan, "busy_frac": self.stats.busy_s / makespan if makespan > 0 else math.nan,
                 "peak_kv_bytes": self.scheduler.peak_blocks_used * self.cache.bytes_per_block,
                 "kv_capacity_bytes": self.scheduler.usable_blocks * self.cache.bytes_per_block,
                 "config": asdict(self.config)}
        return ServeResult(metrics, [RequestOutput.from_sequence(s, self.tokenizer) for s in seqs], stats)


def _params_for(spec: RequestSpec, params) -> SamplingParams:
    if params is None:
        return SamplingParams(max_tokens=spec.max_new_tokens, ignore_eos=True)
    if callable(params):
        return params(spec)
    return params
