"""The planner's per-format kernels: one decoder layer's matmuls by every path a weight format can take, at the
batches the planner plans for, timed against cuBLAS bf16 in the same run (notebook 08 under the gpu profile).

Paths: bf16 ``F.linear`` (cuBLAS); int8: labkit's ``Int8Linear`` (Triton, weight-only) and cuBLAS
``torch._int_mm`` W8A8 (activations quantised per token on the fly, both scales applied after); int4: labkit's
``Int4Linear``; FP8: ``Fp8Linear`` on ``torch._scaled_mm`` (row-wise scales, the per-token activation
quantisation included). Each row: ``{weights, path, batch, us, bf16_us}``; ``labkit.plan.kernel_paths`` turns them
into ratios to bf16 and the planner takes the fastest path per format at its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model import get_config

BATCHES = (1, 8, 32, 64, 128, 256)
"""Decode batches (rows of the activation) the planner plans for."""


def layer_shapes(preset: str = "llama-3-8b") -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one decoder layer's linears: fused q/k/v, o, fused gate/up, down."""
    s = get_config(preset)
    kv = s.num_kv_heads * s.head_dim
    return [(s.num_heads * s.head_dim + 2 * kv, s.hidden_size), (s.hidden_size, s.num_heads * s.head_dim),
            (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size)]


class Int8MMLinear(nn.Module):
    """W8A8 through cuBLAS ``torch._int_mm``: int8 weight ``[N, K]`` with per-row scales, activations quantised
    per token; int32 accumulation, scales applied in float32. ``_int_mm`` needs more than 16 rows: smaller
    batches are padded (the padding is part of the path's cost)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight_t", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).t())
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        xs = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        xq = (x.float() / xs).round().clamp(-127, 127).to(torch.int8)
        if m <= 16:
            xq = F.pad(xq, (0, 0, 0, 32 - m))
        y = torch._int_mm(xq, self.qweight_t)[:m]
        return (y.float() * xs * self.scale).to(x.dtype)


def paths(linear: nn.Linear) -> dict[str, tuple[str, nn.Module]]:
    """``{path: (weight format, module)}`` for one bf16 linear on CUDA."""
    from labkit.quant.fp8 import Fp8Linear, fp8_supported
    from labkit.quant.weight_only import Int4Linear, Int8Linear

    out = {"cuBLAS bf16": ("bf16", linear), "labkit Int8Linear (Triton)": ("int8", Int8Linear.from_linear(linear)),
           "torch._int_mm W8A8 (cuBLAS)": ("int8", Int8MMLinear(linear)),
           "labkit Int4Linear (Triton)": ("int4", Int4Linear.from_linear(linear))}
    if fp8_supported(linear.weight.device):
        out["torch._scaled_mm W8A8 (cuBLAS)"] = ("fp8", Fp8Linear.from_linear(linear, backend="scaled_mm"))
    return out


def measure(preset: str = "llama-3-8b", batches: tuple[int, ...] = BATCHES, iters: int = 20) -> dict:
    """Time one layer's linears of ``preset`` by every path at every batch (CUDA graphs, so launches do not
    count); returns ``{"device", "preset", "rows"}`` for ``labkit.plan.kernel_paths(format_gemm=...)``."""
    if not torch.cuda.is_available():
        raise RuntimeError("formats.measure times GPU kernels (cuBLAS int8/FP8, Triton); it needs CUDA: on the "
                           "CPU the planner reads the committed results/h200/records/format_gemm.json instead")
    from labkit.bench import time_fn

    gen = torch.Generator(device="cuda").manual_seed(0)
    linears = [nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for n, k in layer_shapes(preset)]
    for lin in linears:
        lin.weight.data.normal_(0, 0.02, generator=gen)
    per_path = [paths(lin) for lin in linears]
    rows = []
    for b in batches:
        xs = [torch.randn(b, lin.in_features, device="cuda", dtype=torch.bfloat16, generator=gen) for lin in linears]
        times, status = {}, {}
        for name in per_path[0]:
            mods = [p[name][1] for p in per_path]
            try:
                with torch.no_grad():
                    t = time_fn(lambda mods=mods, xs=xs: [m(x) for m, x in zip(mods, xs)], device="cuda", iters=iters,
                                cuda_graph=True)
                times[name], status[name] = t.median_s * 1e6, "ok"
            except (RuntimeError, ValueError) as e:  # a path this GPU or shape cannot run: recorded, not fatal
                times[name], status[name] = float("nan"), f"{type(e).__name__}: {str(e)[:200]}"
        for name, (fmt, _) in per_path[0].items():
            rows.append({"weights": fmt, "path": name, "batch": b, "us": times[name],
                         "bf16_us": times["cuBLAS bf16"], "status": status[name]})
    return {"device": torch.cuda.get_device_name(), "preset": preset, "rows": rows}
