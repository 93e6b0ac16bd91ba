"""Cost model of tensor and pipeline parallelism for a ``ModelConfig``: bytes moved, time on a link, memory per GPU.

Communication follows the alpha-beta model of ring collectives (Thakur et al. 2005; what NCCL's ring does):

- all-reduce of ``n`` bytes on ``p`` ranks: ``2(p-1) alpha + 2(p-1)/p * n / B``
- all-gather producing ``n`` bytes:          ``(p-1) alpha + (p-1)/p * n / B``
- point-to-point of ``n`` bytes:             ``alpha + n / B``

where ``B`` is one GPU's bandwidth in one direction. Tensor parallelism all-reduces the activations twice per
layer (``tokens x hidden`` each) and pipeline parallelism sends them once per stage boundary. The memory per GPU is
each stage's share of the weights and KV cache (``memory_per_device``).

Bandwidths are the published per-GPU, per-direction figures; latencies are typical orders of magnitude, replaced by
measured ones where a multi-GPU record holds alpha-beta fits (``scripts/bench_multigpu.py``; ``tp_comm(...,
fits=...)``). The step time of a layout is not here: ``labkit.plan.steps.decode_step_parts`` is the one cost model
of a TP x PP decode step, calibrated on measured steps, and uses these collectives and this memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from labkit.model import ModelConfig, dtype_bytes
from labkit.parallel.schedules import bubble_formula as bubble_fraction  # noqa: F401 (the pipeline's idle share)


@dataclass(frozen=True)
class Link:
    """One GPU's link: ``bandwidth`` bytes/s in each direction, ``latency_s`` per message hop (alpha)."""

    name: str
    bandwidth: float
    latency_s: float
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 + NVSwitch (H100/H200 SXM)", 450e9, 2e-6,
                    "NVIDIA H100/H200 datasheets: 900 GB/s bidirectional per GPU (18 links x 50 GB/s)"),
    "nvlink3": Link("NVLink 3 + NVSwitch (A100 SXM)", 300e9, 2e-6,
                    "NVIDIA A100 datasheet: 600 GB/s bidirectional per GPU"),
    "pcie5": Link("PCIe 5.0 x16", 64e9, 3e-6, "PCI-SIG: 32 GT/s x 16 lanes, ~64 GB/s per direction"),
    "pcie4": Link("PCIe 4.0 x16", 32e9, 3e-6, "PCI-SIG: 16 GT/s x 16 lanes, ~32 GB/s per direction"),
    "ib-ndr": Link("InfiniBand NDR, one 400 Gb/s port per GPU", 50e9, 5e-6,
                   "NVIDIA ConnectX-7 / DGX H100: 400 Gb/s per port, one port per GPU"),
    "ib-hdr": Link("InfiniBand HDR, one 200 Gb/s port per GPU", 25e9, 5e-6,
                   "NVIDIA ConnectX-6 / DGX A100: 200 Gb/s per port, one port per GPU"),
}


def get_link(name: str | Link) -> Link:
    if isinstance(name, Link):
        return name
    if name not in LINKS:
        raise ValueError(f"link={name!r} is unknown; allowed: {sorted(LINKS)} or a Link")
    return LINKS[name]


# --- collectives ----------------------------------------------------------------------------------------------
def all_reduce_time(nbytes: float, p: int, link: str | Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``p`` ranks (0 for one rank)."""
    lk = get_link(link)
    return 0.0 if p == 1 else 2 * (p - 1) * lk.latency_s + 2 * (p - 1) / p * nbytes / lk.bandwidth


def all_gather_time(nbytes: float, p: int, link: str | Link) -> float:
    """Ring all-gather whose *output* is ``nbytes``."""
    lk = get_link(link)
    return 0.0 if p == 1 else (p - 1) * lk.latency_s + (p - 1) / p * nbytes / lk.bandwidth


def p2p_time(nbytes: float, link: str | Link) -> float:
    lk = get_link(link)
    return lk.latency_s + nbytes / lk.bandwidth


# --- per-step communication -------------------------------------------------------------------------------
def measured_time(fits: dict | None, op: str, nbytes: float, p: int) -> float | None:
    """``alpha + nbytes / beta`` from a multi-GPU record's fit of ``op`` on ``p`` ranks (``fits["all_reduce@8"] =
    {"alpha_s", "beta_bytes_per_s"}``, as ``scripts/bench_multigpu.py`` writes them), or None without one."""
    f = (fits or {}).get(f"{op}@{p}") or {}
    if "alpha_s" not in f or "beta_bytes_per_s" not in f:
        return None
    return f["alpha_s"] + nbytes / f["beta_bytes_per_s"]


def tp_comm(spec: ModelConfig, tp: int, tokens: int, link: str | Link = "nvlink4", dtype: str = "bf16",
            layers: int | None = None, fits: dict | None = None) -> dict:
    """Tensor-parallel communication of one forward over ``tokens`` tokens (a decode step: tokens = batch).

    Two all-reduces per layer (attention output, MLP output) and one for the vocab-parallel embedding, each of
    ``tokens x hidden`` elements; one all-gather of the logits (``tokens x vocab``). ``layers`` defaults to all.
    Each collective is timed on ``link`` by the ring model, or by ``fits`` (measured alpha-beta fits per op and
    rank count, ``measured_time``) where they hold one for ``tp`` ranks.
    """
    layers = spec.num_layers if layers is None else layers
    b = dtype_bytes(dtype)
    ar_bytes, ag_bytes = tokens * spec.hidden_size * b, tokens * spec.vocab_size * b
    n_ar = 2 * layers + 1
    if tp == 1:
        ar_s = ag_s = 0.0
    else:
        ar_s = measured_time(fits, "all_reduce", ar_bytes, tp)
        ag_s = measured_time(fits, "all_gather", ag_bytes, tp)
        ar_s = all_reduce_time(ar_bytes, tp, link) if ar_s is None else ar_s
        ag_s = all_gather_time(ag_bytes, tp, link) if ag_s is None else ag_s
    return {"all_reduces": n_ar, "all_reduce_bytes": ar_bytes, "all_gather_bytes": ag_bytes,
            "wire_bytes_per_gpu": n_ar * 2 * (tp - 1) / tp * ar_bytes + (tp - 1) / tp * ag_bytes,
            "time_s": n_ar * ar_s + ag_s}


def pp_comm(spec: ModelConfig, pp: int, tokens: int, link: str | Link = "ib-ndr", dtype: str = "bf16") -> dict:
    """Pipeline communication of one forward: ``pp - 1`` sends of ``tokens x hidden``, one after another."""
    nbytes = tokens * spec.hidden_size * dtype_bytes(dtype)
    return {"sends": pp - 1, "send_bytes": nbytes, "time_s": (pp - 1) * p2p_time(nbytes, link) if pp > 1 else 0.0}


# --- memory per device ---------------------------------------------------------------------------
def memory_per_device(spec: ModelConfig, tp: int, pp: int, kv_tokens: int, dtype: str = "bf16",
                      kv_dtype: str | None = None) -> dict:
    """Bytes on the busiest GPU: its stage's layers and (first/last stage) embedding or head, split ``tp`` ways,
    and the KV cache of ``kv_tokens`` tokens (batch x context) for its layers and KV heads (replicated when
    ``tp > num_kv_heads``)."""
    if spec.num_layers < pp:
        raise ValueError(f"pp={pp} exceeds num_layers={spec.num_layers}")
    b, kvb = dtype_bytes(dtype), dtype_bytes(kv_dtype or dtype)
    layers = math.ceil(spec.num_layers / pp)
    table = spec.vocab_size * spec.hidden_size  # vocab-parallel, so split tp ways like the layers
    # one stage holds the embedding, another the head; a single stage holds both (one table if tied)
    ends = 2 * table if (pp == 1 and not spec.tie_word_embeddings) else table
    sharded = layers * (spec.attn_params_per_layer + spec.mlp_params_per_layer) + ends
    weights = (sharded / tp + layers * spec.norm_params_per_layer) * b  # norms are replicated
    kv_heads = max(1, spec.num_kv_heads // tp)
    kv = 2 * layers * kv_heads * spec.head_dim * kvb * kv_tokens
    return {"weights": weights, "kv": kv, "total": weights + kv, "layers_per_stage": layers,
            "kv_heads_per_gpu": kv_heads}
