"""The back-of-the-envelope numbers a 175B answer starts from, computed from the model's shape and the datasheets:
weights per format, KV bytes per token and per sequence, and the narrowest tensor-parallel group whose weight shard
fits a GPU with room left for the KV cache (``memory_per_device``, as the planner sizes layouts).
"""

from __future__ import annotations

import math

from labkit.hardware import get_hardware
from labkit.model import ModelConfig, get_config
from labkit.parallel.cost_model import memory_per_device

USABLE = 0.9
"""Share of a GPU's memory the planner counts as usable (the rest: activations, the allocator, CUDA graphs)."""


def min_tp(spec: ModelConfig | str, gpu: str, dtype: str = "bf16", usable: float = USABLE) -> int | None:
    """The narrowest TP degree (a power of two dividing the heads, at most 8: one node) whose weight shard fits in
    ``usable`` of one ``gpu``'s memory, or None when even TP8 does not."""
    spec, hw = get_config(spec, "spec"), get_hardware(gpu, "gpu")
    for tp in (1, 2, 4, 8):
        if spec.num_heads % tp == 0 and memory_per_device(spec, tp, 1, 0, dtype)["weights"] <= usable * hw.mem_capacity:
            return tp
    return None


def model_arithmetic(spec: ModelConfig | str = "gpt3-175b", gpus: tuple[str, ...] = ("h100", "h200"),
                     seq_len: int = 2048, usable: float = USABLE) -> dict[str, tuple]:
    """``{suffix: (value, unit, note)}``: weights per format (GB), the shape that sets the KV cache, KV per token
    (MiB, 2 x layers x KV heads x head dim x 2 bytes) and per ``seq_len``-token sequence (GiB), and per GPU kind the
    narrowest TP group for bf16 weights (``min_tp``), the memory it leaves per GPU and how many ``seq_len``-token
    sequences of bf16 KV that holds across the group."""
    spec = get_config(spec, "spec")
    out: dict[str, tuple] = {}
    for w in ("bf16", "fp8", "int8", "int4"):
        out[f"weights_gb_{w}"] = (spec.weight_bytes(w) / 1e9, "GB", f"{spec.num_params / 1e9:.1f} B parameters "
                                  f"in {w}")
    out["layers"] = (spec.num_layers, "layers", "model shape")
    out["heads"] = (spec.num_heads, "heads", "model shape")
    out["kv_heads"] = (spec.num_kv_heads, "heads", "model shape: as many KV heads as query heads (multi-head)")
    out["d_model"] = (spec.hidden_size, "", "model shape")
    per_token = spec.kv_bytes_per_token("bf16")
    out["kv_mib_per_token"] = (per_token / 2**20, "MiB", "2 x layers x KV heads x head dim x 2 bytes (bf16)")
    out["kv_gib_per_seq"] = (per_token * seq_len / 2**30, "GiB", f"one sequence of {seq_len} tokens, bf16")
    out["seq_len"] = (seq_len, "tokens", "the sequence length of the KV arithmetic")
    for g in gpus:
        tp = min_tp(spec, g, "bf16", usable)
        cap = get_hardware(g, "gpus").mem_capacity
        out[f"min_tp_{g}"] = (tp, "GPUs", f"narrowest TP whose bf16 shard fits {usable:.0%} of {cap / 1e9:.0f} GB")
        if tp is not None:
            room = usable * cap - memory_per_device(spec, tp, 1, 0, "bf16")["weights"]
            out[f"kv_room_gb_{g}"] = (room / 1e9, "GB per GPU", f"{usable:.0%} of memory less the TP{tp} shard")
            out[f"kv_seqs_{g}"] = (math.floor(room * tp / (per_token * seq_len)), "sequences",
                                   f"{seq_len}-token sequences of bf16 KV the TP{tp} group holds")
    return out
