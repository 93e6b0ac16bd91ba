"""Rank functions for the pipeline (run by ``launch`` on every rank of the world, stage = rank).

``pp_check`` compares the stages with the unsharded model computed on the same rank before splitting;
``pp_bubble`` measures the schedules' idle time against ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.evaluate import relative_error
from labkit.parallel.experiments import load_model_on
from labkit.parallel.launch import rank_device


def pp_check(rank: int, world_size: int, prompt_ids: torch.Tensor, max_new_tokens: int = 8,
             num_microbatches: int = 2, train: bool = True, torch_api: bool = True, model_path=None) -> dict:
    """Pipeline stages of the embedded model against the unsharded model: GPipe forward logits, micro-batched
    greedy decoding, ``torch.distributed.pipelining``'s GPipe, and (``train``) gradients under GPipe and 1F1B."""
    from labkit.parallel.pipeline import build_stage, pipeline_generate, sync_tied_embeddings
    from labkit.parallel.schedules import SCHEDULES, gpipe_forward, torch_pipelining_forward, train_step

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
    stage = build_stage(model, rank, world_size)
    out = {"rank": rank, "layers": list(stage.layer_ids), "ref_tokens": ref_tokens}
    logits, stats = gpipe_forward(stage, ids, num_microbatches)
    out["forward_stats"] = stats.to_dict()
    if stage.is_last:
        out["logits_rel_err"] = relative_error(logits, ref_logits)
    out["tokens"] = pipeline_generate(stage, ids, max_new_tokens, num_microbatches)
    if torch_api:
        tlogits, secs = torch_pipelining_forward(stage, ids, num_microbatches)
        out["torch_pipelining_s"] = secs
        if stage.is_last:
            out["torch_pipelining_rel_err"] = relative_error(tlogits, ref_logits)
    if train:
        for sched in SCHEDULES:
            stage.zero_grad(set_to_none=True)
            loss, st = train_step(stage, ids, num_microbatches, sched)
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
    from labkit.parallel.pipeline import build_stage
    from labkit.parallel.schedules import SCHEDULES, gpipe_forward, train_step

    device = rank_device()
    model = load_model_on(model_path, device)
    stage = build_stage(model, rank, world_size)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for m in microbatch_counts:
        ids = torch.randint(model.config.vocab_size, (m * microbatch_size, seq_len), generator=gen)
        runs = {"forward": lambda ids=ids, m=m: gpipe_forward(stage, ids, m)[1]}
        if train:
            for sched in SCHEDULES:
                runs[f"train_{sched}"] = lambda ids=ids, m=m, s=sched: train_step(stage, ids, m, s)[1]
        for kind, run in runs.items():
            run()  # warm-up
            stats = sorted((run() for _ in range(repeats)), key=lambda s: s.total_s)
            med = stats[len(stats) // 2]
            stage.zero_grad(set_to_none=True)
            rows.append({"kind": kind, "m": m, "stage": rank, "bubble": med.bubble, "total_s": med.total_s,
                         "busy_s": med.busy_s, "peak_inflight": med.peak_inflight,
                         "peak_activation_bytes": med.peak_activation_bytes, "events": med.events})
    return {"rank": rank, "layers": list(stage.layer_ids), "rows": rows}
