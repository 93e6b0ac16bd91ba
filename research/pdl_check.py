"""Does the int4 engine give the same logits with programmatic dependent launch (``gemv_pdl``) as without?

On the H200 the 8B int4 engine test gave logits 1.4 (relative) away from the separate kernels' when the PDL engine
was the first int4 engine of its pytest process, and matched bit for bit when a plain engine ran first (the
journal, now `git show e26e84e:results/h200/NOTES.md`, 2026-12-04 (e)). Each variant here runs in a fresh process,
on two layers of llama-3-8b
in int4, the same prompt and forced continuation for every engine (so every step's logits compare), decode
attention in one pass (``max_model_len`` 64) and split (1024):

* ``pdl_first`` / ``plain_first``: the failing order and the passing one;
* ``pdl_first_blocking``: ``CUDA_LAUNCH_BLOCKING=1`` (no launch overlaps another: a race would vanish);
* ``pdl_first_no_release``: attention does not release the o GEMV (only GEMV after GEMV overlaps);
* ``pdl_first_compiled_only``: the kernels compiled with their ``griddepcontrol`` instructions but launched plainly;
* ``pdl_first_attention_tuned``: paged attention autotuned by a plain call before the PDL engine is built;
* ``pdl_first_eager``: no CUDA graphs (every step launched eagerly);
* ``pdl_twice``: a second PDL engine after the first (is only the process's first engine wrong?);
* ``nan_cache``: the cache pools start as NaN (as the tests' caches do: a slot read before it is written shows);
* ``tiny_first``: an int4 engine of the embedded model (PDL, then separate kernels) runs first, as the GPU test
  before the failing one did;
* ``test_like``: both, and each engine fed its own greedy tokens, as the failing test was;
* ``test_prompt_greedy``: the failing test's own prompt, NaN pools, greedy feed (do the engines' tokens part?).

Each engine's tokens (every step's argmax) are recorded too.

Per variant and engine: every step's relative error against the separate kernels, whether the PDL engine's logits
equal the plain engine's bit for bit, and whether the split GEMVs' arrival counters were all zero after each engine.

    python research/pdl_check.py --out /tmp/h200          # records/pdl_check.json

Found (results/h200/records/pdl_check_*.json): PDL and plain engines equal bit for bit in every variant; the
failing tests' 1.4 was greedy feeding on random weights (``test_prompt_greedy``: the plain engine's 7th token
differs from the separate kernels' too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "pdl_first": (["pdl", "plain", "separate"], {}),
    "plain_first": (["plain", "pdl", "separate"], {}),
    "pdl_first_blocking": (["pdl", "plain", "separate"], {"CUDA_LAUNCH_BLOCKING": "1"}),
    "pdl_first_no_release": (["pdl", "plain", "separate"], {}),
    "pdl_first_compiled_only": (["pdl", "plain", "separate"], {}),
    "pdl_first_attention_tuned": (["pdl", "plain", "separate"], {}),
    "pdl_first_eager": (["pdl", "plain", "separate"], {}),
    "pdl_twice": (["pdl", "pdl_again", "plain", "separate"], {}),
    "nan_cache": (["pdl", "plain", "separate"], {}),
    "tiny_first": (["pdl", "plain", "separate"], {}),
    "test_like": (["pdl", "plain", "separate"], {}),
    "test_prompt_greedy": (["pdl", "plain", "separate"], {}),
}
ENGINES = {"pdl": dict(gemv_pdl=True), "pdl_again": dict(gemv_pdl=True), "plain": dict(gemv_pdl=False),
           "separate": dict(fuse_layer_ops=False)}
PROMPT, STEPS = 27, 16


def _patch(variant: str) -> None:
    """The variant's change to labkit, made before anything runs (this child process only)."""
    import labkit.kernels.paged_attention as pa
    from labkit.kernels.quantized_matmul import stationary

    if variant == "pdl_first_no_release":
        plain = pa.paged_attention
        pa.paged_attention = lambda *a, pdl="", **kw: plain(*a, **kw)
    if variant == "pdl_first_compiled_only":  # the stationary GEMVs' launch options without launch_pdl
        launch = stationary.pdl_launch
        stationary.pdl_launch = lambda *a: {key: val for key, val in launch(*a).items() if key != "launch_pdl"}
        plain = pa.paged_attention
        pa.paged_attention = lambda *a, pdl="", **kw: plain(*a, **kw)


def _logits(model, tokens: list[int], max_len: int, options: dict, nan: bool = False, greedy: bool = False) -> list:
    """Logits of the prompt's step and of ``STEPS`` single-sequence decode steps (graph replays) fed ``tokens``
    (``greedy``: each step's argmax); ``nan``: the cache pools start as NaN."""
    from labkit.engine.model_runner import ModelRunner
    from labkit.kvcache import PagedKVCache, SeqBlocks

    cache = PagedKVCache.for_model(model, num_blocks=-(-len(tokens) // 4) + 2, block_size=4)
    for pool in cache.k_caches + cache.v_caches if nan else ():
        pool.fill_(float("nan"))
    from labkit.experiments.batching.measure import plan_options

    runner = ModelRunner(model, cache, kernels=plan_options(model, **options), max_num_seqs=1, max_model_len=max_len)
    seq = SeqBlocks(tokens[:PROMPT], 0)
    cache.allocate(seq)
    out = [runner.execute([seq], [PROMPT], 0).float().cpu()]
    for t in tokens[PROMPT:PROMPT + STEPS]:
        cache.mark_computed(seq, seq.num_tokens)
        seq.token_ids.append(int(out[-1].argmax()) if greedy else t)
        cache.append_slots(seq)
        out.append(runner.execute([seq], [1], 1).float().cpu())
    return out


def child(variant: str, path: str, preset: str, device_name: str) -> None:
    import torch

    with torch.inference_mode():  # the engine's buffers are inference tensors: zeroing them needs the mode too
        _child(variant, path, preset, device_name)


def _child(variant: str, path: str, preset: str, device_name: str) -> None:
    import torch

    from labkit.data import sample_prompts
    from labkit.evaluate import relative_error
    from labkit.kernels.quantized_matmul import splitk
    from labkit.model import load_model, random_model
    from labkit.quant import quantize

    _patch(variant)
    dtype = torch.float16 if device_name == "cpu" else torch.bfloat16  # the interpreter's tl.dot is wrong in bf16
    tiny, tokenizer = load_model()
    tokens = sample_prompts(tokenizer, 1, PROMPT + STEPS, seed=5)[0]
    if variant == "test_prompt_greedy":  # tests/test_engine_model_runner.py's prompts[0]
        tokens = sample_prompts(tokenizer, 3, PROMPT, seed=5)[0] + tokens[PROMPT:]
    nan = variant in ("nan_cache", "test_like", "test_prompt_greedy")
    greedy = variant in ("test_like", "test_prompt_greedy")
    if variant in ("tiny_first", "test_like"):  # as test_int4_layer_ops_fused_on_the_gpu, before the failing test
        small = quantize(tiny, "int4").to(device_name, dtype)
        for options in (dict(gemv_pdl=True), dict(fuse_layer_ops=False)):
            _logits(small, tokens, 64, options, nan, greedy=True)
    model = quantize(random_model(preset, device=device_name, dtype=dtype, num_layers=2, seed=3), "int4")
    device = model.lm_head.weight.device
    if variant == "pdl_first_attention_tuned":
        from labkit.kernels.paged_attention import paged_attention

        for max_len in (64, 1024):  # the engine's decode attention shapes, tuned by plain calls
            blocks = max_len // 4
            cfg = model.config
            head_dim = cfg.hidden_size // cfg.num_attention_heads
            q = torch.randn(1, cfg.num_attention_heads, head_dim, device=device, dtype=dtype)
            kv = torch.randn(blocks + 1, 4, cfg.num_key_value_heads, head_dim, device=device, dtype=dtype)
            tables = torch.arange(blocks, device=device, dtype=torch.int32)[None]
            paged_attention(q, kv, kv, tables, torch.tensor([PROMPT], device=device, dtype=torch.int32))
    order, _ = VARIANTS[variant]
    result = {}
    for max_len in (64, 1024):
        runs, counters = {}, {}
        for name in order:
            graphs = {"cuda_graphs": False} if variant.endswith("_eager") else {}
            runs[name] = _logits(model, tokens, max_len, {**ENGINES[name], **graphs}, nan, greedy)
            if device.type == "cuda":
                torch.cuda.synchronize()
            cnt = splitk._split_buffers(device, 1)[1]
            counters[name] = cnt.nonzero().flatten()[:16].tolist()
            cnt.zero_()  # the next engine starts from clean counters whatever this one left
        result[max_len] = {
            "errors_vs_separate": {n: [relative_error(a, b) for a, b in zip(runs[n], runs["separate"])]
                                   for n in order if n != "separate"},
            "pdl_equals_plain": [bool(torch.equal(a, b)) for a, b in zip(runs["pdl"], runs["plain"])],
            "counters_left_set": counters,
            "tokens": {n: [int(a.argmax()) for a in r] for n, r in runs.items()}}
    Path(path).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/local")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--preset", default="llama-3-8b", help="model shape (tiny: a quick CPU check of the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.json, args.preset, args.device)
        return 0
    from labkit.bench import write_record

    data = {}
    tmp = Path(args.out) / "pdl_check_tmp.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        env = dict(os.environ, **VARIANTS[variant][1])
        run = subprocess.run([sys.executable, __file__, "--child", variant, "--json", str(tmp), "--preset",
                              args.preset, "--device", args.device], env=env,
                             capture_output=True, text=True, timeout=300)
        data[variant] = json.loads(tmp.read_text()) if run.returncode == 0 else {"error": run.stderr[-3000:]}
        tmp.unlink(missing_ok=True)
        for max_len, r in data[variant].items() if run.returncode == 0 else ():
            worst = " ".join(f"{n} {max(e):.4f}" for n, e in r["errors_vs_separate"].items())
            print(f"{variant:26s} max_len {max_len:>4}: worst error {worst}, pdl == plain at "
                  f"{sum(r['pdl_equals_plain'])}/{len(r['pdl_equals_plain'])} steps, counters left set: "
                  f"{r['counters_left_set']}")
        if run.returncode:
            print(f"{variant}: failed\n{run.stderr[-1500:]}")
    print(f"wrote {write_record('pdl_check', data, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
