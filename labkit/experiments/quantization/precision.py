"""FP32 vs TF32 vs BF16 vs FP16 vs INT8 vs FP8: what each buys in speed and what it costs in numerics.

Four experiments, each a function returning plain rows for a table:

* ``dtype_matmul_rates``: dense matmul throughput per dtype on the device at hand (tensor-core modes on the GPU:
  TF32, ``torch._int_mm`` for int8, ``torch._scaled_mm`` for FP8; the CPU shows what runs there).
* ``overflow_rows``: computations inside a transformer that overflow FP16's range (max 65504) and fit BF16's
  (max 3.4e38, the same exponent as FP32, with 8 bits of mantissa fewer).
* ``accumulation_rows``: a long sum kept in a running accumulator of each dtype: once the sum is 2^mantissa times
  larger than the addends, adding them changes nothing ("stagnation"). Why every kernel accumulates in FP32.
* ``softmax_rows`` / ``rmsnorm_rows``: the two reductions of a transformer layer computed in low precision, the
  naive way and the way HF and the kernels do it (subtract the max; upcast to FP32 inside the norm).

``perplexity_by_dtype`` closes the loop on the embedded model.
"""

from __future__ import annotations

import math

import torch

from labkit.bench import time_fn

MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "int8", "fp8")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --- matmul throughput ----------------------------------------------------------------------------------------------
CPU_FP8_SIZE = 256  # torch's FP8 matmul on the CPU is a scalar reference kernel: 45 s at size 1024


def _matmul_fn(name: str, size: int, device: torch.device, g: torch.Generator):
    """A zero-argument callable doing one ``size``-cubed matmul in ``name``, or a reason it cannot run here."""
    cuda = device.type == "cuda"
    a32 = torch.randn(size, size, generator=g).to(device)
    b32 = torch.randn(size, size, generator=g).to(device)
    if name in ("fp32", "tf32"):
        if name == "tf32" and not cuda:
            return "TF32 is a CUDA tensor-core mode (Ampere and later); the CPU has no TF32"
        return lambda: torch.mm(a32, b32)
    if name in ("bf16", "fp16"):
        a, b = a32.to(FLOAT_DTYPES[name]), b32.to(FLOAT_DTYPES[name])
        return lambda: torch.mm(a, b)
    if name == "int8":
        a = torch.randint(-127, 128, (size, size), generator=g, dtype=torch.int8).to(device)
        b = torch.randint(-127, 128, (size, size), generator=g, dtype=torch.int8).to(device)
        return lambda: torch._int_mm(a, b)  # int8 x int8 -> int32 accumulators
    from labkit.quant import FP8_DTYPE, fp8_supported

    if cuda and not fp8_supported(device):
        return "FP8 needs tensor cores of compute capability >= 8.9 (Ada, Hopper)"
    a = a32.to(FP8_DTYPE)
    b = b32.to(FP8_DTYPE).t().contiguous().t()  # _scaled_mm wants the second operand column-major
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def dtype_matmul_rates(size: int = 4096, device: torch.device | str | None = None, dtypes=MATMUL_DTYPES,
                 iters: int = 10, seed: int = 0) -> list[dict]:
    """Throughput of a square ``size`` matmul per dtype: rows ``{dtype, tflops, ms, status}`` (``tflops`` None
    with the reason in ``status`` where the dtype does not run on this device). Inputs are random, never zeros.
    TF32 is switched on only for its own row (``torch.backends.cuda.matmul.allow_tf32``), then restored. FP8 on
    the CPU runs once at size ``min(size, CPU_FP8_SIZE)`` (a scalar kernel; the row says so)."""
    from labkit.device import resolve_device

    unknown = [d for d in dtypes if d not in MATMUL_DTYPES]
    if unknown:
        raise ValueError(f"dtypes {unknown} are unknown; allowed: {list(MATMUL_DTYPES)}")
    if size < 16 or size % 16:
        raise ValueError(f"size={size} must be a multiple of 16 (int8 and fp8 tensor-core kernels need it)")
    dev = resolve_device(device)
    g = torch.Generator().manual_seed(seed)
    rows = []
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name in dtypes:
            slow = name == "fp8" and dev.type == "cpu"
            n = min(size, CPU_FP8_SIZE) if slow else size
            fn = _matmul_fn(name, n, dev, g)
            if isinstance(fn, str):
                rows.append({"dtype": name, "tflops": None, "ms": None, "status": fn})
                continue
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            try:
                t = time_fn(fn, device=dev, warmup=0 if slow else 2, iters=1 if slow else iters)
            except (RuntimeError, NotImplementedError) as e:  # an op this torch build lacks on this device
                rows.append({"dtype": name, "tflops": None, "ms": None, "status": f"does not run: {e}"[:200]})
                continue
            rows.append({"dtype": name, "tflops": 2 * n**3 / t.median_s / 1e12, "ms": t.median_ms,
                         "status": f"ok (torch's CPU reference kernel: one call at size {n})" if slow else "ok"})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return rows


# --- range ----------------------------------------------------------------------------------------------------------
def dtype_limits() -> list[dict]:
    """Largest value, smallest normal and machine epsilon of fp32, bf16, fp16 and FP8 e4m3/e5m2."""
    names = {**FLOAT_DTYPES, "fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
    return [{"dtype": n, "max": float(torch.finfo(d).max), "smallest_normal": float(torch.finfo(d).tiny),
             "eps": float(torch.finfo(d).eps), "mantissa_bits": round(-math.log2(torch.finfo(d).eps))}
            for n, d in names.items()]


def overflow_rows(seed: int = 0) -> list[dict]:
    """Three computations a transformer does, each evaluated in fp32, bf16 and fp16: the largest magnitude of
    the result (``inf`` where the dtype overflowed) and its relative error against float64."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4096, generator=g, dtype=torch.float64) * 300  # a residual stream with large outliers
    q = torch.randn(128, generator=g, dtype=torch.float64) * 25
    k = q + torch.randn(128, generator=g, dtype=torch.float64)
    cases = {
        "sum of squares of a hidden state (RMSNorm, |x| ~ 300)": (lambda x: (x * x).sum(), hidden),
        "exp of an attention logit of 12 (softmax without max-subtraction)":
            (lambda x: torch.exp(x), torch.tensor([12.0], dtype=torch.float64)),
        "q . k of two aligned head vectors (|q_i| ~ 25, head_dim 128)": (lambda x: (x[0] * x[1]).sum(),
                                                                         torch.stack([q, k])),
    }
    rows = []
    for what, (fn, x) in cases.items():
        ref = fn(x)
        for name, dt in FLOAT_DTYPES.items():
            out = fn(x.to(dt)).double()
            err = (out - ref).norm() / ref.norm()
            rows.append({"computation": what, "dtype": name, "result": float(out.abs().max()),
                         "overflow": not bool(torch.isfinite(out).all()),
                         "rel_error": float(err) if torch.isfinite(err) else math.inf})
    return rows


# --- accumulation ---------------------------------------------------------------------------------------------------
def running_sum(x: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """Sum ``x`` ``[n, batch]`` over its first dim one addend at a time in an accumulator of ``acc_dtype``
    (what a naive kernel loop does). ``torch.sum`` would hide the effect: it accumulates low-precision
    inputs in float32 and adds pairwise."""
    acc = torch.zeros(x.shape[1:], dtype=acc_dtype)
    for row in x:
        acc += row.to(acc_dtype)  # rounds to acc_dtype after every addition
    return acc


def accumulation_rows(lengths=(256, 1024, 4096, 16384), batch: int = 64, seed: int = 0) -> list[dict]:
    """Relative error of long sums of positive values (like a softmax denominator or a mean of squares) held in
    each dtype: ``naive`` keeps the running sum in the dtype, ``fp32_acc`` rounds the inputs to the dtype but
    accumulates in float32 (what tensor cores and the kernels do)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        x = torch.rand(n, batch, generator=g, dtype=torch.float64) + 0.5  # mean 1, never zero
        ref = x.sum(0)
        for name, dt in FLOAT_DTYPES.items():
            xd = x.to(dt)
            naive = running_sum(xd, dt).double()
            fp32 = running_sum(xd, torch.float32).double()
            rows.append({"n": n, "dtype": name,
                         "naive_rel_error": float(((naive - ref).abs() / ref).mean()),
                         "fp32_acc_rel_error": float(((fp32 - ref).abs() / ref).mean())})
    return rows


# --- softmax and RMSNorm ----------------------------------------------------------------------------------------------
def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())


def softmax_rows(logit_scales=(1.0, 5.0, 20.0), n: int = 4096, seed: int = 0) -> list[dict]:
    """Softmax over ``n`` logits of growing spread, in each dtype: ``naive`` = exp(x) / sum(exp(x)) all in the
    dtype; ``stable`` subtracts the max first (still all in the dtype); ``upcast`` computes in float32 and rounds
    the probabilities to the dtype (what HF attention and FlashAttention do). Errors are against float64 softmax
    of the same rounded logits."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for scale in logit_scales:
        x = torch.randn(8, n, generator=g, dtype=torch.float64) * scale
        for name, dt in FLOAT_DTYPES.items():
            xd = x.to(dt)
            ref = torch.softmax(xd.double(), dim=-1)  # of the rounded logits: only the computation's error counts
            e = torch.exp(xd)
            naive = e / running_sum(e.T, dt)[:, None]
            es = torch.exp(xd - xd.amax(dim=-1, keepdim=True))
            stable = es / running_sum(es.T, dt)[:, None]
            upcast = torch.softmax(xd.float(), dim=-1).to(dt)
            rows.append({"logit_std": scale, "dtype": name, "naive": _rel(naive, ref), "stable": _rel(stable, ref),
                         "upcast": _rel(upcast, ref)})
    return rows


def rmsnorm_rows(magnitudes=(1.0, 100.0, 1000.0), hidden: int = 4096, eps: float = 1e-5,
                 seed: int = 0) -> list[dict]:
    """RMSNorm ``x / sqrt(mean(x^2) + eps)`` of hidden states of growing magnitude, in each dtype: ``naive``
    squares, averages (sequential accumulator) and divides in the dtype; ``upcast`` does it in float32 and
    rounds the result (HF's ``LlamaRMSNorm``). Errors are against float64 on the same rounded input; an error of
    1.0 means the mean of squares overflowed to inf and the output collapsed to zero."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for mag in magnitudes:
        x = torch.randn(16, hidden, generator=g, dtype=torch.float64) * mag
        for name, dt in FLOAT_DTYPES.items():
            xd = x.to(dt)
            x64 = xd.double()  # the reference starts from the same rounded input
            ref = x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
            ms = running_sum((xd * xd).T, dt) / hidden
            naive = xd * torch.rsqrt(ms + eps)[:, None]
            xf = xd.float()
            upcast = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(dt)
            rows.append({"magnitude": mag, "dtype": name, "naive": _rel(naive, ref), "upcast": _rel(upcast, ref)})
    return rows


# --- the model --------------------------------------------------------------------------------------------------------
def perplexity_by_dtype(dtypes=("fp32", "bf16", "fp16"), seq_len: int = 256, max_windows: int | None = None,
                        device: str | None = "cpu", name_or_path: str | None = None) -> dict[str, float]:
    """Held-out perplexity of the embedded model (or a local checkpoint) with all weights and activations in
    each dtype (HF keeps RMSNorm and softmax in float32 internally, as above)."""
    from labkit.experiments.quantization.metrics import heldout_perplexity
    from labkit.model import load_model

    bad = [d for d in dtypes if d not in FLOAT_DTYPES]
    if bad:
        raise ValueError(f"dtypes {bad} are not model dtypes; allowed: {list(FLOAT_DTYPES)}")
    out = {}
    for name in dtypes:
        model, tok = load_model(name_or_path, device=device, dtype=FLOAT_DTYPES[name])
        out[name] = heldout_perplexity(model, tok, seq_len=seq_len, max_windows=max_windows)
        del model
    return out


def precision_figures(overflow: list[dict], accumulation: list[dict], dtype_ppl: list[dict]) -> dict[str, float]:
    """The numerics of FP32 vs BF16 vs FP16 as figures, from ``overflow_rows``, ``accumulation_rows`` and the
    notebook's perplexity-by-dtype rows (``{"dtype", "ppl change"}``): how many of the overflow cases fp16 and bf16
    overflow, the longest sum's error with a bf16 and an fp16 running accumulator and with bf16 inputs summed in
    fp32, that sum's length, and the perplexity change of the whole model in bf16."""
    out: dict[str, float] = {}
    cases = sorted({r["computation"] for r in overflow})
    if cases:
        out["quant.overflow_cases"] = len(cases)
        for d in ("fp16", "bf16"):
            out[f"quant.{d}_overflow_cases"] = sum(r["overflow"] for r in overflow if r["dtype"] == d)
    if accumulation:
        n = max(r["n"] for r in accumulation)
        at = {r["dtype"]: r for r in accumulation if r["n"] == n}
        out["quant.accum_terms"] = n
        if "bf16" in at:
            out["quant.bf16_accum_rel_err"] = at["bf16"]["naive_rel_error"]
            out["quant.bf16_fp32_accum_rel_err"] = at["bf16"]["fp32_acc_rel_error"]
        if "fp16" in at:
            out["quant.fp16_accum_rel_err"] = at["fp16"]["naive_rel_error"]
    ppl = {r["dtype"]: r["ppl change"] for r in dtype_ppl}
    if "bf16" in ppl:
        out["quant.bf16_model_ppl_delta_frac"] = abs(ppl["bf16"])
    return out
