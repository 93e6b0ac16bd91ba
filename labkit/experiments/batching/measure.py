"""The measurements of notebook 05 and ``python -m labkit bench serve|decode``: each runs the real engine (or HF
``generate``) and returns plain rows, so the notebook only arranges and plots them.

* ``check_greedy_vs_hf``: engine output against HF ``generate`` per prompt, for several engine configurations
* ``check_graph_replays``: decode steps replayed from CUDA graphs against the same steps run eagerly (run it
  before timing anything with graphs)
* ``decode_rate``: steady-state decode tokens/s at a batch size through ``LLMEngine.step`` (end to end), and
  the device time of one captured step replayed alone
* ``runner_step``: one engine forward (a decode step of a batch at a context, or one prefill) as a callable, on
  a cache filled without a prefill, for sweeps of step time over batch, context and precision
* ``profile_engine_decode``: a profiler trace of decode steps, eager or replayed from CUDA graphs (``decode_rate``
  profiles its own engine's steps too, for ``attribution``: where the step's time goes, part by part)
* ``serve_sweep``: policies x offered loads on one workload (Poisson arrivals), with latency percentiles,
  inter-token gaps, throughput, busy fraction and memory
* ``fifo_sweep``: the FIFO engine run once with every request queued, its per-request service replayed at each
  arrival rate (a FIFO server's service of a request does not depend on when it arrived)

The offline comparison with HF ``generate`` (every request served on both sides, HF in each of its modes) is
``labkit.experiments.baseline.offline_throughput``: nothing is extrapolated from a batch.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from functools import partial

import torch
from tqdm.auto import tqdm

from labkit.bench import time_fn
from labkit.bench.serving import SLO, percentile, serve, summarize
from labkit.bench.workload import LengthDist, RequestSpec, at_rate, make_workload
from labkit.checks import check_int
from labkit.engine import LLMEngine, ModelRunner, SamplingParams, default_graph_batch_sizes
from labkit.evaluate import relative_error
from labkit.experiments.baseline import Execution, replay_fifo
from labkit.kvcache import PagedKVCache, SeqBlocks
from labkit.model import FusionPlan
from labkit.profiling import ProfileResult, profile_run


def free_device_memory() -> None:
    """Drop unreferenced engines' caches and graphs before the next engine sizes its KV cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- correctness ------------------------------------------------------------------------------------------------
def hf_greedy(model, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """HF ``generate``'s greedy continuation of one prompt alone (EOS ignored)."""
    dev = next(model.parameters()).device
    out = model.generate(torch.tensor([list(prompt)], device=dev), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_greedy_vs_hf(model, prompts: Sequence[Sequence[int]], max_tokens: int, configs: dict[str, dict],
                       tokenizer=None) -> list[dict]:
    """For each named engine configuration: do all greedy outputs equal HF ``generate``'s, token for token?"""
    refs = [hf_greedy(model, p, max_tokens) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for name, kw in configs.items():
        engine = LLMEngine(model, tokenizer, **kw)
        outs = engine.generate(prompts, params, progress=False)
        st = engine.run_stats()
        same = [o.output_token_ids == r for o, r in zip(outs, refs)]
        rows.append({"config": name, "requests": len(prompts), "equal_to_hf": sum(same), "all_equal": all(same),
                     "preemptions": st["preemptions"], "steps": st["steps"],
                     "prefix_hit_tokens": st["prefix_hit_tokens"],
                     "max_batch": st["peak_running"], "kernels": "triton" if engine.runner.use_triton else "torch",
                     "cuda_graph_steps": st["graph_steps"]})
        del engine
        free_device_memory()
    return rows


@torch.inference_mode()
def check_graph_replays(model, batch_sizes: Sequence[int] = (3, 1, 2, 4), rounds: int = 3, prompt_len: int = 40,
                        seed: int = 0, runner: ModelRunner | None = None, label: str = "") -> list[dict]:
    """Decode steps replayed from CUDA graphs against the same steps run eagerly: run it before any graph is timed.

    ``runner`` (default: a fresh ``ModelRunner`` on ``model`` with graphs for ``default_graph_batch_sizes(max(
    batch_sizes))`` and a small cache of its own) prefills ``max(batch_sizes)`` random prompts of about
    ``prompt_len`` tokens, then runs ``rounds`` rounds of one decode step per entry of ``batch_sizes`` (the first
    sequences of the batch; 3 replays the graph of 4 with a padding row), so every step feeds new tokens, positions,
    slots and context lengths. Each step's reference is the runner's eager ``forward`` of the same padded input
    (same shapes, same kernels: a correct replay is off by rounding at most, a broken one by O(1)). Every step's
    logits as ``execute`` returned them are kept until all steps ran, so logits that a later replay overwrote fail
    too. Returns one row per step: model, round, batch, graph, relative_error, finite, bound (the dtype's test
    tolerance: 1e-5 in float32, else 1e-2), ok."""
    n = max(batch_sizes)
    if runner is None:
        max_len = prompt_len + rounds * len(batch_sizes) + 1
        cache = PagedKVCache.for_model(model, num_blocks=n * -(-max_len // 16) + 2, block_size=16)  # + scratch
        runner = ModelRunner(model, cache, cuda_graphs=True, max_num_seqs=n, max_model_len=max_len,
                             graph_batch_sizes=default_graph_batch_sizes(n))
    if runner.graphs is None or runner.graphs.bucket(n) is None:
        raise ValueError(f"runner has graphs for {runner.graph_batch_sizes}; batch_sizes={list(batch_sizes)} need "
                         f"one of at least {n}")
    cache, vocab = runner.cache, model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    # lengths differ by sequence: so do their contexts and block tables
    seqs = [SeqBlocks(torch.randint(3, vocab, (max(1, prompt_len - 7 * i),), generator=g).tolist(), ("graph-check", i))
            for i in range(n)]
    for seq in seqs:
        cache.allocate(seq)
    runner.execute(seqs, [s.num_tokens for s in seqs], 0)
    for seq in seqs:
        cache.mark_computed(seq, seq.num_tokens)
    kept = []
    for r in range(rounds):
        for b in batch_sizes:
            sub, bucket = seqs[:b], runner.graphs.bucket(b)
            for seq in sub:
                seq.token_ids += torch.randint(3, vocab, (1,), generator=g).tolist()
                cache.append_slots(seq)
            ref = runner.forward(runner.prepare(sub, [1] * b, b, pad_to=bucket, width=runner.max_blocks))[:b].clone()
            kept.append((r, b, bucket, ref, runner.execute(sub, [1] * b, b)))
            for seq in sub:
                cache.mark_computed(seq, seq.num_tokens)
    for seq in seqs:
        cache.free(seq)
    bound = 1e-5 if runner.dtype == torch.float32 else 1e-2
    rows = []
    for r, b, bucket, ref, got in kept:
        err, finite = relative_error(got, ref), bool(torch.isfinite(got).all())
        rows.append({"model": label, "round": r, "batch": b, "graph": bucket, "relative_error": err,
                     "finite": finite, "bound": bound, "ok": finite and err <= bound})
    return rows


# --- decode speed -----------------------------------------------------------------------------------------------
def _prompts(n: int, length: int, source, seed: int) -> list[list[int]]:
    wl = make_workload(n, math.inf, LengthDist.fixed(length), LengthDist.fixed(1), source, seed=seed)
    return [list(r.prompt_ids) for r in wl]


def _prefilled_engine(model, batch_size: int, context: int, max_tokens: int, source, seed: int,
                      **engine_kwargs) -> LLMEngine:
    """An engine holding ``batch_size`` requests of ``context``-token prompts, all prefilled (first token out)."""
    kw = dict(max_num_seqs=batch_size, max_num_batched_tokens=max(batch_size, min(batch_size * context, 8192)),
              max_model_len=context + max_tokens + 1)
    kw.update(engine_kwargs)
    engine = LLMEngine(model, **kw)
    engine.reset()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in _prompts(batch_size, context, source, seed):
        engine.add_request(p, params)
    while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
        engine.step()
    return engine


def decode_rate(model, batch_size: int, context: int, steps: int, source, warmup: int = 3, seed: int = 0,
                replay: bool = True, profile_steps: int = 0, **engine_kwargs) -> dict:
    """Decode tokens/s at ``batch_size`` sequences of ``context`` prompt tokens, timed over ``steps`` steps of
    ``LLMEngine.step`` (scheduling, input preparation, the forward, sampling: end to end), after ``warmup``.
    On CUDA with graphs, ``replay_step_s`` is also the median device time of the captured step replayed alone, and
    ``graph_step_frac`` the share of the timed steps that replayed a graph.
    With ``async_scheduling=True`` among ``engine_kwargs`` each call launches a step and reads the previous one's
    tokens: in the steady state its time is the pipeline's period, timed the same way (``async_scheduling`` in the
    row says which). ``profile_steps``: then that many more steps of the same engine under ``profile_run`` (with
    scopes on the CPU), in ``row['profile']`` (a ``ProfileResult``, not JSON: ``attribution.decode_attribution``
    turns it into a table; drop it before writing the row), ``row['profile_context']`` the mean context of those
    steps."""
    check_int("profile_steps", profile_steps, 0)
    engine = _prefilled_engine(model, batch_size, context, warmup + steps + 2 + profile_steps, source, seed,
                               **engine_kwargs)
    for _ in range(warmup):
        engine.step()
    times, replayed = [], engine.stats.graph_steps
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    row = {"batch": batch_size, "context": context + warmup + steps // 2, "steps": steps,
           "tok_s": batch_size * steps / sum(times), "step_median_s": sorted(times)[len(times) // 2],
           "cuda_graphs": bool(engine.runner.graph_batch_sizes), "kernels": "triton" if engine.runner.use_triton
           else "torch", "async_scheduling": engine.config.async_scheduling,
           # the timed steps that replayed a graph: an eager step among them is not the replayed step's time
           "graph_step_frac": (engine.stats.graph_steps - replayed) / steps, "replay_step_s": None,
           "graph_pool_bytes": engine.runner.graphs.pool_bytes if engine.runner.graph_batch_sizes else None}
    if replay and engine.runner.graph_batch_sizes:
        graphs = engine.runner.graphs  # the captured decode step of this batch, on whatever its buffers hold
        replay_fn = graphs.graphs[graphs.lookup(batch_size, batch_size, batch_size)].replay
        row["replay_step_s"] = time_fn(replay_fn, device=engine.device, warmup=3, iters=max(steps, 10)).median_s
        del replay_fn
    if profile_steps:
        row["profile"] = profile_run(partial(_steps, engine, profile_steps), steps=profile_steps, warmup=0,
                                     scopes=engine.device.type == "cpu")  # (callers name the CPU's plain ops)
        row["profile_context"] = context + warmup + steps + (profile_steps + 1) // 2
    del engine
    free_device_memory()
    return row


# The A/B names notebook 04 records its rows under -> the FusionPlan field each turns off (``FusionPlan.without``:
# with what depends on it).
PLAN_OPTIONS = {"fuse_layer_ops": "quant_epilogues", "fuse_qkv_rope": "qkv_rope_cache", "gemv_pdl": "gemv_pdl"}


def plan_options(model, **options) -> FusionPlan:
    """The default ``FusionPlan`` of ``model``'s device with the A/B switches of ``PLAN_OPTIONS`` applied (False
    turns the fusion off, True keeps the default)."""
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        raise ValueError(f"options {unknown} are unknown; allowed: {sorted(PLAN_OPTIONS)}")
    plan = FusionPlan.for_device(next(model.parameters()).device)
    return plan.without(*(PLAN_OPTIONS[name] for name, on in options.items() if not on))


def runner_step(model, phase: str, batch_size: int, context: int, block_size: int = 16, seed: int = 0,
                **runner_options):
    """A callable running one forward of the engine's ``ModelRunner`` and the runner it uses.

    ``phase='decode'``: ``batch_size`` sequences holding ``context`` cached tokens each gain one, replayed from the
    runner's CUDA graph for that batch where it captures one (eager otherwise). ``phase='prefill'``: one prompt of
    ``context`` tokens (``batch_size`` must be 1). The cached K/V are whatever the new cache holds rather than a
    real prompt's (a step's time does not depend on the values), so a point of a sweep costs no prefill. Each call
    rewrites the same slots: time it as often as needed. ``runner_options``: A/B switches of the device's
    ``FusionPlan`` (``plan_options``; for example ``fuse_layer_ops=False``).
    """
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase={phase!r}; allowed: 'decode', 'prefill'")
    if batch_size < 1 or context < 1 or (phase == "prefill" and batch_size != 1):
        raise ValueError(f"batch_size={batch_size} and context={context} must be >= 1 (batch_size 1 for prefill)")
    runner_options = {"kernels": plan_options(model, **runner_options)} if runner_options else {}
    total = context + (phase == "decode")
    blocks = batch_size * -(-total // block_size) + 1  # + the graphs' scratch block
    cache = PagedKVCache.for_model(model, num_blocks=blocks, block_size=block_size)
    for pool in cache.k_caches + cache.v_caches:
        pool.zero_()  # finite values where a prompt's K/V would be
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (total,), generator=g).tolist()
    if phase == "prefill":
        runner = ModelRunner(model, cache, cuda_graphs=False, max_num_seqs=1, max_model_len=total, **runner_options)
        seq = SeqBlocks(ids, 0)
        cache.allocate(seq)
        return partial(_inference, runner.forward, runner.prepare([seq], [context], 0)), runner
    runner = ModelRunner(model, cache, max_num_seqs=batch_size, max_model_len=total,
                         graph_batch_sizes=[batch_size] if cache.device.type == "cuda" else None, **runner_options)
    seqs = [SeqBlocks(ids, i) for i in range(batch_size)]
    for seq in seqs:  # every token but the last computed: the step decodes it
        cache.allocate(seq)
        cache.mark_computed(seq, context)
    if runner.graph_batch_sizes:
        longs, ints = runner.pack_for_graphs(seqs, [1] * batch_size)  # fed as the engine feeds a step
        key = runner.graphs.lookup(batch_size, batch_size, batch_size)
        return partial(runner.graphs.run_packed, longs, ints, key, batch_size), runner
    return partial(_inference, runner.forward, runner.prepare(seqs, [1] * batch_size, batch_size)), runner


@torch.inference_mode()
def _inference(fn, *args):
    return fn(*args)


def _steps(engine: LLMEngine, n: int) -> None:
    for _ in range(n):
        engine.step()


def profile_engine_decode(model, batch_size: int, context: int, steps: int, source, cuda_graphs: bool,
                   trace_path: str | None = None, seed: int = 0, **engine_kwargs) -> ProfileResult:
    """A profiler trace of ``steps`` decode steps of the engine, eager or from CUDA graphs."""
    engine = _prefilled_engine(model, batch_size, context, 2 * steps + 4, source, seed, cuda_graphs=cuda_graphs,
                               **engine_kwargs)
    run = partial(_steps, engine, steps)
    result = profile_run(run, steps=steps, trace_path=trace_path, warmup=1)
    del run, engine
    free_device_memory()
    return result


# --- serving ----------------------------------------------------------------------------------------------------
def token_gaps(metrics) -> list[float]:
    """Every gap between consecutive tokens of a request (the inter-token latency a user sees), all requests."""
    return [b - a for m in metrics for a, b in zip(m.token_times_s, m.token_times_s[1:])]


def serve_row(result, slo: SLO | None = None) -> dict:
    """``summarize``'s latency and throughput figures plus inter-token gaps, busy fraction, preemptions, memory."""
    s = summarize(result.metrics, slo)
    gaps = token_gaps(result.metrics)
    st = result.stats
    s.update(itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99), itl_max_s=max(gaps, default=math.nan),
             busy_frac=st["busy_frac"], steps=st["steps"], preemptions=st["preemptions"],
             mean_batch=st["scheduled_seqs"] / max(1, st["steps"]), peak_kv_bytes=st["peak_kv_bytes"],
             kv_capacity_bytes=st["kv_capacity_bytes"], peak_device_bytes=st["peak_device_bytes"],
             graph_steps=st["graph_steps"])
    return s


def _warm(engine: LLMEngine, workload: list[RequestSpec], warmup: bool | None, seed: int) -> None:
    """Serve ``workload`` once, untimed, where kernels compile on first use (CUDA: Triton compiles and autotunes
    each new shape bucket of the prefill and decode kernels, seconds that would otherwise land inside the timed
    steps as false latency). ``warmup=None``: on CUDA only."""
    if warmup or (warmup is None and engine.device.type == "cuda"):
        serve(engine, at_rate(workload, math.inf, seed=seed), progress=False)


def serve_sweep(model, workload: list[RequestSpec], policies: dict[str, dict], rates: Sequence[float],
                slo: SLO | None = None, progress: bool = True, seed: int = 0,
                warmup: bool | None = None) -> list[dict]:
    """Serve ``workload`` at each arrival rate (requests/s; ``math.inf``: all at once) under each policy (engine
    keyword arguments). One engine per policy, reused across rates, warmed up first (``_warm``). Returns one row
    per (policy, rate)."""
    rows = []
    for name, kw in policies.items():
        engine = LLMEngine(model, **kw)
        _warm(engine, workload, warmup, seed)
        for rate in tqdm(rates, desc=name, disable=not progress):
            res = serve(engine, at_rate(workload, rate, seed=seed), progress=False)
            rows.append({"policy": name, "rate_req_s": rate, **serve_row(res, slo)})
        del engine
        free_device_memory()
    return rows


def fifo_executions(result) -> dict[int, Execution]:
    """Each request's service in a FIFO run with every request queued at once: token times relative to its start
    (the previous request's last token: the engine steps back to back), and its total service time."""
    out, start = {}, 0.0
    for m in sorted(result.metrics, key=lambda m: m.finish_s):
        out[m.request_id] = Execution(1, [t - start for t in m.token_times_s], m.finish_s - start)
        start = m.finish_s
    return out


def fifo_sweep(model, workload: list[RequestSpec], loads: Sequence[float], slo: SLO | None = None,
               seed: int = 0, warmup: bool | None = None, **engine_kwargs) -> tuple[list[dict], float]:
    """FIFO at each offered load (a multiple of the FIFO capacity; ``math.inf``: all queued at once) from one
    engine run with every request queued (after a warm-up, ``_warm``), whose throughput is the capacity: the
    measured services are replayed through ``baseline.replay_fifo`` at each rate. Returns the rows (as
    ``serve_sweep``'s) and the capacity in requests/s."""
    engine = LLMEngine(model, **dict(engine_kwargs, scheduler="fifo"))
    _warm(engine, workload, warmup, seed)
    offline = serve(engine, at_rate(workload, math.inf, seed=seed), progress=False)
    del engine
    free_device_memory()
    ex = fifo_executions(offline)
    busy = sum(e.total_s for e in ex.values())
    capacity = len(workload) / busy
    rows = []
    for load in loads:
        wl = at_rate(workload, load * capacity, seed=seed)
        replayed = type(offline)(replay_fifo(wl, ex), offline.outputs, dict(offline.stats))
        replayed.stats["makespan_s"] = max(m.finish_s for m in replayed.metrics) - min(r.arrival_s for r in wl)
        replayed.stats["busy_frac"] = busy / replayed.stats["makespan_s"]
        rows.append({"policy": "FIFO", "rate_req_s": load * capacity, **serve_row(replayed, slo)})
    return rows, capacity
