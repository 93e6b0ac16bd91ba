"""``python -m labkit bench serve|decode ...``: the serving engine benchmarked from the command line.

    bench serve   a workload (Poisson arrivals, prompt and output lengths from distributions) served by each
                  scheduler at each rate; prints latency percentiles and throughput, writes a record; then HF
                  ``generate`` in static batches and the engine, offline, on the same requests (``--hf-requests``)
    bench decode  steady-state decode tokens/s at given batch sizes, with the bandwidth floor and MBU, beside HF
                  ``generate`` with the static cache, eager and compiled (compiled on CUDA only), same prompts;
                  with ``--formats`` also the model quantised to each weight format, each layer taking the kernel
                  its machine's table measured fastest at the batch (``--dispatch``), against bf16 in the same run;
                  with ``--profile`` where each step's time goes: GEMMs, attention, norms, RoPE, sampling, the gaps,
                  each against its byte floor (``attribution.py``; bf16, the first scheduling mode)

``--async-scheduling off|on|both``: the engine without overlap (the default), with it
(``EngineConfig.async_scheduling``: the host prepares the next step while the device runs this one), or both in one
run. Figures of the runs with overlap carry the suffix ``_async`` (``engine.decode_b64_host_frac_async``: the formula of
``engine.decode_b64_host_frac``, 1 - the captured step replayed alone / the engine's step end to end); with both,
``engine.decode_b{b}_async_speedup`` too.

Examples::

    python -m labkit bench serve --num-requests 32 --rate 2 8 inf
    python -m labkit bench serve --model llama-3-8b --num-requests 1000 --prompt-len 512 --output-mean 128 \\
        --rate inf --scheduler continuous --max-num-seqs 256 --max-num-batched-tokens 8192
    python -m labkit bench decode --model llama-3-8b --batch 1 16 64 --context 512
    python -m labkit bench decode --model llama-3-8b --batch 1 16 64 --async-scheduling both --no-hf --figures
    python -m labkit bench decode --model llama-3-8b --batch 1 16 64 --formats bf16 int8 int4 fp8 --no-hf --figures
    python -m labkit bench decode --model llama-3-8b --batch 1 16 64 --context 512 --max-num-seqs 64 --no-hf --profile \
        --figures
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from labkit.engine import SCHEDULERS
from labkit.experiments.batching.decode_figures import async_decode_figures, decode_figures, quant_decode_figures

DTYPES = ("auto", "fp32", "bf16", "fp16")
OVERLAP = {"off": (False,), "on": (True,), "both": (False, True)}
"""``--async-scheduling``: the values of ``EngineConfig.async_scheduling`` measured, in order."""


def _load(args):
    """``(model, tokenizer, token source, label)`` for ``--model``: 'embedded', a preset (random weights) or a
    checkpoint directory."""
    from labkit.data import EMBEDDED_MODEL, split_tokens
    from labkit.device import resolve_device
    from labkit.model import PRESETS, load_model, random_model

    device = resolve_device(args.device)
    if args.model in PRESETS:
        dtype = "bf16" if args.dtype == "auto" else args.dtype
        model = random_model(args.model, device=device, dtype=dtype, seed=args.seed)
        return model, None, model.config.vocab_size, f"{args.model} (random weights, {dtype})"
    dtype = ("fp32" if device.type == "cpu" else "bf16") if args.dtype == "auto" else args.dtype
    model, tok = load_model(None if args.model == "embedded" else args.model, device=device, dtype=dtype)
    label = f"{EMBEDDED_MODEL if args.model == 'embedded' else args.model} ({dtype})"
    return model, tok, split_tokens("heldout", tok), label


def _engine_kwargs(args) -> dict:
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                chunked_prefill=not args.no_chunked_prefill, block_size=args.block_size, num_blocks=args.num_blocks,
                kernels=args.kernels, cuda_graphs=False if args.no_cuda_graphs else "auto", seed=args.seed,
                max_model_len=args.max_model_len)


def _serve(args) -> int:
    import pandas as pd

    from labkit.bench import write_record
    from labkit.bench.serving import SLO
    from labkit.bench.workload import LengthDist, make_workload
    from labkit.experiments.batching.measure import serve_sweep

    model, _, source, label = _load(args)
    prompt = LengthDist.fixed(args.prompt_len) if args.prompt_max is None else \
        LengthDist.uniform(args.prompt_len, args.prompt_max)
    output = LengthDist.exponential(args.output_mean, low=1, high=args.output_max)
    workload = make_workload(args.num_requests, 1.0, prompt, output, source, seed=args.seed)
    longest = max(r.prompt_len + r.max_new_tokens for r in workload)
    base = _engine_kwargs(args)
    base["max_model_len"] = base["max_model_len"] or longest
    names = SCHEDULERS if args.scheduler == "all" else (args.scheduler,)
    policies = {n + ("+async" if overlap else ""): dict(base, scheduler=n, async_scheduling=overlap)
                for n in names for overlap in OVERLAP[args.async_scheduling]}
    slo = SLO(args.slo_ttft, args.slo_tpot)
    rows = serve_sweep(model, workload, policies, args.rate, slo=slo, progress=not args.no_progress)
    cols = ["policy", "rate_req_s", "output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
            "tpot_p99_s", "e2e_p99_s", "goodput_requests_s", "busy_frac", "preemptions", "peak_kv_bytes"]
    print(f"{label}: {len(workload)} requests, prompts {prompt.describe()}, outputs {output.describe()}")
    print(pd.DataFrame(rows)[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    hf_rows = []
    if args.hf_requests != 0:
        from labkit.experiments.baseline import hf_modes, offline_throughput

        n = len(workload) if args.hf_requests < 0 else min(args.hf_requests, len(workload))
        modes = tuple(m for m in args.hf_modes if m in hf_modes(next(model.parameters()).device))
        hf_rows = offline_throughput(model, workload[:n], args.hf_batch, dict(base, scheduler="continuous"), modes,
                                     progress=not args.no_progress)
        print(f"offline, the first {n} requests, measured on both sides:")
        print(pd.DataFrame(hf_rows).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    path = write_record(args.name, {"model": label, "workload": {"n": len(workload), "prompt": prompt.describe(),
                                                                 "output": output.describe(), "seed": args.seed},
                                    "policies": policies, "slo": slo.__dict__, "rows": rows,
                                    "hf_static_batching": hf_rows}, out_dir=args.out)
    print(f"record: {path}")
    return 0


def _decode(args) -> int:
    from labkit.bench import write_record
    from labkit.experiments.batching.attribution import attribution_figures, decode_attribution, format_attribution
    from labkit.experiments.batching.measure import decode_rate, free_device_memory
    from labkit.experiments.quantization.metrics import decode_weight_bytes
    from labkit.hardware import measure_ceilings
    from labkit.model import adopt_hf_model, get_config

    model, _, source, label = _load(args)
    spec, dtype = get_config(model), next(model.parameters()).dtype
    ceilings = measure_ceilings(next(model.parameters()).device, iters=5)
    bw, sheet = ceilings["copy_bytes_per_s"], ceilings["datasheet_bytes_per_s"]
    rows, tables, modes = [], {}, OVERLAP[args.async_scheduling]
    # one adopted model for every bf16 engine (each engine built from the HF model merged its own 9 GB of q/k/v and
    # gate/up: batch 64 ran out of an H100's memory, research/records/h100/gpu_check_2026-12-07/)
    adopted = adopt_hf_model(model)
    for fmt in args.formats or ["bf16"]:
        m = adopted if fmt == "bf16" else _quantised(model, fmt, args.dispatch, tables)
        for b in args.batch:
            for overlap in modes:
                kw = _engine_kwargs(args)
                kw.update(max_num_seqs=b, max_num_batched_tokens=max(b, 8192), max_model_len=None,
                          async_scheduling=overlap)
                if args.formats:  # the decode step of this batch is what is compared: capture that one graph only
                    kw.update(graph_batch_sizes=(b,), graph_token_sizes=())
                profiled = args.profile and fmt == "bf16" and overlap == modes[0]
                r = decode_rate(m, b, args.context, args.steps, source, profile_steps=args.profile_steps * profiled,
                                **kw)
                weight_bytes = spec.decode_weight_bytes(dtype) if fmt == "bf16" else decode_weight_bytes(spec, fmt)
                floor_bytes = weight_bytes + b * spec.kv_bytes(r["context"], dtype)
                r.update(weights=fmt, kernels_by_layer=_paths_at(m, b), floor_bytes=floor_bytes,
                         floor_s=floor_bytes / bw, mbu=floor_bytes * r["tok_s"] / b / bw,
                         mbu_datasheet=floor_bytes * r["tok_s"] / b / sheet if sheet else None)
                if profiled:  # the profile's table in the row, the profile itself dropped (not JSON)
                    r["attribution"] = decode_attribution(m, r, r.pop("profile"), bw, source, **kw)
                if not args.no_hf and fmt == "bf16" and overlap == modes[0]:  # HF once per batch
                    r.update(hf_static_decode(model, b, args.context, args.steps, source, args.seed))
                rows.append(r)
                path = write_record(args.name, {"model": label, "bandwidth_bytes_per_s": bw,  # after each row
                                                "datasheet_bytes_per_s": sheet, "context": args.context, "rows": rows,
                                                "dispatch": tables}, out_dir=args.out)  # (a run cut short keeps them)
                _print_decode_row(label, r)
                if profiled:
                    print(format_attribution(r["attribution"]), flush=True)
        if m is not adopted:
            del m
            free_device_memory()
    path = write_record(args.name, {"model": label, "bandwidth_bytes_per_s": bw, "datasheet_bytes_per_s": sheet,
                                    "context": args.context, "rows": rows, "dispatch": tables}, out_dir=args.out)
    print(f"record: {path}")
    if args.figures:
        for overlap in modes:
            mine, suffix = [r for r in rows if r["async_scheduling"] == overlap], "_async" if overlap else ""
            decode_figures([r for r in mine if r.get("weights", "bf16") == "bf16"], path, args.out, suffix)
            quant_decode_figures(mine, path, args.out, suffix)
        async_decode_figures(rows, path, args.out)
        for r in rows:
            if r.get("attribution"):
                attribution_figures(r["attribution"], path, args.out, "_async" if r["async_scheduling"] else "")
    return 0


def _print_decode_row(label: str, r: dict) -> None:
    replay = ""
    if r["replay_step_s"]:
        replay = (f", replayed step {r['replay_step_s'] * 1e3:.3f} ms, host share "
                  f"{1 - r['replay_step_s'] / r['step_median_s']:.0%}, {r['graph_step_frac']:.0%} of steps replayed")
    mode = ", async scheduling" if r["async_scheduling"] else ""
    print(f"{label} {r['weights']} batch {r['batch']}{mode}: {r['tok_s']:.1f} tokens/s ({r['step_median_s'] * 1e3:.3f} "
          f"ms/step{replay}); floor {r['floor_s'] * 1e3:.3f} ms -> MBU {r['mbu']:.2f}; kernels "
          f"{r['kernels_by_layer'] or 'unquantised'}", flush=True)
    for mode in ("static", "static+compile"):
        if r.get(f"hf_{mode}_tok_s"):
            print(f"  HF generate ({mode}): {r[f'hf_{mode}_tok_s']:.1f} tokens/s -> engine "
                  f"{r['tok_s'] / r[f'hf_{mode}_tok_s']:.2f}x")


def _quantised(model, fmt: str, dispatch: str, tables: dict):
    """``model`` quantised to ``fmt`` with its kernel table attached (``labkit.quant.dispatch``); ``tables[fmt]``
    says which table (or that labkit's own kernels run)."""
    from labkit.quant import quantize

    q = quantize(model, fmt, dispatch=dispatch)
    tables[fmt] = q.labkit_quant.get("dispatch")
    return q


def _paths_at(model, rows: int) -> dict:
    """``{path: layers}``: the kernel the table gives each of ``model``'s quantised layers at ``rows`` rows (empty
    for an unquantised model; the HF model's separate q/k/v and gate/up, which the engine runs merged)."""
    from labkit.quant.dispatch import quantised_layers
    from labkit.quant.peers import LABKIT_PATHS, layer_format

    out: dict[str, int] = {}
    for lin in quantised_layers(model).values():
        d = getattr(lin, "dispatch", None)
        name = d.planned(rows) if d is not None else LABKIT_PATHS[layer_format(lin)]
        out[name] = out.get(name, 0) + 1
    return out


def hf_static_decode(model, batch: int, context: int, steps: int, source, seed: int = 0) -> dict:
    """Decode tokens/s of HF ``generate`` with the static cache at ``batch`` prompts of ``context`` tokens, eager
    and (on CUDA) compiled: ``{'hf_static_tok_s', 'hf_static+compile_tok_s', 'hf_*_first_call_s'}``, None where a
    mode does not run here. Each mode is called once first (the compile happens there; its time is recorded)."""
    import time

    from labkit.bench.workload import LengthDist, make_workload
    from labkit.experiments.baseline import hf_modes, run_generate

    wl = make_workload(batch, math.inf, LengthDist.fixed(context), LengthDist.fixed(steps), source, seed=seed)
    prompts = [r.prompt_ids for r in wl]
    out = {}
    for mode in ("static", "static+compile"):
        if mode not in hf_modes(next(model.parameters()).device):
            out[f"hf_{mode}_tok_s"] = out[f"hf_{mode}_first_call_s"] = None
            continue
        t0 = time.perf_counter()
        run_generate(model, prompts, steps, mode=mode)
        out[f"hf_{mode}_first_call_s"] = time.perf_counter() - t0
        out[f"hf_{mode}_tok_s"] = run_generate(model, prompts, steps, mode=mode)[0].decode_tok_s()
    return out


def _rates(s: str) -> float:
    return math.inf if s == "inf" else float(s)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m labkit bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="embedded", help="'embedded', a preset (random weights) or a path")
    common.add_argument("--dtype", default="auto", choices=DTYPES)
    common.add_argument("--device", default="auto", help="auto, cpu or cuda")
    common.add_argument("--max-num-seqs", type=int, default=32)
    common.add_argument("--max-num-batched-tokens", type=int, default=2048)
    common.add_argument("--max-model-len", type=int, default=None)
    common.add_argument("--block-size", type=int, default=16)
    common.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    common.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"))
    common.add_argument("--no-chunked-prefill", action="store_true")
    common.add_argument("--no-cuda-graphs", action="store_true")
    common.add_argument("--async-scheduling", default="off", choices=tuple(OVERLAP),
                        help="the engine without overlap of host and device work, with it, or both in one run")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--out", default=None, help="output folder for the record (default $LABKIT_OUT or out/local)")
    common.add_argument("--no-progress", action="store_true")
    s = sub.add_parser("serve", parents=[common], help="serve a workload under each scheduler and rate")
    s.add_argument("--scheduler", default="all", choices=(*SCHEDULERS, "all"))
    s.add_argument("--num-requests", type=int, default=32)
    s.add_argument("--rate", type=_rates, nargs="+", default=[math.inf], help="requests/s; 'inf' = offline")
    s.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (the minimum with --prompt-max)")
    s.add_argument("--prompt-max", type=int, default=None, help="uniform prompt lengths up to this")
    s.add_argument("--output-mean", type=float, default=32, help="mean of the exponential output lengths")
    s.add_argument("--output-max", type=int, default=None, help="clip output lengths at this")
    s.add_argument("--slo-ttft", type=float, default=1.0, help="seconds, for goodput")
    s.add_argument("--slo-tpot", type=float, default=0.1, help="seconds, for goodput")
    s.add_argument("--hf-requests", type=int, default=64,
                   help="HF generate in static batches on the first N requests, and the engine offline on the same "
                        "N (a measured subsample: HF on 1,000 long requests takes hours); -1: all, 0: skip")
    s.add_argument("--hf-batch", type=int, default=32, help="HF static batch size")
    s.add_argument("--hf-modes", nargs="+", default=["eager", "static"], choices=("eager", "static", "static+compile"),
                   help="HF generate modes (static+compile recompiles for each new batch shape; CUDA only)")
    s.add_argument("--name", default="bench_serve", help="record name")
    s.set_defaults(fn=_serve)
    d = sub.add_parser("decode", parents=[common], help="steady-state decode tokens/s per batch size")
    d.add_argument("--batch", type=int, nargs="+", default=[1])
    d.add_argument("--context", type=int, default=512)
    d.add_argument("--steps", type=int, default=32)
    d.add_argument("--no-hf", action="store_true", help="skip HF generate (static cache, eager and compiled)")
    d.add_argument("--figures", action="store_true",
                   help="also record engine.decode_b*_mbu and engine.speedup_vs_hf_compiled_b* in figures.json")
    d.add_argument("--formats", nargs="+", default=None, choices=("bf16", "int8", "int4", "fp8"),
                   help="also decode with the weights quantised to each format (bf16 first: the baseline)")
    d.add_argument("--dispatch", default="measured",
                   help="kernels of the quantised layers: 'measured' (this machine's table), 'labkit', or the path "
                        "of a quant_dispatch.json record")
    d.add_argument("--profile", action="store_true",
                   help="also profile each batch's decode steps: time per part (GEMMs, attention, norms, RoPE/cache "
                        "write, activation, sampling, copies) and the gaps, each against its byte floor; with "
                        "--figures, engine.decode_b*_gap_frac, _gemm_floor_frac and _attn_floor_frac")
    d.add_argument("--profile-steps", type=int, default=4, help="decode steps profiled per batch (with --profile)")
    d.add_argument("--name", default="bench_decode", help="record name")
    d.set_defaults(fn=_decode)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m labkit bench ...`` (``argv`` without the leading 'bench')."""
    args = _parser().parse_args(argv)
    for name in ("num_requests", "max_num_seqs", "max_num_batched_tokens", "block_size", "prompt_len", "context",
                 "steps", "hf_batch", "profile_steps"):
        v = getattr(args, name, 1)
        if v is not None and v < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={v} must be >= 1")
    torch.manual_seed(args.seed)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
