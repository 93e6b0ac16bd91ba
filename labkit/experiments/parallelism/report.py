"""Turn per-rank results of the rank functions (``ranks.py``) into tables and plots (used by notebook 06).

``launch`` returns one result per rank; a pipeline's bubble is a property of all stages together, so these
helpers join the ranks' rows: the measured bubble of a schedule is the mean idle share over its stages.
"""

from __future__ import annotations

from labkit.bench import collectives
from labkit.parallel import bubble_formula


def bubble_table(results: list[dict]) -> list[dict]:
    """One row per (kind, m) from ``pp_bubble``'s per-rank results: measured bubble (mean over stages), each
    stage's, the formula, the schedule's time (slowest stage) and peak activation memory (largest stage)."""
    p = len(results)
    keys = [(r["kind"], r["m"]) for r in results[0]["rows"]]
    rows = []
    for i, (kind, m) in enumerate(keys):
        per = [res["rows"][i] for res in results]
        if any((r["kind"], r["m"]) != (kind, m) for r in per):
            raise ValueError("ranks' rows are not aligned: every rank must run the same (kind, m) sequence")
        rows.append({"kind": kind, "stages": p, "m": m,
                     "bubble_measured": sum(r["bubble"] for r in per) / p,
                     "bubble_per_stage": [r["bubble"] for r in per], "bubble_formula": bubble_formula(p, m),
                     "total_s": max(r["total_s"] for r in per),
                     "busy_per_stage_s": [r["busy_s"] for r in per],
                     "peak_inflight_per_stage": [r["peak_inflight"] for r in per],
                     "peak_activation_bytes": max(r["peak_activation_bytes"] for r in per)})
    return rows


def plot_schedule_timeline(results: list[dict], kind: str, m: int, ax) -> None:
    """Gantt chart of one schedule: a bar per forward (F) and backward (B) micro-batch on each stage."""
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for res in results:
        row = next(r for r in res["rows"] if r["kind"] == kind and r["m"] == m)
        for k, j, start, end in row["events"]:
            ax.barh(res["rank"], (end - start) * 1e3, left=start * 1e3, color=colors[k], edgecolor="white")
            ax.text((start + end) / 2 * 1e3, res["rank"], f"{k}{j}", ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(len(results)), [f"stage {r['rank']}" for r in results])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the common start")
    ax.set_title(f"{kind}, {len(results)} stages, m={m}")


def comm_fits(rows: list[dict]) -> dict:
    """Alpha-beta fit per op of a ``collectives.sweep``: ``{op: {"alpha_us", "beta_gb_s"}}`` (or ``{"error"}`` when the
    timings are too noisy to fit)."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = [(r["bytes"], r["seconds"]) for r in rows if r["op"] == op]
        try:
            alpha, beta = collectives.fit_alpha_beta([b for b, _ in pts], [s for _, s in pts])
            out[op] = {"alpha_us": alpha * 1e6, "beta_gb_s": beta / 1e9}
        except ValueError as e:
            out[op] = {"error": str(e)}
    return out


def plot_comm(rows: list[dict], fits: dict, ax) -> None:
    """Time per op against message size (log-log) with each op's fitted ``alpha + bytes / beta`` line."""
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = sorted((r["bytes"], r["seconds"]) for r in rows if r["op"] == op)
        line = ax.loglog([b for b, _ in pts], [s * 1e6 for _, s in pts], "o", label=f"{op} measured")
        f = fits.get(op, {})
        if "alpha_us" in f:
            xs = [b for b, _ in pts]
            ax.loglog(xs, [f["alpha_us"] + b / (f["beta_gb_s"] * 1e3) for b in xs], "-", color=line[0].get_color(),
                      label=f"{op}: {f['alpha_us']:.0f} us + bytes / {f['beta_gb_s']:.2f} GB/s")
    ax.set_xlabel("message bytes")
    ax.set_ylabel("time per op (us)")
    ax.legend(fontsize=7)


def case_175b_text(batch: int = 32, context: int = 2048, rec=None) -> str:
    """The prose of notebook 06's 175B case, every number from the planner's one cost model
    (``labkit.plan.worked_example_175b``: ``decode_step_parts`` calibrated on the committed single-GPU steps; bf16
    GPT-3 175B, ``batch`` sequences of ``context`` tokens, nodes of 8 GPUs): weights and KV, what TP8 holds per GPU
    and whether it fits an H100 and an H200, the all-reduce count and share of a TP8 step on NVLink, TP16 over
    InfiniBand against it, and (``rec``, a ``labkit.plan.Recommendation``) the planner's pick through the same
    function at the scenario's own batch and context."""
    from labkit.model import PRESETS
    from labkit.parallel import cost_model as cm
    from labkit.plan import steps, worked_example_175b

    spec = PRESETS["gpt3-175b"]
    rows = {hw: {(r["layout"], r["microbatches"]): r for r in worked_example_175b(hw, batch, context)}
            for hw in ("h100", "h200")}
    tp8, tp16 = rows["h200"]["TP8 x PP1", 1], rows["h200"]["TP16 x PP1", 1]
    fits = {hw: "fits" if rows[hw]["TP8 x PP1", 1]["fits"] else "does not fit" for hw in rows}
    shares = sorted(rows[hw]["TP8 x PP1", 1]["comm_frac"] for hw in rows)
    per_token = spec.kv_bytes_per_token("bf16")
    shrink = " (the KV cache would have to shrink: paging, int8 KV, a smaller batch)"
    all_reduces = cm.tp_comm(spec, 8, batch)["all_reduces"]
    caveat = f" ({tp8['caveat']})" if tp8["caveat"] else ""
    text = (f"GPT-3 175B in bf16: {spec.weight_bytes('bf16') / 1e9:.0f} GB of weights, and ({spec.num_layers} "
            f"layers x {spec.num_kv_heads} KV heads x {spec.head_dim}) a KV cache of {per_token / 1e6:.1f} MB per "
            f"token, so {batch} sequences of {context} tokens hold {per_token * batch * context / 1e9:.0f} GB of "
            f"KV. Every step time below is the planner's cost model (`labkit.plan.decode_step_parts`), calibrated on "
            f"{tp8['calibrated_on']}'s measured single-GPU steps{caveat}.\n\n"
            f"* **Weights and KV per GPU.** TP8 on one node holds {tp8['weights_gb']:.0f} GB of weights per GPU; the "
            f"KV cache of {batch} x {context} tokens adds {tp8['kv_gb']:.0f} GB. On 80 GB H100s that "
            f"{fits['h100']}{shrink if fits['h100'] != 'fits' else ''}; on 141 GB H200s it {fits['h200']}.\n"
            f"* **TP inside a node.** Each decode step does {all_reduces} all-reduces. On NVLink they are "
            f"latency-bound (microseconds each), {shares[0]:.0%} to {shares[-1]:.0%} of a "
            f"{tp8['step_s'] * 1e3:.0f} ms step on the H200. Across nodes (TP16 over InfiniBand) they cost "
            f"{tp16['tp_comm_s'] / tp8['tp_comm_s']:.1f}x more and communication is {tp16['comm_frac']:.0%} of the "
            f"step: never stretch TP over the node boundary.")
    if rec is not None and rec.best is not None:
        b = rec.best
        traffic = rec.scenario.traffic()
        ctx = int(traffic.mean("prompt") + traffic.mean("output") / 2)
        mine = steps.decode_step_parts(spec, rec.scenario.cluster(rec.gpu), rec.cal, b.tp, b.pp, b.max_batch, ctx,
                                       b.weights, b.kv)
        text += (f"\n* **The planner's pick, through the same function.** At the scenario's traffic "
                 f"({rec.scenario.rate_req_s:g} requests/s, TPOT objective {rec.scenario.tpot_s * 1e3:.0f} ms) the "
                 f"planner chooses {b.replicas} replicas of TP{b.tp} x PP{b.pp} ({b.weights} weights, {b.kv} KV): "
                 f"at its largest batch, {b.max_batch}, and its mean context, {ctx} tokens, a step takes "
                 f"{mine['step_s'] * 1e3:.0f} ms, not the {tp8['step_s'] * 1e3:.0f} ms above, which is TP8 at "
                 f"batch {batch} and context {context}: one model, two operating points.")
    return text
