"""Compile the quantised GEMVs for Hopper (sm_90) without a GPU and count what their inner loop issues.

For each candidate tile of the split-K GEMVs (``tuning.SPLITK_CANDIDATES``), and for the stationary GEMVs at the
8B decode shapes with the tiles labkit's rule picks (``XS_CASES``, plain and with what they take in), this compiles
the kernel with Triton's own toolchain, reads the cubin with the ``cuobjdump`` that ships with Triton, and reports
registers, spills (local memory), the instructions of the inner loop per weight each thread handles, and the most
frequent opcodes. An H200 issues about 33 T lane-instructions per second (132 SMs x 4 schedulers x 32 lanes x
1.98 GHz), so ``instructions per weight x weights / 33.4e12`` is the time the kernel needs for issue alone; compare
it with the bytes' floor. A kernel above that floor is instruction-bound; below it, a slow measured time points at
latency (too few bytes in flight per SM), not at the arithmetic.

    python research/sass_report.py [--kernel w8 w4 xs w8xs] [--group 128] [--out DIR]

Compile with the Triton the GPU runs: the H200 image has Triton 3.6, and its layouts differ from 3.9's (this
repository's CPU pin) -- the int4 stationary GEMV's 3-D weight load took 128 registers under 3.6 and 72 under 3.9
until its weights were loaded as 2-D rows. A venv for it (CPU torch, no GPU needed):

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0 transformers==5.24.0 tqdm
    /tmp/t36/bin/pip install -e . && /tmp/t36/bin/python research/sass_report.py --kernel xs w8xs --out results/cpu

(Earlier versions also compiled variants the product kernels no longer have -- the TAGGED reduction, loads
pipelined through shared memory, unpaired words, the int8 float32 path: results/cpu/records/sass_*.json.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # compiled, not interpreted: triton imported before labkit can route it to the interpreter
    os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402

H200_LANE_INSTR_PER_S = 132 * 4 * 32 * 1.98e9
W8_SIG = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
          "cnt_ptr": "*i32", "N": "i32", "K": "i32", "stride_wn": "i32", "lo_mask": "i32", "hi_mask": "i32",
          "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "LOAD_STAGES": "constexpr",
          "WORDS_ALIGNED": "constexpr", "EVEN": "constexpr"}
W4_SIG = {"x_ptr": "*bf16", "p_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
          "ws_ptr": "*fp32", "cnt_ptr": "*i32", "N": "i32", "K": "i32", "stride_pn": "i32", "stride_sn": "i32",
          "stride_zn": "i32", "exp_bits": "i32", "GROUP": "constexpr", "BLOCK_N": "constexpr",
          "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "LOAD_STAGES": "constexpr", "EVEN": "constexpr",
          "HALF_MATH": "constexpr", "PREFETCH": "constexpr"}
XS_SIG = {"x_ptr": "*bf16", "p_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
          "ws_ptr": "*fp32", "cnt_ptr": "*i32", "norm_w_ptr": "*bf16", "res_ptr": "*bf16", "eps": "fp32", "N": "i32",
          "K": "i32", "stride_pk": "i32", "stride_pn": "i32", "stride_sk": "i32", "stride_sn": "i32",
          "stride_zk": "i32", "stride_zn": "i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
          "kc_ptr": "*bf16", "vc_ptr": "*bf16", "n_rot_rows": "i32", "n_k_rows": "i32", "n_slots": "i32"}
XS8_SIG = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "norm_w_ptr": "*bf16", "res_ptr": "*bf16", "eps": "fp32", "N": "i32", "K": "i32",
           "stride_wk": "i32", "stride_wn": "i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
           "kc_ptr": "*bf16", "vc_ptr": "*bf16", "n_rot_rows": "i32", "n_k_rows": "i32", "n_slots": "i32"}
# the 8B decode step's stationary GEMVs as the engine launches them, plain and with what they take in:
# (name, N, K, tile: "split" | "whole" | None for labkit's pick, constexprs beyond the tile)
XS_CASES = [("qkv", 6144, 4096, "split", {}), ("qkv", 6144, 4096, "whole", {}),
            ("qkv norm", 6144, 4096, "split", {"NORM_CHUNKS": 8}),
            ("qkv norm", 6144, 4096, "whole", {"NORM_CHUNKS": 1}),
            ("qkv norm rope", 6144, 4096, "split", {"NORM_CHUNKS": 8, "ROPE_HALF": 64}),
            ("o", 4096, 4096, "whole", {}), ("o residual", 4096, 4096, "whole", {"RESIDUAL": True}),
            ("gate_up", 28672, 4096, "split", {}), ("gate_up norm", 28672, 4096, "split", {"NORM_CHUNKS": 8}),
            ("down", 4096, 14336, "split", {}),
            ("down swiglu residual", 4096, 14336, "split", {"SWIGLU": True, "RESIDUAL": True})]
_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _jit_kernels():
    """The kernel modules with compilable ``JITFunction``s (labkit routes Triton through its interpreter on a CPU
    host, so they are imported again with it off, helpers first): ``(splitk, stationary)``. Leaves the interpreter
    off for the rest of the process."""
    import importlib

    import labkit.kernels.quantized_matmul as qm

    os.environ.pop("TRITON_INTERPRET", None)
    mods = [importlib.reload(m) for m in (qm.ptx, qm.fused, qm.splitk, qm.stationary)]
    return mods[2], mods[3]


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _loop(sass: str) -> list[str]:
    """The instructions of the weight loop: of the loops (a backward branch and what it jumps over), the one with
    the most multiplies (HFMA2, HMUL2, FFMA, FMUL), not a reduction's wait loop that may be longer."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]
    spans = [(int(m.group(1), 16), addr) for addr, text in ins
             if (m := re.search(r"BRA.*0x([0-9a-f]+)", text)) and int(m.group(1), 16) < addr]

    def body(span):
        return [t for a, t in ins if span[0] <= a <= span[1]]

    def multiplies(span):
        return sum(_opcode(t) in ("HFMA2", "HMUL2", "FFMA", "FMUL") for t in body(span))
    return body(max(spans, key=lambda sp: (multiplies(sp), sp[1] - sp[0]))) if spans else []


def _opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def report(fn, signature: dict, constexprs: dict, num_warps: int, weights_per_thread: int,
           sass_to: str | None = None) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # as a launch at LLM shapes specialises them: pointers 16-byte aligned, every integer a multiple of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
             if ty != "constexpr" and not name.endswith("_mask")}  # (the byte masks are 0xFF and 0xFF00)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps,
                                                                           "num_stages": 1})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True)
    sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    if sass_to:
        Path(sass_to).parent.mkdir(parents=True, exist_ok=True)
        Path(sass_to).write_text(sass)
    res = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage.stdout))
    body = _loop(sass)
    ops: dict[str, int] = {}
    for t in body:
        ops[_opcode(t)] = ops.get(_opcode(t), 0) + 1
    return {"registers": int(res.get("REG", 0)), "spill_bytes": int(res.get("LOCAL", 0)),
            "loop_instructions": len(body), "per_weight": len(body) / weights_per_thread,
            "top_ops": sorted(ops.items(), key=lambda kv: -kv[1])[:8]}


def xs_report(stationary, group: int = 128, bits: int = 4, sass_to: str | None = None) -> list[dict]:
    """Registers, spills and loop instructions of the stationary GEMV -- int4 (``_w4_gemv_xs``, words paired where
    groups hold two) or, with ``bits=8``, int8 (``_w8_gemv_xs``) -- in ``XS_CASES``, with the tiles labkit's rule
    picks on 132 SMs (``split``: the split tile; ``whole``: the whole-K tile); ``sass_to``: a folder for each case's
    whole SASS."""
    from labkit.kernels.quantized_matmul import HOPPER, stationary_plan

    rule = HOPPER.w4_stationary if bits == 4 else HOPPER.w8_stationary
    kernel, sig0 = (stationary._w4_gemv_xs, XS_SIG) if bits == 4 else (stationary._w8_gemv_xs, XS8_SIG)
    rows = []
    for name, n, k, kind, extra in XS_CASES:
        forced = replace(rule, whole_k=None) if kind == "split" else replace(
            rule, whole_k=None, split=replace(rule.whole_k, block_k=k))
        plan = stationary_plan(n, k, group if bits == 4 else 4, forced, 132, pair_words=bits == 4 and group >= 16)
        meta = plan.meta(bits) | {"PDL": False, "SWIGLU": False, "NORM_CHUNKS": 0, "RESIDUAL": False,
                                  "ROPE_HALF": 0, "HALF_MATH": 1, **extra, **({"GROUP": group} if bits == 4 else {})}
        sig = dict(sig0, **{key: "constexpr" for key in meta})
        per_thread = plan.block_n * plan.block_k // (32 * plan.num_warps)  # weights a row block gives a thread
        r = report(kernel, sig, meta, plan.num_warps, per_thread, sass_to=sass_to and f"{sass_to}/{bits}_"
                   f"{name.replace(' ', '_')}_{kind}.sass")
        rows.append({"case": name, "bits": bits, "pair_words": plan.pair_words, "N": n, "K": k, "tile": kind,
                     "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "ROW_STEPS": plan.row_steps,
                     "num_warps": plan.num_warps, "registers": r["registers"], "spill_bytes": r["spill_bytes"],
                     "loop_instructions": r["loop_instructions"], "per_weight": r["per_weight"]})
        print(f"xs int{bits} {name:22s} {kind:5s} {plan.block_n}x{plan.block_k} x{plan.row_steps}, "
              f"{plan.num_warps} warps: {r['registers']} registers, {r['spill_bytes']} B spilled, "
              f"{r['loop_instructions']} loop instructions ({r['per_weight']:.2f} per weight)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", nargs="+", default=["w8", "w4"], choices=["w8", "w4", "xs", "w8xs"],
                    help="w8 / w4: the split-K GEMVs' candidate tiles; xs / w8xs: the stationary int4 / int8 GEMV at "
                         "the 8B decode shapes, plain and fused (XS_CASES)")
    ap.add_argument("--out", help="with --kernel xs / w8xs: folder for records/sass_xs.json / sass_w8xs.json")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--prefetch", action="store_true", help="w4: loads issued a step ahead (PREFETCH)")
    ap.add_argument("--float32", action="store_true", help="w4: the float32 path (float32 activations) instead of "
                    "packed float16 math")
    ap.add_argument("--sass", help="xs / w8xs: a folder for each case's whole SASS")
    ap.add_argument("--weights", type=float, default=4096 * 14336, help="weights of the layer, for the issue time")
    args = ap.parse_args(argv)
    splitk, stationary = _jit_kernels()
    for name, bits in (("xs", 4), ("w8xs", 8)):
        if name not in args.kernel:
            continue
        rows = xs_report(stationary, args.group, bits, args.sass)
        if args.out:
            from labkit.bench import write_record

            record = {"target": "sm_90", "triton": triton.__version__, "rows": rows}
            print("wrote", write_record(f"sass_{name}", record, out_dir=args.out))
    from labkit.kernels.quantized_matmul.tuning import SPLITK_CANDIDATES

    for name in (k for k in args.kernel if k in ("w8", "w4")):
        tiles = SPLITK_CANDIDATES.w8_tiles if name == "w8" else SPLITK_CANDIDATES.w4_tiles
        for bn, bk, warps in tiles:
            meta = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 4, "LOAD_STAGES": 1}
            if name == "w8":
                meta.update(WORDS_ALIGNED=True, EVEN=True)
                r = report(splitk._w8_gemv, W8_SIG, meta, warps, bn * bk // (32 * warps))
            else:
                bk = max(bk, args.group)
                meta.update(GROUP=args.group, BLOCK_K=bk, EVEN=True, HALF_MATH=0 if args.float32 else 1,
                            PREFETCH=args.prefetch)
                r = report(splitk._w4_gemv, W4_SIG, meta, warps, bn * bk // (32 * warps))
            issue_us = r["per_weight"] * args.weights / H200_LANE_INSTR_PER_S * 1e6
            print(f"{name} tile {bn}x{bk}, {warps} warps: {r['registers']} registers, {r['spill_bytes']} B spilled, "
                  f"{r['per_weight']:.2f} instructions per weight (issue alone {issue_us:.1f} us for "
                  f"{args.weights / 1e6:.1f} M weights); {r['top_ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
