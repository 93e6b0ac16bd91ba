"""Is an async-scheduled decode step at batch 64 bound by the host or by the device?

On an H100 at 0518b54 (``research/records/h100/decode_async_0518b54/``) async scheduling hid the host's work at
batch 1 and 16 (host share 1%) but not at 64: 8.03 ms a step against a replayed graph of 6.96 ms, where the
synchronous host work was 4.2 ms. Two readings predict different things: if the host's async work per step is longer
than the device's step, the host never waits for the tokens it reads (``SampledTokens.tolist``) and its busy time is
the period; if the device's step is longer than its replayed graph (work outside the graph), the host waits there.
This times both per step of the real engine -- the wait inside ``tolist`` (the one place the host waits for the
device) and the rest -- without and with overlap (the sync run's host time is the work the async run must hide; its
wait, the device's step beyond what ran while the host worked), with the share of steps that replayed a graph, then
profiles the async steps with cProfile for where the host's time goes on that machine.

    LABKIT_GIT_COMMIT=<sha> PYTHONPATH=. python research/async_timeline.py --out $OUT/async_timeline.json
    python research/async_timeline.py --model embedded --batch 8 --context 64 --steps 8   # on the CPU (no overlap)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

# isort: off
import labkit  # noqa: F401  (first: on a CPU-only host it sets TRITON_INTERPRET before triton is imported)
# isort: on
import torch

from labkit.bench import environment
from labkit.engine.sampling import SampledTokens
from labkit.experiments.batching.measure import _prefilled_engine
from labkit.model import load_model, random_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b", help="a preset (random bf16 weights on CUDA) or 'embedded'")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True, help="the record's path (JSON)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.model == "embedded":
        model, _ = load_model(device="cuda" if cuda else "cpu")
    else:
        model = random_model(args.model, device="cuda", dtype="bf16")
    source = model.config.vocab_size  # random prompt ids: the host's work does not depend on them
    waits: list[float] = []
    tolist = SampledTokens.tolist

    def timed_tolist(self):  # the one place a step waits for the device: how long it waits
        t0 = time.perf_counter()
        out = tolist(self)
        waits.append(time.perf_counter() - t0)
        return out

    SampledTokens.tolist = timed_tolist
    modes, top = {}, []
    for overlap in (False, True):  # sync first: its host time is the work the async run should hide
        engine = _prefilled_engine(model, args.batch, args.context, 2 * args.steps + 10, source, 0,
                                   max_num_seqs=args.batch, max_num_batched_tokens=max(args.batch, 8192),
                                   async_scheduling=overlap)
        for _ in range(5):
            engine.step()
        rows, replayed = [], engine.stats.graph_steps
        for _ in range(args.steps):
            waits.clear()
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            rows.append({"step_s": wall, "wait_s": sum(waits), "busy_s": wall - sum(waits)})
        med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "wait_s", "busy_s")}
        med["graph_step_frac"] = (engine.stats.graph_steps - replayed) / args.steps
        name = "async" if overlap else "sync"
        modes[name] = {"median": med, "rows": rows}
        print(f"batch {args.batch}, {name}: step {med['step_s'] * 1e3:.3f} ms, host busy {med['busy_s'] * 1e3:.3f} ms, "
              f"waiting {med['wait_s'] * 1e3:.3f} ms; {med['graph_step_frac']:.0%} of steps replayed a graph")
        if overlap:  # where the async run's host time goes
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                engine.step()
            prof.disable()
            stats = pstats.Stats(prof)
            top = sorted(((f"{Path(k[0]).name}:{k[2]}", v[2] / args.steps * 1e3, v[3] / args.steps * 1e3)
                          for k, v in stats.stats.items()), key=lambda r: -r[1])[:25]
        del engine
    med = modes["async"]["median"]
    verdict = "host-bound (the host never waits for the device)" if med["wait_s"] < 0.05 * med["step_s"] else \
        "device-bound (the host waits for the tokens)"
    # sync: the device's step is about its wait plus what it ran while the host prepared the step; async: the
    # period. A sync wait well above the replayed graph says the device does work outside the graph.
    print(f"async: {verdict}")
    for name, tottime, cumtime in top[:15]:
        print(f"  {tottime:7.3f} ms self  {cumtime:7.3f} ms cum  {name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": environment(), "data": {
        "question": __doc__.splitlines()[0], "model": args.model, "batch": args.batch, "context": args.context,
        "steps": args.steps, "modes": modes, "verdict": verdict,
        "cprofile_ms_per_step": [{"function": n, "self_ms": s, "cum_ms": c} for n, s, c in top]}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
