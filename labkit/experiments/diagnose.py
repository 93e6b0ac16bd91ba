"""What notebook 01 measures: decode steps of Hugging Face eager inference profiled without their prefill, and the
regimes test that says, for each kind of operation, which resource bounds it.

``HFDecode`` prefills a batch on a fresh cache outside the measured region, so a profile of its call holds decode
steps only (a profile of ``generate`` at batch 64 and context 512 would be dominated by the 64 x 512-token
prefill). ``regimes`` times a decode step at a base (batch, context), at twice the batch and at twice the context,
splits each by operation category from the profiler's timeline, and classifies each category:

* **overhead-bound**: its time does not move when the work doubles, and is far above what its bytes and FLOPs
  need (launches, Python, the framework: the time is per call, not per byte);
* **bandwidth-bound**: its time follows the bytes it must move (weights: flat in batch, near the byte floor; KV
  reads: doubling with batch and with context) and its intensity is under the device's ridge point;
* **compute-bound**: its time follows the FLOPs and its intensity is above the ridge point.
"""

from __future__ import annotations

import torch

from labkit.profiling import CATEGORIES, ProfileResult, profile_run
from labkit.roofline import roofline

# roofline rows (``labkit.roofline.roofline``) -> the profiler category whose time they predict
ROOFLINE_CATEGORY = {"QKV/O projections": "matmul", "MLP": "matmul", "LM head": "matmul", "attention": "attention",
                     "norms and residuals": "norm/elementwise"}
FLAT, DOUBLES = 1.3, 1.6  # a time ratio under FLAT did not move; at or over DOUBLES it followed the work
OVERHEAD_FACTOR = 5.0  # flat and this many times over its floor: the time is per call, not per byte


class HFDecode:
    """Greedy decode steps of an HF causal LM on a ``DynamicCache`` prefilled outside the measured region.

    ``prompts``: int64 ``[batch, context]`` (equal lengths, no padding). ``prefill()`` resets the cache and runs the
    prompt; each call then runs ``steps`` one-token forwards (argmax fed back), as ``generate`` does per step minus
    its logits processors and stopping checks.
    """

    def __init__(self, model, prompts: torch.Tensor, steps: int):
        if prompts.dim() != 2 or prompts.dtype != torch.long:
            raise ValueError(f"prompts must be int64 [batch, context], got {prompts.dtype} {tuple(prompts.shape)}")
        if steps < 1:
            raise ValueError(f"steps={steps} must be at least 1")
        self.model, self.steps = model, steps
        self.prompts = prompts.to(next(model.parameters()).device)
        self.cache, self.next = None, None

    @torch.inference_mode()
    def prefill(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        out = self.model(input_ids=self.prompts, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        if self.prompts.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("call prefill() first")
        for _ in range(self.steps):
            out = self.model(input_ids=self.next, past_key_values=self.cache, use_cache=True)
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        return self.next


def profile_decode(model, batch: int, context: int, steps: int, seed: int = 0,
                   trace_path: str | None = None) -> ProfileResult:
    """A profile of ``steps`` HF eager decode steps of ``batch`` random prompts of ``context`` tokens, prefill
    excluded (one warm-up pass of prefill and steps first)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, model.config.vocab_size, (batch, context), generator=g)
    dec = HFDecode(model, prompts, steps)
    dec.prefill()
    dec()  # warm-up: kernels selected, allocator warm
    dec.prefill()
    res = profile_run(dec, steps=steps, warmup=0, trace_path=trace_path)
    del dec
    return res


def classify(ratio_batch: float, ratio_context: float, time_s: float, floor_s: float, intensity: float,
             ridge: float) -> str:
    """A category's regime from how its time moved when the batch and the context doubled (``ratio_*``: new time /
    base time), its base time against its floor (bytes / bandwidth or FLOPs / peak, whichever is larger) and its
    arithmetic intensity against the ridge point (FLOP/byte)."""
    if max(ratio_batch, ratio_context) < FLAT:
        return "overhead-bound" if floor_s <= 0 or time_s > OVERHEAD_FACTOR * floor_s else "bandwidth-bound"
    if max(ratio_batch, ratio_context) >= DOUBLES:
        return "compute-bound" if intensity > ridge else "bandwidth-bound"
    return "overhead-bound" if floor_s <= 0 or time_s > OVERHEAD_FACTOR * floor_s else "mixed"


def regimes(model, spec, hardware, batch: int, context: int, steps: int, dtype: str = "bf16",
            seed: int = 0) -> tuple[list[dict], dict]:
    """The regimes test: decode steps profiled at (batch, context), (2 batch, context) and (batch, 2 context).

    Returns one row per category (and one for the idle device) with its time per step at each point, the two
    ratios, the roofline floor and intensity at the base point, and its ``regime`` (``classify``); and the
    three profiles by point name.
    """
    points = {"base": (batch, context), "2x batch": (2 * batch, context), "2x context": (batch, 2 * context)}
    prof = {name: profile_decode(model, b, c, steps, seed) for name, (b, c) in points.items()}
    per_step = {name: {**{k: v / steps for k, v in p.by_category().items()}, "idle (host)": p.idle_s / steps}
                for name, p in prof.items()}
    roof = roofline(spec, hardware, batch=batch, context=context, phase="decode", dtype=dtype)
    rows = []
    for cat in (*CATEGORIES, "other", "idle (host)"):
        base = per_step["base"][cat]
        if base <= 0:
            continue
        rr = [r for r in roof.rows if ROOFLINE_CATEGORY.get(r.name) == cat]
        flops, nbytes = sum(r.flops for r in rr), sum(r.bytes for r in rr)
        floor = max(flops / hardware.bf16_flops, nbytes / hardware.mem_bandwidth) if rr else 0.0
        intensity = flops / nbytes if nbytes else 0.0
        rb, rc = per_step["2x batch"][cat] / base, per_step["2x context"][cat] / base
        regime = "overhead-bound" if cat == "idle (host)" else classify(rb, rc, base, floor, intensity,
                                                                        hardware.ridge_point)
        rows.append({"category": cat, "base ms/step": base * 1e3, "2x batch ms/step": per_step["2x batch"][cat] * 1e3,
                     "2x context ms/step": per_step["2x context"][cat] * 1e3, "ratio 2x batch": rb,
                     "ratio 2x context": rc, "floor ms/step": floor * 1e3, "FLOP/byte": intensity, "regime": regime})
    return rows, prof
