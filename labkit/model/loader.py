"""Weights by name: a local HF checkpoint's safetensors (one file or shards) or an HF ``state_dict()``, mapped onto a
``CausalLM``'s parameters (``labkit.model.build`` builds the models that use it).

The model is built on the meta device and materialised once on the target device in the target dtype, then every
parameter is filled from the checkpoint: no HF model is instantiated and no weight is held twice. HF names map to
ours one to one (``model.layers.N.self_attn.o_proj.weight`` ...) except the merged projections of ``MERGED``:
our ``qkv_proj`` holds the rows of HF's ``q_proj``, ``k_proj``, ``v_proj`` in that order, ``gate_up_proj`` those of
``gate_proj``, ``up_proj``. A checkpoint that stores them fused (Phi-3) maps to ours directly, or is split when the
model keeps separate projections. Every parameter must be found and every checkpoint tensor used (apart from
``IGNORED``): the error names what is missing or left over.

dtype: ``dtype=None`` keeps the checkpoint's own (``config.json``'s ``dtype``, else its tensors'; an in-memory
model's parameters'); pass ``dtype=`` to choose. The choice and its reason are logged (logger ``labkit.model``) and
readable as ``model.dtype``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import torch

from labkit.model.config import ModelConfig
from labkit.model.model import CausalLM

logger = logging.getLogger("labkit.model")

# Our merged projection -> the HF projections whose rows it holds, in order.
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Merged projections of labkit.model and the HF tensors concatenated into each."""
# Tensors some checkpoints carry that are not weights (recomputed here): ignored when present.
IGNORED = ("rotary_emb.inv_freq",)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
FLOAT_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""config.json's dtype names of the floating dtypes."""


def _row_sizes(cfg: ModelConfig, merged: str) -> list[int]:
    if merged == "qkv_proj":
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size, cfg.intermediate_size]


def weight_sources(model: CausalLM) -> dict[str, list[tuple[str, slice | None]]]:
    """For each of ``model``'s parameters, the checkpoint tensors it is made of, in row order: ``(HF name, rows
    of that tensor or None for all)``. A tied LM head is the embedding's parameter and is not listed."""
    cfg = model.config
    split = {part: (merged, i) for merged, parts in MERGED.items() for i, part in enumerate(parts)}
    out = {}
    for name, _ in model.named_parameters():
        prefix, leaf, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", *name.split("."))
        if leaf in MERGED and not cfg.fused_checkpoint:
            out[name] = [(f"{prefix}.{part}.{kind}", None) for part in MERGED[leaf]]
        elif leaf in split and cfg.fused_checkpoint:  # our separate projection, cut from the fused tensor
            merged, i = split[leaf]
            sizes = _row_sizes(cfg, merged)
            start = sum(sizes[:i])
            out[name] = [(f"{prefix}.{merged}.{kind}", slice(start, start + sizes[i]))]
        else:
            out[name] = [(name, None)]
    return out


def load_weights(model: CausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Fill every parameter of ``model`` from ``tensors`` (HF names; a ``state_dict()`` or a ``Checkpoint``),
    casting to the parameter's dtype and device. Raises ``ValueError`` naming any missing or unused tensor, or a
    shape that does not fit."""
    sources = weight_sources(model)
    available = set(tensors.keys())
    needed = {hf for parts in sources.values() for hf, _ in parts}
    missing = sorted(needed - available)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    unused = sorted(n for n in available - needed - tied if not n.endswith(IGNORED))
    if missing or unused:
        raise ValueError(f"checkpoint does not fit model_type={model.config.model_type!r}: "
                         f"missing {len(missing)} tensors {missing[:8]}, unexpected {len(unused)} {unused[:8]}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, parts in sources.items():
            param, row = params[name], 0
            for hf, rows in parts:
                t = tensors[hf]
                t = t[rows] if rows is not None else t
                if tuple(t.shape[1:]) != tuple(param.shape[1:]) or row + t.shape[0] > param.shape[0]:
                    raise ValueError(f"tensor {hf!r} of shape {tuple(t.shape)} does not fit {name!r} of shape "
                                     f"{tuple(param.shape)} at row {row}")
                param[row:row + t.shape[0]].copy_(t)
                row += t.shape[0]
            if row != param.shape[0]:
                raise ValueError(f"{name!r} has {param.shape[0]} rows; its tensors {[p for p, _ in parts]} give {row}")


class Checkpoint(Mapping):
    """The tensors of a checkpoint directory's safetensors, by name, read lazily (``model.safetensors``, or the
    shards listed in ``model.safetensors.index.json``). Use as a context manager to close the files."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {n: self.path / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        elif (self.path / "model.safetensors").is_file():
            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.path / "model.safetensors")
        else:
            found = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
            raise ValueError(f"path={str(self.path)!r} holds no model.safetensors or model.safetensors.index.json "
                             f"(found {found[:10]}); save the checkpoint with save_pretrained (safetensors)")
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}
        self._safe_open = safe_open

    def _file(self, name: str):
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(self._safe_open(path, framework="pt"))
        return self._open[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating tensor, or None."""
        for name in self.files:
            kind = self._file(name).get_slice(name).get_dtype()
            if kind in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[kind]
        return None

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
