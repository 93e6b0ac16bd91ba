"""Notebook 06 (parallelism): where tensor parallelism puts its all-reduces and what they move, and TP against PP
on a given link (predicted, then set against the TP forward the notebook measured over gloo).

The splits follow Megatron-LM, as labkit's ``ColumnParallelLinear`` / ``RowParallelLinear`` do: a linear reading a
tensor every rank holds whole is split by output features (column: no communication, its output stays sharded); a
linear reading a sharded tensor is split by input features (row: each rank's output is a partial sum). The partial
sums of one sub-block are added into the residual stream, so one all-reduce of ``tokens x hidden`` per sub-block
combines them. Collective times follow ``labkit.parallel.cost_model`` (ring all-reduce, one send per stage boundary).
"""

from __future__ import annotations

from labkit.exercises.core import Case, Decision, Measurement, Prediction, diff, register
from labkit.exercises.measured import NoMeasurement, data_of, figure
from labkit.parallel.cost_model import Link, all_reduce_time, p2p_time

REPLICATED = ("x", "encoder")  # the normed residual stream and an encoder's output: whole on every rank


def tp_plan(block: list[dict], hidden: int, bytes_per_el: int, tp: int) -> dict:
    """Solution: split each linear of a transformer layer for tensor parallelism with one all-reduce per sub-block.

    ``block`` lists sub-blocks, each ``{"linears": {name: [inputs]}, "residual": [names]}``: an input is ``"x"`` or
    ``"encoder"`` (whole on every rank) or another linear's name; the ``residual`` linears' outputs are added to the
    residual stream. Returns ``{"splits": {name: "column" | "row"}, "all_reduces": per layer, "bytes_per_token":
    all-reduce payload per token per layer, "wire_bytes_per_token": what each GPU sends for it on a ring}``."""
    splits, all_reduces = {}, 0
    for sub in block:
        for name, inputs in sub["linears"].items():
            splits[name] = "column" if all(i in REPLICATED for i in inputs) else "row"
        if any(splits[n] == "row" for n in sub["residual"]):
            all_reduces += 1  # the row outputs' partial sums, summed once before the residual add
    payload = all_reduces * hidden * bytes_per_el
    return {"splits": splits, "all_reduces": all_reduces, "bytes_per_token": payload,
            "wire_bytes_per_token": 2 * (tp - 1) / tp * payload}


def _attn(q="q_proj", k="k_proj", v="v_proj", o="o_proj", kv_from="x") -> dict:
    return {"linears": {q: ["x"], k: [kv_from], v: [kv_from], o: [q, k, v]}, "residual": [o]}


def _mlp(gate="gate_proj", up="up_proj", down="down_proj") -> dict:
    lin = {up: ["x"], down: [up]} if gate is None else {gate: ["x"], up: ["x"], down: [gate, up]}
    return {"linears": lin, "residual": [down]}


LLAMA = [_attn(), _mlp()]
GPT2 = [{"linears": {"c_attn": ["x"], "attn.c_proj": ["c_attn"]}, "residual": ["attn.c_proj"]},
        {"linears": {"c_fc": ["x"], "mlp.c_proj": ["c_fc"]}, "residual": ["mlp.c_proj"]}]
PARALLEL = [{"linears": {"q_proj": ["x"], "k_proj": ["x"], "v_proj": ["x"], "o_proj": ["q_proj", "k_proj", "v_proj"],
                         "gate_proj": ["x"], "up_proj": ["x"], "down_proj": ["gate_proj", "up_proj"]},
             "residual": ["o_proj", "down_proj"]}]
FALCON = [{"linears": {"query_key_value": ["x"], "dense": ["query_key_value"], "dense_h_to_4h": ["x"],
                       "dense_4h_to_h": ["dense_h_to_4h"]}, "residual": ["dense", "dense_4h_to_h"]}]
DECODER_WITH_CROSS = [_attn("sa.q", "sa.k", "sa.v", "sa.o"), _attn("ca.q", "ca.k", "ca.v", "ca.o", kv_from="encoder"),
                      _mlp(None, "fc1", "fc2")]


def _plan_cases() -> list[Case]:
    rows = [("Llama layer (attention, then SwiGLU MLP)", LLAMA, 4096, 2, 8),
            ("GPT-2 layer (fused QKV c_attn, GELU MLP), float32", GPT2, 768, 4, 4),
            ("parallel block (GPT-J / PaLM: attention and MLP read the same normed input)", PARALLEL, 5120, 2, 2),
            ("Falcon layer (parallel, fused query_key_value)", FALCON, 8192, 2, 8),
            ("decoder layer with cross-attention (K and V from the encoder), then a 2-linear MLP", DECODER_WITH_CROSS,
             1024, 2, 4),
            ("Llama layer, int8 activations on the wire, TP 3", LLAMA, 3072, 1, 3)]
    return [Case(f"{label}: hidden {h}, {b} byte(s) per element, TP {tp}", (blk, h, b, tp))
            for label, blk, h, b, tp in rows]


register(Decision(
    "06.tp_plan", "split each linear column- or row-wise: one all-reduce per sub-block, and what it moves",
    tp_plan, _plan_cases, lambda fn, c: fn([{"linears": {k: list(v) for k, v in s["linears"].items()},
                                             "residual": list(s["residual"])} for s in c[0]], *c[1:]),
    lambda e, a: diff(e, a, rtol=1e-9),
    hint="an input whole on every rank ('x', 'encoder') -> column; an input that is a column linear's output "
         "(sharded) -> row; one all-reduce per sub-block whose residual outputs are row partial sums; payload "
         "hidden x bytes each; a ring sends 2 (tp - 1) / tp of it per GPU"))


def tp_or_pp(layers: int, hidden: int, tokens: int, bytes_per_el: int, gpus: int, bandwidth: float, latency: float,
             compute_s: float, objective: str = "latency") -> dict:
    """Solution: one forward of ``tokens`` tokens through ``layers`` layers, whose work takes ``compute_s`` on one
    GPU, spread over ``gpus`` GPUs joined by a link of ``bandwidth`` bytes/s and ``latency`` seconds per message.

    * TP: each GPU does ``compute_s / gpus`` and the layer's two ring all-reduces of ``tokens x hidden`` elements,
      ``2 (p - 1) latency + 2 (p - 1) / p x bytes / bandwidth`` each; latency and time per batch are the same.
    * PP (``gpus`` stages, ``gpus`` micro-batches in flight): a batch passes every stage, so its latency is
      ``compute_s`` plus ``p - 1`` sends of ``latency + bytes / bandwidth``; in steady state a batch leaves every
      ``compute_s / gpus`` plus one send.

    Returns the comm times, each layout's latency and time per batch, and the layout with the lower value of
    ``objective`` ('latency' or 'throughput'; TP on a tie)."""
    if objective not in ("latency", "throughput"):
        raise ValueError(f"objective={objective!r} is unknown; allowed: ['latency', 'throughput']")
    link = Link("given", bandwidth, latency, "the arguments")
    nbytes = tokens * hidden * bytes_per_el
    tp_comm = 2 * layers * all_reduce_time(nbytes, gpus, link)
    send = p2p_time(nbytes, link) if gpus > 1 else 0.0
    out = {"tp_comm_s": tp_comm, "pp_comm_s": (gpus - 1) * send,
           "tp_latency_s": compute_s / gpus + tp_comm, "pp_latency_s": compute_s + (gpus - 1) * send,
           "tp_step_s": compute_s / gpus + tp_comm, "pp_step_s": compute_s / gpus + send}
    key = "latency_s" if objective == "latency" else "step_s"
    out["choice"] = "TP" if out[f"tp_{key}"] <= out[f"pp_{key}"] else "PP"
    return out


def _tp_pp_cases() -> list[Case]:
    nvlink, ib, pcie = (450e9, 2e-6), (50e9, 5e-6), (25e9, 10e-6)
    rows = [("GPT-3 175B decode, batch 32, 8 GPUs on NVLink", (96, 12288, 32, 2, 8, *nvlink, 0.137, "latency")),
            ("the same on 16 GPUs over InfiniBand, for latency", (96, 12288, 32, 2, 16, *ib, 0.137, "latency")),
            ("the same on 16 GPUs over InfiniBand, for throughput", (96, 12288, 32, 2, 16, *ib, 0.137, "throughput")),
            ("prefill of 4096 tokens, 70B shape, 4 GPUs on PCIe, throughput", (80, 8192, 4096, 2, 4, *pcie, 1.9,
                                                                              "throughput")),
            ("the embedded model over gloo, 2 ranks, 256 tokens, float32", (8, 256, 256, 4, 2, 0.883e9, 294e-6,
                                                                             0.063, "latency")),
            ("one GPU: nothing to communicate", (32, 4096, 1, 2, 1, *nvlink, 0.008, "latency")),
            ("3 GPUs, tiny batch, slow link: latency terms dominate", (40, 5120, 1, 2, 3, 1e9, 1e-4, 0.02,
                                                                       "latency"))]
    return [Case(f"{label}: layers={a[0]}, hidden={a[1]}, tokens={a[2]}, {a[3]} B/element, gpus={a[4]}, "
                 f"{a[5] / 1e9:g} GB/s, {a[6] * 1e6:g} us, one-GPU compute {a[7] * 1e3:g} ms, for {a[8]}", a)
            for label, a in rows]


def _tp_pp_measure() -> list[Measurement]:
    _, rec, source = figure("parallel.tp_logits_rel_err")
    data = data_of(rec, "notebook 06's TP run")
    fit = data["comm_fits"]["all_reduce"]
    if "alpha_us" not in fit:
        raise NoMeasurement(f"this run's all-reduce timings were too noisy to fit ({fit.get('error', '?')})")
    tp2 = data["tp"].get("2") or data["tp"].get(2)
    prompt = data["sizes"]["prompt"]
    tokens = prompt[0] * prompt[1]
    ar = tp2[0]["bytes_per_forward"]["all_reduce"] / tp2[0]["collectives_per_forward"]["all_reduce"]
    hidden = int(ar / tokens / 4)
    layers = (tp2[0]["collectives_per_forward"]["all_reduce"] - 1) // 2
    # at p = 2 a ring all-reduce is 2 latency + bytes / bandwidth: the fit t = alpha + bytes / beta gives both
    args = (layers, hidden, tokens, 4, 2, fit["beta_gb_s"] * 1e9, fit["alpha_us"] * 1e-6 / 2,
            data["single_process_s"], "latency")
    single = data["single_process_s"]

    def explain(pred, meas):
        return (f"the model halves the one-process forward ({single * 1e3:.1f} ms) and adds {2 * layers} all-reduces "
                f"at the fitted alpha-beta ({fit['alpha_us']:.0f} us + bytes / {fit['beta_gb_s']:.2f} GB/s). "
                f"Measured, TP 2 takes {meas / single:.2f}x the one-process time: the two ranks and gloo's own "
                f"threads share this machine's cores with each other and with whatever else runs, so the compute "
                f"does not halve and a collective waits for the slower rank; the embedding's all-reduce and the "
                f"logits' all-gather are outside the model. On GPUs each rank owns a device and the split holds far "
                f"better; the notebook's 175B tables use the same arithmetic with datasheet links")
    return [Measurement(f"TP 2 forward of the embedded model ({tokens} tokens, float32) on this machine's gloo "
                        f"link", args, tp2[0]["tp_s"], "s", source, 0.5, explain,
                        pick=lambda obs: obs["tp_latency_s"])]


register(Prediction(
    "06.tp_or_pp", "TP or PP on a given link: comm time, latency and time per batch of each, and the choice",
    tp_or_pp, _tp_pp_cases, lambda fn, c: fn(*c), measure=_tp_pp_measure,
    hint="message = tokens x hidden x bytes; TP: 2 per layer x (2 (p-1) latency + 2 (p-1)/p message / bandwidth), "
         "0 at one GPU; PP: (p - 1) sends of latency + message / bandwidth for the latency, one send per batch in "
         "steady state"))
