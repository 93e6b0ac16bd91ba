"""Notebook 06's rank functions for ``labkit.parallel.launch``: each runs on every rank of a process group and
returns a small dict.

They live here, not in the notebook, because spawned ranks import their function by name. Each compares the
parallel run with the single-process model computed on the same rank before sharding, so that a result carries
its own reference: TP layers and the TP / DTensor model (``tp_check``, ``dtensor_check``), collectives
(``comm_check``), pipeline stages (``pp_check``: the stages against the unsharded model) and the schedules' idle
time against ``(p - 1) / (m + p - 1)`` (``pp_bubble``, stage = rank).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.bench import collectives
from labkit.bench.schedules import time_torch_pipelining, timed_schedule
from labkit.evaluate import relative_error
from labkit.parallel import (
    SCHEDULES,
    build_stage,
    gpipe_forward,
    pipeline_generate,
    pipeline_train_step,
    rank_device,
    sync_tied_embeddings,
)


def hello(rank: int, world_size: int, value: float = 1.0) -> dict:
    """Smallest collective: the all-reduced sum of ``value * (rank + 1)`` over ranks."""
    t = torch.tensor([value * (rank + 1)], device=rank_device())
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "sum": t.item()}


def fail_on(rank: int, world_size: int, bad_rank: int = 1) -> dict:
    """Raises on ``bad_rank`` while the others wait in a collective (they must be stopped, not hang)."""
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()
    return {"rank": rank}


def sequence(rank: int, world_size: int, calls: list) -> list:
    """Run several rank functions ``[(fn, args, kwargs), ...]`` in one launch (process start-up dominates small
    checks); returns their results in order."""
    return [fn(rank, world_size, *args, **kwargs) for fn, args, kwargs in calls]


def collectives_check(rank: int, world_size: int) -> dict:
    """Counted collectives (``labkit.bench.collectives.CountingCollectives``) on rank-distinct random data against
    the result computed from every rank's data (regenerated locally from the same seeds), and what they tallied."""
    counted = collectives.CountingCollectives()
    device = rank_device()
    parts = [torch.randn(3, 5, generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    summed = counted.all_reduce(parts[rank].clone().to(device))
    gathered = counted.all_gather(parts[rank].clone().to(device), dim=-1)
    return {"all_reduce_err": relative_error(summed.cpu(), torch.stack(parts).sum(0)),
            "all_gather_err": relative_error(gathered.cpu(), torch.cat(parts, dim=-1)),
            "calls": dict(counted.calls), "bytes": dict(counted.bytes)}


def tp_layers_check(rank: int, world_size: int, seed: int = 0) -> dict:
    """The TP layers alone on irregular shapes (odd input widths, bias, ids spanning every shard) against
    ``nn.Linear``/``nn.Embedding``, forward and input gradient."""
    from torch import nn

    from labkit.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    torch.manual_seed(seed)  # same full layers on every rank
    device, tp = rank_device(), world_size
    col, row = nn.Linear(37, 6 * tp, bias=True).to(device), nn.Linear(6 * tp, 29, bias=True).to(device)
    emb = nn.Embedding(11 * tp, 13).to(device)
    x = torch.randn(3, 7, 37, device=device, requires_grad=True)
    ids = torch.randint(11 * tp, (3, 7), device=device)
    ref = row(torch.relu(col(x)))
    ref.square().sum().backward()
    ref_grad, x.grad = x.grad.clone(), None
    pcol, prow = ColumnParallelLinear.from_linear(col, None), RowParallelLinear.from_linear(row, None)
    gathered = ColumnParallelLinear.from_linear(col, None, gather_output=True)
    out = prow(torch.relu(pcol(x)))
    out.square().sum().backward()
    return {"mlp_rel_err": relative_error(out, ref), "mlp_input_grad_rel_err": relative_error(x.grad, ref_grad),
            "gather_rel_err": relative_error(gathered(x), col(x)),
            "embedding_rel_err": relative_error(VocabParallelEmbedding.from_embedding(emb, None)(ids), emb(ids))}


def load_model_on(model_path, device):
    from labkit.model import load_model

    model, _ = load_model(model_path, device=device)
    return model


def _timed(fn, iters: int) -> float:
    """Median wall seconds of ``fn`` over ``iters`` calls, ranks started together (after one warm-up)."""
    fn()
    samples = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def tp_check(rank: int, world_size: int, prompt_ids: torch.Tensor, max_new_tokens: int = 8,
             check_grad: bool = True, time_iters: int = 0, model_path=None) -> dict:
    """Hand-written TP of the embedded model against the same model unsharded, on every rank.

    Returns the logits' relative error, greedy tokens of both, the collectives of one forward (calls per op),
    gradient errors of a few sharded weights (``check_grad``) and, with ``time_iters``, the TP forward's seconds.
    """
    from labkit.parallel import head_rows, shard_range, tensor_parallel

    device = rank_device()
    model = load_model_on(model_path, device)
    ids = prompt_ids.to(device)
    with torch.no_grad():
        ref_logits = model(ids).logits
    ref_tokens = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    out = {"rank": rank}
    if check_grad:
        ref_grads = _grads(model, ids)
        model.zero_grad(set_to_none=True)
    tensor_parallel(model)
    with torch.no_grad(), collectives.use_collectives(model, collectives.CountingCollectives()) as counted:
        logits = model(ids).logits
    out["collectives_per_forward"] = dict(counted.calls)
    out["bytes_per_forward"] = dict(counted.bytes)
    out["logits_rel_err"] = relative_error(logits, ref_logits)
    out["tokens"] = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False).cpu()
    out["ref_tokens"] = ref_tokens.cpu()
    if time_iters:
        with torch.no_grad():
            out["tp_s"] = _timed(lambda: model(ids), time_iters)
    if check_grad:
        tp_grads = _grads(model, ids)
        q, _, _ = head_rows(model.config, world_size, rank)
        mlp = shard_range(model.config.intermediate_size, world_size, rank)
        vocab = shard_range(model.config.vocab_size, world_size, rank)
        out["grad_rel_err"] = {
            "q_proj": relative_error(tp_grads["q_proj"], ref_grads["q_proj"][q]),
            "down_proj": relative_error(tp_grads["down_proj"], ref_grads["down_proj"][:, mlp]),
            "embed": relative_error(tp_grads["embed"], ref_grads["embed"][vocab]),
            "norm": relative_error(tp_grads["norm"], ref_grads["norm"]),
        }
    return out


def _grads(model, ids: torch.Tensor) -> dict:
    """Gradients of a next-token loss w.r.t. a few weights (layer 0's q_proj, down_proj and norm; the embedding)."""
    logits = model(ids).logits[:, :-1]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    layer = model.model.layers[0]
    return {"q_proj": layer.self_attn.q_proj.weight.grad.clone(), "down_proj": layer.mlp.down_proj.weight.grad.clone(),
            "embed": model.model.embed_tokens.weight.grad.clone(), "norm": layer.input_layernorm.weight.grad.clone()}


def dtensor_check(rank: int, world_size: int, prompt_ids: torch.Tensor, max_new_tokens: int = 8,
                  model_path=None) -> dict:
    """The DTensor plan against the hand-written TP and against the unsharded model: logits and greedy tokens."""
    from labkit.parallel import dtensor_tensor_parallel, tensor_parallel

    device = rank_device()
    model = load_model_on(model_path, device)
    ids = prompt_ids.to(device)
    with torch.no_grad():
        ref = model(ids).logits
    hand, plan = tensor_parallel(copy.deepcopy(model)), dtensor_tensor_parallel(model)
    with torch.no_grad():
        hand_logits, plan_logits = hand(ids).logits, plan(ids).logits
    return {"rank": rank,
            "plan_vs_hand_rel_err": relative_error(plan_logits, hand_logits),
            "plan_vs_single_rel_err": relative_error(plan_logits, ref),
            "tokens_plan": plan.generate(ids, max_new_tokens=max_new_tokens, do_sample=False).cpu(),
            "tokens_hand": hand.generate(ids, max_new_tokens=max_new_tokens, do_sample=False).cpu(),
            "local_q_proj_shape": tuple(plan.model.layers[0].self_attn.q_proj.weight.to_local().shape)}


def comm_check(rank: int, world_size: int, sizes: list[int], iters: int = 5, repeats: int = 3,
               overlap_bytes: int = 1 << 20, overlap_matmul_n: int = 256, ops=collectives.OPS) -> dict:
    """Collective sweep over ``sizes`` plus one overlap measurement; identical on every rank."""
    device = rank_device()
    rows = collectives.sweep(tuple(ops), sizes, device, iters=iters, repeats=repeats)
    overlap = collectives.measure_overlap(overlap_bytes, overlap_matmul_n, device, iters=max(3, iters))
    return {"rank": rank, "rows": rows, "overlap": overlap}



def tp_demo(rank: int, world_size: int) -> dict:
    """``tp_check`` on a fixed prompt, taking only ``(rank, world_size)``: what the ``torchrun`` command line in
    ``labkit.parallel.launch`` runs."""
    prompt = torch.randint(8192, (2, 16), generator=torch.Generator().manual_seed(0))
    res = tp_check(rank, world_size, prompt, max_new_tokens=8, check_grad=False)
    return {"rank": rank, "world_size": world_size, "logits_rel_err": res["logits_rel_err"],
            "tokens_equal": bool(torch.equal(res["tokens"], res["ref_tokens"]))}


# --- pipeline ----------------------------------------------------------------------------------------------
def pp_check(rank: int, world_size: int, prompt_ids: torch.Tensor, max_new_tokens: int = 8,
             num_microbatches: int = 2, train: bool = True, torch_api: bool = True, model_path=None) -> dict:
    """Pipeline stages of the embedded model against the unsharded model: GPipe forward logits, micro-batched
    greedy decoding, ``torch.distributed.pipelining``'s GPipe, and (``train``) gradients under GPipe and 1F1B.
    ``stage_param_bytes``: the weights this rank holds, beside ``model_param_bytes`` of the whole model."""
    device = rank_device()
    model = load_model_on(model_path, device)
    ids = prompt_ids.to(device)
    with torch.no_grad():
        ref_logits = model(ids).logits
    ref_tokens = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False).cpu()
    if train:
        logits = model(ids[:, :-1]).logits
        ref_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        ref_loss.backward()
        names = {id(p): n for n, p in model.named_parameters()}
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    tied_group = dist.new_group([0, world_size - 1]) if world_size > 1 else None  # collective: every rank
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stage = build_stage(model, rank, world_size)
    out = {"rank": rank, "layers": list(stage.layer_ids), "ref_tokens": ref_tokens, "model_param_bytes": model_bytes,
           "stage_param_bytes": sum(p.numel() * p.element_size() for p in stage.parameters())}
    logits, stats = timed_schedule(gpipe_forward, stage, ids, num_microbatches)
    out["forward_stats"] = stats.to_dict()
    if stage.is_last:
        out["logits_rel_err"] = relative_error(logits, ref_logits)
    out["tokens"] = pipeline_generate(stage, ids, max_new_tokens, num_microbatches)
    if torch_api:
        tlogits, secs = time_torch_pipelining(stage, ids, num_microbatches)
        out["torch_pipelining_s"] = secs
        if stage.is_last:
            out["torch_pipelining_rel_err"] = relative_error(tlogits, ref_logits)
    if train:
        for sched in SCHEDULES:
            stage.zero_grad(set_to_none=True)
            loss, st = timed_schedule(pipeline_train_step, stage, ids, num_microbatches, schedule=sched)
            sync_tied_embeddings(stage, tied_group)
            errs = [relative_error(p.grad, ref_grads[names[id(p)]]) for p in stage.parameters()]
            out[f"train_{sched}"] = {"grad_rel_err_max": max(errs), "stats": st.to_dict(),
                                     "loss_rel_err": relative_error(loss, ref_loss) if stage.is_last else None}
    return out


def pp_bubble(rank: int, world_size: int, microbatch_counts: list[int], microbatch_size: int = 2,
              seq_len: int = 64, repeats: int = 3, train: bool = True, model_path=None, seed: int = 0) -> dict:
    """Measured bubble of forward-only GPipe (and, with ``train``, of GPipe and 1F1B training steps) at a fixed
    micro-batch size, so that a stage's work per micro-batch is the same for every ``m``: the formula's setting.

    Per ``m``: this rank's bubble and total seconds (median of ``repeats``), peak in-flight micro-batches and
    activation bytes, and the events of the last repeat (for a timeline plot).
    """
    device = rank_device()
    model = load_model_on(model_path, device)
    stage = build_stage(model, rank, world_size)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for m in microbatch_counts:
        ids = torch.randint(model.config.vocab_size, (m * microbatch_size, seq_len), generator=gen)
        runs = {"forward": lambda ids=ids, m=m: timed_schedule(gpipe_forward, stage, ids, m)[1]}
        if train:
            for sched in SCHEDULES:
                runs[f"train_{sched}"] = lambda ids=ids, m=m, s=sched: timed_schedule(
                    pipeline_train_step, stage, ids, m, schedule=s)[1]
        for kind, run in runs.items():
            run()  # warm-up
            stats = sorted((run() for _ in range(repeats)), key=lambda s: s.total_s)
            med = stats[len(stats) // 2]
            stage.zero_grad(set_to_none=True)
            rows.append({"kind": kind, "m": m, "stage": rank, "bubble": med.bubble, "total_s": med.total_s,
                         "busy_s": med.busy_s, "peak_inflight": med.peak_inflight,
                         "peak_activation_bytes": med.peak_activation_bytes, "events": med.events})
    return {"rank": rank, "layers": list(stage.layer_ids), "rows": rows}
