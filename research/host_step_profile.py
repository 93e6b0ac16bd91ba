"""Where the host's share of a decode step goes: the engine at batch ``--batch`` on the embedded model (CPU), its
forward replaced by a fixed logits tensor so that only host work remains (scheduling, slot reservation, input
preparation, sampling, postprocessing), profiled with cProfile over ``--steps`` steps.

    python research/host_step_profile.py --batch 64 --steps 50 --out DIR [--async-scheduling]

``--async-scheduling``: the engine's overlap path (``labkit.engine.async_step``), the same host work in another order
(on the CPU nothing overlaps: the stand-in forward is done when it returns).

Writes ``DIR/records/host_step_profile.json``: milliseconds of host work a step, and the cumulative milliseconds a
step of the engine's main functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from labkit.bench import write_record
from labkit.engine import LLMEngine, SamplingParams
from labkit.model import load_model

FUNCTIONS = ("schedule", "_schedule_decodes", "append_slots", "prepare", "__call__", "sample", "postprocess", "execute",
             "_read", "_commit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--out", default=None)
    ap.add_argument("--async-scheduling", action="store_true")
    args = ap.parse_args()
    model, _ = load_model(device="cpu")
    engine = LLMEngine(model, max_num_seqs=args.batch, num_blocks=4096, block_size=16, cuda_graphs=False,
                       async_scheduling=args.async_scheduling)
    vocab = model.config.vocab_size
    for i in range(args.batch):
        engine.add_request([3 + (i * 7 + j) % (vocab - 3) for j in range(args.prompt)],
                           SamplingParams(max_tokens=args.steps + 20, ignore_eos=True), request_id=i)
    for _ in range(5):  # prefill, then a few decode steps
        engine.step()
    logits = {}

    def fixed_logits(inp):  # the forward's result without the forward: what is left is the host's work
        if inp.num_seqs not in logits:
            logits[inp.num_seqs] = torch.randn(inp.num_seqs, vocab)
        return logits[inp.num_seqs]

    engine.runner.forward = fixed_logits
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    host_ms = (time.perf_counter() - t0) / args.steps * 1e3
    stats = pstats.Stats(profile).stats
    parts = {}
    for (path, _, name), (_, _, _, cumtime, _) in stats.items():
        if name in FUNCTIONS and "labkit" in path:
            parts[f"{path.split('labkit/')[-1]}:{name}"] = cumtime / args.steps * 1e3
    mode = ", async scheduling" if args.async_scheduling else ""
    print(f"batch {args.batch}{mode}: {host_ms:.2f} ms of host work a step (under cProfile)")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {v:6.3f} ms  {k}")
    name = "host_step_profile_async" if args.async_scheduling else "host_step_profile"
    path = write_record(name, {"batch": args.batch, "steps": args.steps, "prompt": args.prompt,
                               "async_scheduling": args.async_scheduling, "host_ms_per_step": host_ms,
                               "cumulative_ms_per_step": parts}, out_dir=args.out)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
