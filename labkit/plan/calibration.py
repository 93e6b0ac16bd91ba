"""Calibrating the planner on measured GPU records, and validating it against them.

``fit_calibration`` fits the step model to a step sweep (``scripts/bench_step_sweep.py``: decode and prefill steps
of the engine by weight format, batch and context). ``kernel_paths`` reads the further paths measured per format in
the committed records: the engine's batch-1 steps of notebook 04 (labkit's GEMVs, FP8 through
``torch._scaled_mm``), KV attention per KV format of notebook 03, and the per-format GEMMs of
``labkit.experiments.quantization.format_gemm`` (labkit's kernels beside tinygemm, gemlite, torchao, cuBLAS int8 and
FP8, on the 8B and the 175B layer, at every batch measured). Each path stands for the batch it was measured at only.
``load_calibration`` joins the two.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from labkit.data import REPO_ROOT
from labkit.hardware import Hardware
from labkit.model import get_config
from labkit.plan.inputs import Calibration, Cluster, KernelPath
from labkit.plan.steps import decode_parts, decode_step_time, prefill_time
from labkit.quant.peers import LEGACY_NAMES

RECORDS = REPO_ROOT / "results" / "h200" / "records"
STEP_SWEEP_RECORD = RECORDS / "step_sweep.json"
"""The committed step sweep the planner is fitted to."""
FORMAT_GEMM_RECORD = RECORDS / "format_gemm.json"
"""Per-format GEMMs (labkit's and the peers') by batch, written by ``labkit.experiments.quantization.format_gemm``."""

NOMINAL = Calibration({"bf16": 0.8}, {"bf16": 0.6}, 1e-6, "nominal (no measured record): 80% of bandwidth, 60% "
                      "of matmul rate, 1 us per layer")
"""The calibration used where no step sweep is committed."""


def _nnls(a, b):
    """Non-negative least squares (Lawson-Hanson active set) on float64 tensors: ``argmin |a x - b|, x >= 0``."""
    import torch

    n = a.shape[1]
    active = torch.zeros(n, dtype=torch.bool)
    x = torch.zeros(n, dtype=torch.float64)
    for _ in range(10 * n):
        grad = a.T @ (b - a @ x)
        if active.all() or grad[~active].max() <= 1e-12 * max(1.0, float(grad.abs().max())):
            break
        active[torch.where(~active, grad, torch.tensor(-math.inf, dtype=torch.float64)).argmax()] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[active] = torch.linalg.lstsq(a[:, active], b[:, None]).solution[:, 0]
            if (z[active] > 0).all():
                x = z
                break
            neg = active & (z <= 0)
            alpha = (x[neg] / (x[neg] - z[neg])).min()
            x = x + alpha * (z - x)
            active &= x > 1e-15
    return x


def _fit_excess(floors: list[float], features: list[list[float]], times: list[float]):
    """Non-negative coefficients ``c`` of ``time = floor + features . c``, minimising *relative* errors (a 7 ms
    and a 340 ms step count alike)."""
    import torch

    t = torch.tensor(times, dtype=torch.float64)
    a = torch.tensor(features, dtype=torch.float64) / t[:, None]
    b = (t - torch.tensor(floors, dtype=torch.float64)) / t
    return [float(c) for c in _nnls(a, b)]


def fit_calibration(rows: list[dict], spec, bandwidth: float, peak: float, source: str = "") -> Calibration:
    """Fit a ``Calibration`` to measured single-GPU steps (rows of ``scripts/bench_step_sweep.py``).

    Decode: ``t = W/B + KV/B + [W/B per precision, KV/B, params x (quantised and batch > 1) per precision] . c``
    with ``c >= 0``, so every efficiency ``1 / (1 + c)`` is at most 1; prefill likewise with ``FLOPs / peak`` per
    precision and a per-layer intercept. Both by relative-error non-negative least squares.

    A sweep varies batch and context but not the weight bytes of a precision, so a fixed per-step cost cannot be
    told apart from a lower weight-read efficiency: decode's ``layer_overhead_s`` is left at 0 and that cost is
    folded into ``bandwidth_eff`` (what a step pays besides the bytes' floor then scales with the weights, which
    under-states it for wide tensor-parallel layouts whose shards are small).
    """
    spec = get_config(spec, "spec")
    dec = [r for r in rows if r["phase"] == "decode"]
    pre = [r for r in rows if r["phase"] == "prefill"]
    if not dec or not pre:
        raise ValueError("rows must hold decode and prefill measurements (scripts/bench_step_sweep.py)")
    ws = sorted({r["weights"] for r in rows})
    quant = [w for w in ws if w not in ("bf16", "fp16")]
    floors, feats = [], []
    for r in dec:
        wb, kvb = (x / bandwidth for x in decode_parts(spec, 1, 1, r["batch"], r["context"] + 1, r["weights"],
                                                       "bf16"))
        batched = r["batch"] > 1
        floors.append(wb + kvb)
        feats.append([wb * (r["weights"] == w) for w in ws] + [kvb] +
                     [spec.matmul_params * (batched and r["weights"] == w) for w in quant])
    c = _fit_excess(floors, feats, [r["median_s"] for r in dec])
    n = len(ws)
    swept = {w: (min(r["batch"] for r in dec if r["weights"] == w), max(r["batch"] for r in dec if r["weights"] == w))
             for w in ws if any(r["weights"] == w for r in dec)}
    eff = {w: 1.0 / (1.0 + c[i]) for i, w in enumerate(ws)}
    kv_eff = 1.0 / (1.0 + c[n])
    dequant = {w: c[1 + n + i] for i, w in enumerate(quant)}
    pfl = [spec.prefill_flops(r["context"]) / peak for r in pre]
    cp = _fit_excess(pfl, [[spec.num_layers] + [f * (r["weights"] == w) for w in ws] for f, r in zip(pfl, pre)],
                     [r["median_s"] for r in pre])
    comp = {w: 1.0 / (1.0 + cp[1 + i]) for i, w in enumerate(ws) if any(r["weights"] == w for r in pre)}
    return Calibration(eff, comp, 0.0, source, kv_eff=kv_eff, dequant_s_per_param=dequant,
                       prefill_layer_overhead_s=cp[0], swept_batches=swept)


def _shown(path: Path) -> str:
    try:
        return str(Path(path).relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _read(path: Path) -> dict | None:
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def kernel_paths(records: Path | str = RECORDS, format_gemm: dict | None = None
                 ) -> tuple[tuple[KernelPath, ...], tuple[KernelPath, ...]]:
    """(weight paths, KV paths) measured in the committed records under ``records`` (and in ``format_gemm``, a
    fresh ``peers.measure`` result, which replaces the committed one). Each is a ratio to bf16 timed in the
    same record, at one batch, on one layer shape (``KernelPath.params``; rows of a record from before shapes were
    recorded are the 8B layer's)."""
    from labkit.model import get_config

    eight_b = get_config("llama-3-8b")
    eight_b_params = eight_b.attn_params_per_layer + eight_b.mlp_params_per_layer
    records = Path(records)
    weights: list[KernelPath] = []
    kv: list[KernelPath] = []
    q = _read(records / "04_quantization.json")
    if q is not None:
        rec, machine = _shown(records / "04_quantization.json"), q["env"].get("device", "?")
        rows = {r["method"]: r for r in q["data"].get("trade_off", []) if r.get("timed as") == "engine_graph"}
        base = rows.get("base", {}).get("decode step (ms)")
        names = {"int8": ("int8", "labkit int8 GEMV, engine step"), "int4": ("int4", "labkit int4 GEMV, engine step"),
                 "fp8": ("fp8", "torch._scaled_mm W8A8, engine step")}
        for method, (fmt, path) in names.items():
            if base and method in rows:
                weights.append(KernelPath(fmt, path, 1, rows[method]["decode step (ms)"] / base, rec, machine,
                                          eight_b_params))
    k = _read(records / "03_kernels.json")
    if k is not None:
        rec, machine = _shown(records / "03_kernels.json"), k["env"].get("device", "?")
        att = {r["attention"]: r["us"] for r in k["data"].get("kv_quant_attention", [])}
        batch = int(k["data"].get("sweep_sizes", {}).get("paged", [[32]])[0][0])
        if "bf16 cache" in att and "int8 cache, dequantised in the kernel" in att:
            kv.append(KernelPath("int8", "labkit paged attention, int8 dequantised in the kernel", batch,
                                 att["int8 cache, dequantised in the kernel"] / att["bf16 cache"], rec, machine))
    g = format_gemm
    rec = "this run"
    if g is None:
        full = _read(records / "format_gemm.json")
        g, rec = (full["data"], _shown(records / "format_gemm.json")) if full else (None, "")
    if g is not None:
        for r in g["rows"]:
            ok = r.get("status", "ok") == "ok" and _finite(r.get("us")) and _finite(r.get("bf16_us"))
            if r["weights"] != "bf16" and ok:
                path = LEGACY_NAMES.get(r["path"], r["path"])
                weights.append(KernelPath(r["weights"], path, int(r["batch"]), r["us"] / r["bf16_us"], rec,
                                          g.get("device", "?"), int(r.get("layer_params", eight_b_params))))
    return tuple(weights), tuple(kv)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def multi_gpu_records(root: Path | str = REPO_ROOT / "results") -> tuple[dict, str]:
    """(collective fits, multi-GPU step record) from the committed multi-GPU runs (``scripts/bench_multigpu.py``
    writes ``results/<gpu>x<N>/records/multigpu_comm.json`` and ``multigpu_tp.json``): the fits of the run with
    the most GPUs, and the path of its TP step record ("" when there is none: TP > 1 is not validated)."""
    fits, tp = {}, ""
    for path in sorted(Path(root).glob("*x[0-9]*/records/multigpu_comm.json"), key=lambda p: (len(str(p)), p)):
        fits = {k: v for k, v in (_read(path) or {}).get("data", {}).get("fits", {}).items() if "alpha_s" in v}
    steps = sorted(Path(root).glob("*x[0-9]*/records/multigpu_tp.json"), key=lambda p: (len(str(p)), p))
    if steps:
        tp = _shown(steps[-1])
    return fits, tp


def load_calibration(path: Path | str = STEP_SWEEP_RECORD, records: Path | str | None = None,
                     format_gemm: dict | None = None, multi_gpu_root: Path | str = REPO_ROOT / "results"
                     ) -> tuple[Calibration, dict | None]:
    """Calibration from a committed step-sweep record joined with the kernel paths of the records beside it (or
    of ``records``) and the collectives and TP steps measured on several GPUs (``multi_gpu_records``), or
    ``NOMINAL`` (and ``None``) when there is no sweep."""
    path = Path(path)
    if not path.exists():
        return NOMINAL, None
    rec = json.loads(path.read_text())
    cal = calibration_of(rec, _shown(path))
    w, kv = kernel_paths(path.parent if records is None else records, format_gemm)
    fits, tp = multi_gpu_records(multi_gpu_root)
    machines = {rec.get("env", {}).get("device", "?")} | {p.machine for p in (*w, *kv)}
    return replace(cal, kernels=w, kv_paths=kv, machine=" + ".join(sorted(machines)), collectives=fits,
                   multi_gpu=tp), rec


def calibration_of(record: dict, source: str = "", rows: list[dict] | None = None) -> Calibration:
    """``fit_calibration`` on a step-sweep record's rows (or on ``rows``, a subset of them)."""
    data = record["data"]
    c = data["ceilings"]
    return fit_calibration(data["rows"] if rows is None else rows, data["preset"], c["copy_bytes_per_s"],
                           c["matmul_flops"], source=source)


def validate(record: dict, cal: Calibration, gpu: Hardware, held_out: bool = False) -> list[dict]:
    """Predicted against measured step times for every single-GPU configuration in a step-sweep record.

    ``held_out=True`` predicts each row from a calibration fitted to the *other* rows (leave-one-out), the honest
    error of a model with several fitted parameters; ``cal`` is then not used. Only the sweep's own fitted path
    is validated (the kernel paths are other records' measurements)."""
    spec = get_config(record["data"]["preset"])
    cluster = Cluster(gpu, gpus_per_node=1, nodes=1)
    rows = record["data"]["rows"]
    cal = replace(cal, kernels=(), kv_paths=())
    out = []
    for i, r in enumerate(rows):
        if held_out:
            cal = calibration_of(record, "leave-one-out", rows[:i] + rows[i + 1:])
        if r["phase"] == "decode":
            pred = decode_step_time(spec, cluster, cal, 1, 1, r["batch"], r["context"] + 1, r["weights"], "bf16")
        else:
            pred = prefill_time(spec, cluster, cal, 1, 1, r["context"], r["weights"])
        out.append({"phase": r["phase"], "weights": r["weights"], "batch": r["batch"], "context": r["context"],
                    "measured_ms": r["median_s"] * 1e3, "predicted_ms": pred * 1e3,
                    "abs_pct_err": abs(pred - r["median_s"]) / r["median_s"]})
    return out


def mape(rows: list[dict]) -> float:
    """Mean absolute percentage error of ``validate``'s rows."""
    if not rows:
        raise ValueError("rows is empty: nothing to average")
    return sum(r["abs_pct_err"] for r in rows) / len(rows)
