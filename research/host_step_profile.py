"""Where the host's share of a decode step goes: the engine at batch ``--batch`` on the embedded model (CPU), its
forward replaced by a fixed logits tensor so that only host work remains (scheduling, slot reservation, input
preparation, sampling, postprocessing), profiled with cProfile over ``--steps`` steps.

    python research/host_step_profile.py --batch 64 --steps 50 --out DIR [--async-scheduling]
    python research/host_step_profile.py --batch 16 --prompt 500 --speculative prompt_lookup
    python research/host_step_profile.py --batch 16 --prompt 1500 --speculative draft

``--async-scheduling``: the engine's overlap path (``labkit.engine.async_step``), the same host work in another order
(on the CPU nothing overlaps: the stand-in forward is done when it returns). ``--speculative prompt_lookup`` (or
``draft``: the shipped draft model, its forward stubbed too): every step a speculative one (4 proposals a sequence;
the stand-in's random logits reject most of them, so each step also rolls back), for the host work speculation adds;
the prompts repeat a 50-token pattern so that lookup finds matches.

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
from labkit.data import DATA_DIR
from labkit.engine import LLMEngine, SamplingParams, SpeculativeConfig
from labkit.model import load_checkpoint, load_model

FUNCTIONS = ("schedule", "_schedule_decodes", "append_slots", "prepare", "__call__", "sample", "postprocess", "execute",
             "_read", "_commit", "_propose", "_verify", "_accept")


def speculative_config(method: str | None) -> SpeculativeConfig | None:
    if method == "draft":  # the shipped draft of the embedded model
        return SpeculativeConfig("draft", 4, draft_model=load_checkpoint(DATA_DIR / "pydocs-llama-draft",
                                                                          dtype=torch.float32, device="cpu"))
    return SpeculativeConfig(method, 4) if method else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--out", default=None)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--speculative", choices=["prompt_lookup", "draft"], default=None)
    args = ap.parse_args()
    model, _ = load_model(device="cpu")
    engine = LLMEngine(model, max_num_seqs=args.batch, num_blocks=4096, block_size=16, cuda_graphs=False,
                       async_scheduling=args.async_scheduling,
                       speculative=speculative_config(args.speculative))
    vocab = model.config.vocab_size
    for i in range(args.batch):
        pattern = 50 if args.speculative else vocab - 3
        engine.add_request([3 + (j * 7 + i) % pattern for j in range(args.prompt)],
                           SamplingParams(max_tokens=args.steps + 20, ignore_eos=True), request_id=i)
    for _ in range(5):  # prefill, then a few decode steps
        engine.step()
    logits = {}

    def fixed_logits(inp, out=None):  # the forward's result without the forward: what is left is the host's work
        rows = inp.logits_indices.numel()
        if rows not in logits:
            logits[rows] = torch.randn(rows, vocab)
        return logits[rows]

    engine.runner.forward = fixed_logits
    if args.speculative == "draft":
        engine.speculator.proposer.runner.forward = fixed_logits
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
    mode = (", async scheduling" if args.async_scheduling else "") + \
        (f", speculative {args.speculative}" if args.speculative else "")
    print(f"batch {args.batch}{mode}: {host_ms:.2f} ms of host work a step (under cProfile)")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {v:6.3f} ms  {k}")
    name = "host_step_profile" + ("_async" if args.async_scheduling else "") + \
        (f"_{args.speculative}" if args.speculative else "")
    path = write_record(name, {"batch": args.batch, "steps": args.steps, "prompt": args.prompt,
                               "async_scheduling": args.async_scheduling, "speculative": args.speculative,
                               "host_ms_per_step": host_ms,
                               "cumulative_ms_per_step": parts}, out_dir=args.out)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
