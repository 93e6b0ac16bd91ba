"""Probe the causes of three gpu-profile failures (notebooks 02, 05, 07) on one GPU, each stage on its own.

* ``prefix``: notebook 02's prefix-caching cell (embedded model, fp32, CUDA) with and without prefix caching, for
  each kernel plan ('torch', 'triton') and with CUDA graphs off and on: are the outputs token-equal, and where do
  the logits first differ?
* ``pad``: notebook 05's CUDA-graph check at batch 3 replayed in the batch-4 graph: the graph against the eager
  step of the same padded input (the check's reference), against the eager step unpadded, and the two eager steps
  against each other; on the random bf16 Llama-3-8B shape and on the embedded model in fp32 and bf16.
* ``lora``: notebook 07's LoRA recipe at the gpu profile's sizes: task held-out loss against steps (does it fall,
  then rise: over-fitting, or rise from the start: a bug?), and the memory model against the measured peak, the
  peak read two ways (allocated blocks and requested bytes: the allocator's rounding).

    python research/gpu_failures_probe.py --out DIR [--stages prefix pad lora]

Writes ``DIR/gpu_failures_probe.json`` (stage by stage, as each finishes) and prints a short table per stage.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from labkit.bench import environment


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def stage_prefix() -> dict:
    from labkit.data import sample_prompts, split_tokens
    from labkit.engine import LLMEngine, SamplingParams
    from labkit.model import load_model

    model, tok = load_model(device=DEVICE)
    block_size, seed = 16, 0
    sys_prompt = split_tokens("heldout", tok, max_tokens=4 * block_size + 5)[: 4 * block_size + 5].tolist()
    users = sample_prompts(tok, 4, 8, seed=seed + 3)
    rows = []
    for kernels in ("torch", "triton") if DEVICE == "cuda" else ("torch",):
        for graphs in (False, True) if DEVICE == "cuda" else (False,):
            outs, logits = {}, {}
            for on in (False, True):
                eng = LLMEngine(model, num_blocks=48, block_size=block_size, enable_prefix_caching=on,
                                kernels=kernels, cuda_graphs=graphs)
                eng.generate([sys_prompt], SamplingParams(max_tokens=1), progress=False)
                seen: list[torch.Tensor] = []
                run = eng.runner.execute

                def spy(ids, n, d, run=run, seen=seen):
                    out = run(ids, n, d)
                    seen.append(out.detach().float().cpu().clone())
                    return out

                eng.runner.execute = spy
                res = eng.generate([sys_prompt + u for u in users], SamplingParams(max_tokens=12, ignore_eos=True),
                                   progress=False)
                outs[on] = [o.output_token_ids for o in res]
                logits[on] = seen
                del eng
            steps = [(a.shape, b.shape) for a, b in zip(logits[False], logits[True])]
            diffs = [_rel(b, a) if a.shape == b.shape else None for a, b in zip(logits[False], logits[True])]
            first = next((i for i, (a, b) in enumerate(zip(outs[False], outs[True])) if a != b), None)
            margin = None
            if logits[False]:
                top2 = torch.cat(logits[False]).topk(2, dim=-1).values
                margin = float((top2[:, 0] - top2[:, 1]).min())
            rows.append({"kernels": kernels, "cuda_graphs": graphs, "equal": outs[False] == outs[True],
                         "first_differing_request": first, "outs_off": outs[False], "outs_on": outs[True],
                         "step_shapes": [str(s) for s in steps], "step_rel_diff": diffs,
                         "min_top2_margin_off": margin})
            print(f"prefix  kernels={kernels:6s} graphs={graphs!s:5s} equal={outs[False] == outs[True]} "
                  f"first={first} max step diff={max([d for d in diffs if d is not None] or [0]):.2e} "
                  f"min margin={margin}")
    return {"rows": rows}


def _pad_case(model, label: str) -> list[dict]:
    from labkit.engine.model_runner import ModelRunner
    from labkit.kvcache import PagedKVCache, SeqBlocks

    n, prompt_len = 4, 40
    max_len = prompt_len + 16
    cache = PagedKVCache.for_model(model, num_blocks=n * -(-max_len // 16) + 2, block_size=16)
    runner = ModelRunner(model, cache, cuda_graphs=True, max_num_seqs=n, max_model_len=max_len,
                         graph_batch_sizes=[1, 2, 4])
    vocab = runner.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    sids = [SeqBlocks(torch.randint(3, vocab, (prompt_len - 7 * i,), generator=g).tolist(), ("p", i))
            for i in range(n)]
    for seq in sids:
        cache.allocate(seq)
    runner.execute(sids, [s.num_tokens for s in sids], 0)
    for seq in sids:
        cache.mark_computed(seq, seq.num_tokens)
    rows = []
    with torch.inference_mode():
        for r in range(3):
            for b in (3, 4, 1):
                sub = sids[:b]
                for seq in sub:
                    seq.token_ids += torch.randint(3, vocab, (1,), generator=g).tolist()
                    cache.append_slots(seq)
                bucket = runner.graphs.bucket(b)
                padded_inp = runner.prepare(sub, [1] * b, b, pad_to=bucket, width=runner.max_blocks)
                eager_padded = runner.forward(padded_inp)[:b].float().clone()
                eager = runner.forward(runner.prepare(sub, [1] * b, b))[:b].float().clone()
                graph = runner.execute(sub, [1] * b, b).float().clone()
                for seq in sub:
                    cache.mark_computed(seq, seq.num_tokens)
                row = {"model": label, "round": r, "batch": b, "bucket": bucket,
                       "padded_num_decode": padded_inp.num_decodes, "padded_num_seqs": padded_inp.num_seqs,
                       "graph_vs_eager_padded": _rel(graph, eager_padded), "graph_vs_eager": _rel(graph, eager),
                       "eager_padded_vs_eager": _rel(eager_padded, eager),
                       "argmax_equal_graph_eager": bool((graph.argmax(-1) == eager.argmax(-1)).all())}
                rows.append(row)
                print(f"pad  {label:28s} r{r} b{b}->{bucket} padded(num_decode={padded_inp.num_decodes}) "
                      f"graph~padded {row['graph_vs_eager_padded']:.2e} graph~eager {row['graph_vs_eager']:.2e} "
                      f"padded~eager {row['eager_padded_vs_eager']:.2e}")
    return rows


def stage_pad() -> dict:
    from labkit.model import load_model, random_model

    rows = []
    emb, _ = load_model(device="cuda")
    rows += _pad_case(emb, "embedded fp32")
    rows += _pad_case(copy.deepcopy(emb).to(torch.bfloat16), "embedded bf16")
    del emb
    big = random_model("llama-3-8b", device="cuda", dtype="bf16", seed=0)
    rows += _pad_case(big, "llama-3-8b random bf16")
    del big
    small = random_model("llama-3-8b", num_layers=2, device="cuda", dtype="bf16", seed=0)
    rows += _pad_case(small, "llama-3-8b 2 layers random bf16")
    return {"rows": rows}


def _peak_two_ways(fn, dev) -> dict:
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    s0 = torch.cuda.memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    s1 = torch.cuda.memory_stats(dev)
    return {"allocated_above_start": s1["allocated_bytes.all.peak"] - s0["allocated_bytes.all.current"],
            "requested_above_start": s1["requested_bytes.all.peak"] - s0["requested_bytes.all.current"],
            "allocated_start": s0["allocated_bytes.all.current"], "requested_start": s0["requested_bytes.all.current"]}


def stage_lora() -> dict:
    from labkit.data import split_tokens
    from labkit.experiments import finetuning as C
    from labkit.experiments.finetuning import live_tensor_bytes
    from labkit.finetune import TrainSetup, finetune, heldout_loss, prepare_model, training_memory
    from labkit.finetune.lora import trainable_parameters
    from labkit.finetune.train import make_optimizer, train_step
    from labkit.model import get_config, load_model

    base, tok = load_model(device="cuda", dtype="fp32")
    train_ids = split_tokens("task_train", tok)
    held = split_tokens("task_heldout", tok)
    out = {"task_train_tokens": len(train_ids), "curves": [], "memory": []}
    for method, lr, steps_list, (b, s) in (("lora", 3e-3, (25, 50, 100, 200, 400), (16, 512)),
                                           ("lora", 1e-3, (100, 400), (16, 512)),
                                           ("full", 1e-4, (25, 100, 400), (16, 512))):
        for steps in steps_list:
            st = C.recipe(method, b, s, device="cuda", lora_rank=8, bf16=True)
            m = prepare_model(copy.deepcopy(base), st)
            before = heldout_loss(m, held, seq_len=512, precision=st.precision)
            t0 = time.perf_counter()
            res = finetune(m, train_ids, st, steps=steps, lr=lr, seed=0)
            after = heldout_loss(m, held, seq_len=512, precision=st.precision)
            row = {"method": method, "lr": lr, "steps": steps, "epochs": steps * b * s / len(train_ids),
                   "heldout_before": before, "heldout_after": after, "drop": before - after,
                   "train_loss_last": float(sum(res.losses[-5:]) / len(res.losses[-5:])),
                   "seconds": time.perf_counter() - t0}
            out["curves"].append(row)
            print(f"lora  {method:5s} lr {lr:.0e} steps {steps:4d} ({row['epochs']:.1f} epochs): held-out "
                  f"{before:.4f} -> {after:.4f} (drop {row['drop']:+.4f}), train {row['train_loss_last']:.3f}")
            del m
    cb, cs = 8, 512
    variants = [C.recipe(m, cb, cs, device="cuda", lora_rank=8, bf16=True) for m in C.METHOD_NAMES] + [
        TrainSetup(method="full", precision="fp32", batch_size=cb, seq_len=cs, device="cuda"),
        TrainSetup(method="full", precision="bf16-mixed", optimizer="adamw8bit", checkpointing=True,
                   batch_size=cb, seq_len=cs, device="cuda"),
        C.recipe("lora", cb, cs, device="cuda", checkpointing=True, lora_rank=8, bf16=True)]
    dev = torch.device("cuda")
    for st in variants:
        try:
            model = prepare_model(copy.deepcopy(base), st)
            spec = get_config(model)
            ids = torch.randint(0, spec.vocab_size, (cb, cs), generator=torch.Generator().manual_seed(0)).to(dev)
            opt = make_optimizer(trainable_parameters(model), st.optimizer, 1e-4)
            train_step(model, opt, ids, st.precision)
            live = live_tensor_bytes(model, opt, ids)
            pk = _peak_two_ways(partial(train_step, model, opt, ids, st.precision), dev)
            pred = training_memory(spec, st)
            row = {"setup": C.describe(st), "live": live, **pk, "predicted_peak": pred.peak,
                   "predicted_phase": pred.peak_phase, "predicted_phases": pred.phases,
                   "measured_alloc": live + pk["allocated_above_start"],
                   "measured_req": live + pk["requested_above_start"],
                   "untracked_at_start": pk["allocated_start"] - live}
            row["err_alloc"] = abs(row["measured_alloc"] - pred.peak) / row["measured_alloc"]
            row["err_req"] = abs(row["measured_req"] - pred.peak) / row["measured_req"]
            out["memory"].append(row)
            print(f"mem  {row['setup'][:60]:60s} pred {pred.peak / 2**20:8.1f} MiB alloc "
                  f"{row['measured_alloc'] / 2**20:8.1f} ({row['err_alloc']:.1%}) "
                  f"req {row['measured_req'] / 2**20:8.1f}"
                  f" ({row['err_req']:.1%}) untracked-at-start {row['untracked_at_start'] / 2**20:.1f} MiB")
            del model, opt
        except Exception as e:  # noqa: BLE001 (record and go on)
            out["memory"].append({"setup": str(st), "error": repr(e)})
            print("mem error", st, e)
    return out


DEVICE = "cuda"
STAGES = {"prefix": stage_prefix, "pad": stage_pad, "lora": stage_lora}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the prefix stage's torch path")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_failures_probe.json"
    rec = {"env": environment(), "stages": {}}
    for name in args.stages:
        t0 = time.perf_counter()
        try:
            rec["stages"][name] = STAGES[name]()
        except Exception:  # noqa: BLE001 (one stage's failure must not lose the others)
            rec["stages"][name] = {"error": traceback.format_exc()}
            print(f"stage {name} failed:\n{traceback.format_exc()}")
        rec["stages"][name]["seconds"] = time.perf_counter() - t0
        path.write_text(json.dumps(rec, indent=1, default=str))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
