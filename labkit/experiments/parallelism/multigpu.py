"""Multi-GPU measurements (NCCL bandwidth, TP decode, PP bubble) as functions that every rank calls: notebook 06's
questions at full size on real GPUs.

``scripts/bench_multigpu.py`` is the command line (run by ``torchrun``); the same code runs on gloo CPU ranks with
tiny shapes, which is how it is tested. Sub-groups ``ranks 0..k-1`` give TP/PP degrees below the world size; every
rank calls every function in the same order (group creation is collective) and ranks outside a group wait.

Full-size shapes come from ``ModelConfig`` presets with random weights, built on the meta device, sharded, then
materialised directly on the GPU, so a 70B shape never exists whole on one device.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

from labkit.bench import collectives
from labkit.bench.schedules import timed_schedule
from labkit.model import get_config
from labkit.parallel import (
    allowed_tp_sizes,
    bubble_formula,
    build_stage,
    cost_model,
    gpipe_forward,
    pipeline_generate,
    rank_device,
    tensor_parallel,
)

_GROUPS: dict = {}


def group_of(size: int, tag: str = "a"):
    """The process group of ranks ``0..size-1`` (one per ``(size, tag)``, created collectively on first use)."""
    if (size, tag) not in _GROUPS:
        _GROUPS[(size, tag)] = dist.new_group(list(range(size)))
    return _GROUPS[(size, tag)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Return the last model's (and its CUDA graphs') memory before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _max_over(value: float, device: torch.device, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


# --- random full-size shapes, sharded before they exist ---------------------------------------------------------
def _materialise(module: torch.nn.Module, owner, config, device: torch.device, seed: int) -> None:
    """Allocate ``module``'s meta parameters on ``device``: N(0, 0.02) matrices, unit norm weights, fresh RoPE."""
    module.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    with torch.device(device):  # non-persistent buffers (inv_freq) are garbage after to_empty: rebuild them
        owner.rotary_emb = type(owner.rotary_emb)(config=config)


def _meta_model(preset: str, num_layers: int | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    spec = get_config(preset)
    spec = replace(spec, num_layers=num_layers, layer_types=spec.layer_types[:num_layers]) if num_layers else spec
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=dtype), spec


def _check_fits(nbytes: float, device: torch.device, what: str) -> None:
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if nbytes > 0.85 * free:
            raise MemoryError(f"{what} needs {nbytes / 1e9:.1f} GB per GPU, {free / 1e9:.1f} GB free")


def random_tp_model(preset: str, group, device: torch.device, num_layers: int | None = None,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A ``preset``-shaped Llama with random weights, tensor-parallel over ``group`` (unsharded for one rank)."""
    model, spec = _meta_model(preset, num_layers, dtype)
    tp = dist.get_world_size(group) if group is not None else 1
    need = cost_model.memory_per_device(spec, tp, 1, 0, dtype=str(dtype).split(".")[-1])["weights"]
    _check_fits(need, device, f"{preset} ({spec.num_layers} layers) at tp={tp}")
    if tp > 1:
        tensor_parallel(model, group)
    _materialise(model, model.model, model.config, device, seed)
    return model.eval()


def random_stage(preset: str, stage_index: int, num_stages: int, group, device: torch.device,
                 num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """This rank's pipeline stage of a ``preset``-shaped Llama with random weights (only the stage is allocated)."""
    model, _ = _meta_model(preset, num_layers, dtype)
    stage = build_stage(model, stage_index, num_stages, group=group)
    _materialise(stage, stage, model.config, device, seed + stage_index)
    return stage.eval()


# --- communication ------------------------------------------------------------------------------------------
def comm_section(device: torch.device, sizes: list[int], iters: int = 10, repeats: int = 3,
                 group_sizes: tuple[int, ...] = ()) -> dict:
    """nccl-tests-style sweep of all-reduce, all-gather and ring send/recv on all ranks, plus all-reduce and
    all-gather on the sub-groups ``group_sizes``; alpha-beta fits per (op, ranks). Complete on rank 0."""
    rows = collectives.sweep(collectives.OPS, sizes, device, iters=iters, repeats=repeats,
                             progress=dist.get_rank() == 0)
    for g in group_sizes:
        grp = group_of(g)
        if dist.get_rank() < g:
            rows += collectives.sweep(("all_reduce", "all_gather"), sizes, device, iters=iters, repeats=repeats,
                                      group=grp)
        dist.barrier()
    fits = {}
    for op, n in {(r["op"], r["world_size"]) for r in rows}:
        pts = [(r["bytes"], r["seconds"]) for r in rows if r["op"] == op and r["world_size"] == n]
        try:
            alpha, beta = collectives.fit_alpha_beta(*zip(*pts, strict=True))
            fits[f"{op}@{n}"] = {"alpha_s": alpha, "beta_bytes_per_s": beta}
        except ValueError as e:  # noisy timings (a busy CPU host): keep the rows, say why there is no fit
            fits[f"{op}@{n}"] = {"error": str(e)}
    return {"rows": rows, "fits": fits}


# --- tensor-parallel decode ------------------------------------------------------------------------------------
def _time_steps(calls: list, device: torch.device, iters: int, group, concurrent: bool = False) -> float:
    """Seconds per round of ``calls`` (each one decode step), the same ``iters`` on every rank, max over ``group``.
    ``concurrent`` (CUDA): each call on its own stream, so one call's communication can overlap another's compute.
    """
    for c in calls:
        c()
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    if device.type == "cuda" and concurrent:
        streams, cur = [torch.cuda.Stream(device) for _ in calls], torch.cuda.current_stream(device)
        for _ in range(iters):
            for s, c in zip(streams, calls, strict=True):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    c()
            for s in streams:
                cur.wait_stream(s)
    else:
        for _ in range(iters):
            for c in calls:
                c()
    _sync(device)
    return _max_over((time.perf_counter() - t0) / iters, device, group)


def _under(ctx_fn, step):
    """A call of ``step.step()`` inside the context ``ctx_fn()`` (for eager steps; graphs captured it already)."""
    def call():
        with ctx_fn():
            return step.step()
    return call


def tp_decode_row(preset: str, tp: int, batch: int, context: int, device: torch.device, num_layers: int | None,
                  iters: int, cuda_graph: bool, overlap: bool, fits: dict | None, dtype=torch.bfloat16) -> dict:
    """One TP decode measurement on ranks ``0..tp-1``: step time, with communication skipped, and split into
    two half-batches run serially or concurrently on two communicators. Called by the group's ranks only."""
    from labkit.experiments.decode_step import StaticDecodeStep

    g = group_of(tp)
    model = random_tp_model(preset, g if tp > 1 else None, device, num_layers, dtype)
    layers = model.config.num_hidden_layers

    def step(b: int, ctx_fn):
        with ctx_fn():
            s = StaticDecodeStep(model, b, context, cuda_graph=cuda_graph)
        return _under(ctx_fn, s)

    full = step(batch, nullcontext)
    row = {"preset": preset, "layers": layers, "tp": tp, "batch": batch, "context": context,
           "graph": cuda_graph and device.type == "cuda"}
    row["step_s"] = _time_steps([full], device, iters, g)
    row["tokens_per_s"] = batch / row["step_s"]
    if tp > 1:
        skipped = step(batch, lambda: collectives.use_collectives(model, collectives.SkippedCollectives()))
        row["step_nocomm_s"] = _time_steps([skipped], device, iters, g)
        row["comm_s"] = max(row["step_s"] - row["step_nocomm_s"], 0.0)
        row["comm_frac"] = row["comm_s"] / row["step_s"]
        if overlap and batch >= 2:
            gb = group_of(tp, "b")
            halves = [step(batch // 2, nullcontext),
                      step(batch // 2, lambda: collectives.use_collectives(model, collectives.Collectives(gb)))]
            row["split_serial_s"] = _time_steps(halves, device, iters, g)
            row["split_overlap_s"] = _time_steps(halves, device, iters, g, concurrent=True)
            row["overlap_saving_frac"] = 1 - row["split_overlap_s"] / row["split_serial_s"]
        row.update(_predicted_comm(preset, layers, tp, batch, fits, dtype))
        if row.get("predicted_comm_fitted_s"):
            row["fitted_model_rel_err"] = row["predicted_comm_fitted_s"] / max(row["comm_s"], 1e-12) - 1
        row["datasheet_model_rel_err"] = row["predicted_comm_datasheet_s"] / max(row["comm_s"], 1e-12) - 1
    return row


def tp_row_check(rank: int, world_size: int, preset: str = "llama-3-8b", num_layers: int = 2, batch: int = 2,
                 context: int = 64, iters: int = 3, cuda_graph: bool = True, dtype: torch.dtype = torch.bfloat16
                 ) -> dict:
    """One ``tp_decode_row`` at ``tp = world_size`` (a rank function for ``launch``: tests, a first run on a new
    machine). Returns the row on every rank."""
    group_of(world_size), group_of(world_size, "b")
    return tp_decode_row(preset, world_size, batch, context, rank_device(), num_layers, iters, cuda_graph,
                         overlap=world_size > 1, fits=None, dtype=dtype)


def _predicted_comm(preset: str, layers: int, tp: int, batch: int, fits: dict | None, dtype) -> dict:
    """The cost model's TP communication time per step: with the NVLink datasheet link, and with the alpha-beta
    fitted to this machine's all-reduce/all-gather at ``tp`` ranks (when the comm section ran)."""
    spec = get_config(preset)
    spec = replace(spec, num_layers=layers, layer_types=spec.layer_types[:layers])
    name = str(dtype).split(".")[-1]
    c = cost_model.tp_comm(spec, tp, batch, "nvlink4", name)
    out = {"predicted_comm_datasheet_s": c["time_s"]}
    ar, ag = (fits or {}).get(f"all_reduce@{tp}"), (fits or {}).get(f"all_gather@{tp}")
    if ar and ag and "alpha_s" in ar and "alpha_s" in ag:
        out["predicted_comm_fitted_s"] = (
            c["all_reduces"] * (ar["alpha_s"] + c["all_reduce_bytes"] / ar["beta_bytes_per_s"])
            + ag["alpha_s"] + c["all_gather_bytes"] / ag["beta_bytes_per_s"])
    return out


def tp_section(device: torch.device, presets: list[tuple[str, int | None]], tp_sizes: list[int],
               batches: list[int], context: int, iters: int = 20, cuda_graph: bool = True, overlap: bool = True,
               fits: dict | None = None, on_row=None, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """TP decode rows for every ``(preset, num_layers)``, TP size (those the shape allows, <= world) and batch."""
    rows, rank, world = [], dist.get_rank(), dist.get_world_size()
    for preset, layers in presets:
        config = get_config(preset).to_hf_config()
        for tp in [t for t in tp_sizes if t <= world and t in allowed_tp_sizes(config)]:
            group_of(tp), group_of(tp, "b")  # collective creation, every rank
            for batch in batches:
                if rank < tp:
                    try:
                        row = tp_decode_row(preset, tp, batch, context, device, layers, iters, cuda_graph,
                                            overlap, fits, dtype)
                    except MemoryError as e:  # every rank of the group sees the same shape, so all skip
                        row = {"preset": preset, "layers": layers, "tp": tp, "batch": batch, "skipped": str(e)}
                    _free(device)
                    if rank == 0:
                        rows.append(row)
                        if on_row:
                            on_row(rows)
                dist.barrier()
    return rows


# --- pipeline ---------------------------------------------------------------------------------------------------
def pp_section(device: torch.device, preset: str, pp_sizes: list[int], microbatch_counts: list[int],
               microbatch_size: int, seq_len: int, repeats: int = 3, num_layers: int | None = None,
               decode_tokens: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Forward-only GPipe throughput and measured bubble at each ``pp`` and micro-batch count (micro-batch size
    fixed, so per-stage work per micro-batch is constant), against ``(p-1)/(m+p-1)``; optionally eager greedy
    decode throughput at ``m = 1`` and ``m = p``. Rows complete on rank 0."""
    rows, rank, world = [], dist.get_rank(), dist.get_world_size()
    for p in [q for q in pp_sizes if 2 <= q <= world]:
        g = group_of(p)
        if rank < p:
            stage = random_stage(preset, rank, p, g, device, num_layers, dtype)
            gen = torch.Generator().manual_seed(p)
            for m in microbatch_counts:
                ids = torch.randint(stage.config.vocab_size, (m * microbatch_size, seq_len), generator=gen)
                gpipe_forward(stage, ids, m)  # warm-up
                runs = sorted((timed_schedule(gpipe_forward, stage, ids, m)[1] for _ in range(repeats)),
                              key=lambda s: s.total_s)
                med = runs[len(runs) // 2]
                per_stage = [None] * p
                dist.all_gather_object(per_stage, (med.bubble, med.total_s, med.busy_s), group=g)
                total = max(s[1] for s in per_stage)
                rows.append({"kind": "forward", "pp": p, "m": m, "microbatch_size": microbatch_size,
                             "seq_len": seq_len, "layers": stage.config.num_hidden_layers,
                             "bubble_measured": sum(s[0] for s in per_stage) / p,
                             "bubble_per_stage": [s[0] for s in per_stage], "busy_s": [s[2] for s in per_stage],
                             "bubble_formula": bubble_formula(p, m), "total_s": total,
                             "tokens_per_s": m * microbatch_size * seq_len / total})
            for m in (sorted({1, p}) if decode_tokens else []):
                ids = torch.randint(stage.config.vocab_size, (p * microbatch_size, 16), generator=gen)
                pipeline_generate(stage, ids, 2, m)  # warm-up
                _sync(device)
                dist.barrier(group=g)
                t0 = time.perf_counter()
                pipeline_generate(stage, ids, decode_tokens, m)
                secs = _max_over(time.perf_counter() - t0, device, g)
                rows.append({"kind": "decode", "pp": p, "m": m, "batch": ids.shape[0], "new_tokens": decode_tokens,
                             "seconds": secs, "tokens_per_s": ids.shape[0] * decode_tokens / secs})
            del stage
            _free(device)
        dist.barrier()
    return rows if rank == 0 else []
