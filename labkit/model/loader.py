"""Weights by name: from a local HF checkpoint's safetensors (one file or shards), from an HF model in memory, or
random (``from_config``, for speed measurements where weight values do not matter).

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

from labkit.device import resolve_device
from labkit.model.config import ModelConfig
from labkit.model.model import CausalLM

logger = logging.getLogger("labkit.model")

# Our merged projection -> the HF projections whose rows it holds, in order.
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Merged projections of labkit.model and the HF tensors concatenated into each."""
# Tensors some checkpoints carry that are not weights (recomputed here): ignored when present.
IGNORED = ("rotary_emb.inv_freq",)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _choose_dtype(dtype, declared: torch.dtype | None, what: str) -> torch.dtype:
    from labkit.models import torch_dtype

    if dtype is not None:
        chosen, why = torch_dtype(dtype), "dtype= argument"
    elif declared is not None:
        chosen, why = declared, "the checkpoint's own dtype; pass dtype= to change it"
    else:
        chosen, why = torch.float32, "no dtype declared; pass dtype= to change it"
    logger.info("labkit.model: %s in %s (%s)", what, chosen, why)
    return chosen


def empty_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                merge_qkv: bool = True, merge_gate_up: bool = True) -> CausalLM:
    """A ``CausalLM`` with uninitialised weights, allocated once on ``device`` in ``dtype`` (``"meta"``: shapes
    only). Fill it with ``load_weights`` or an initialiser."""
    dev = torch.device("meta") if str(device) == "meta" else resolve_device(device)
    with torch.device("meta"):
        model = CausalLM(cfg, merge_qkv, merge_gate_up).to(dtype)
    if dev.type != "meta":
        model.to_empty(device=dev)
        if cfg.tie_word_embeddings:  # to_empty gives each name its own tensor: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_checkpoint(path: str | Path | None = None, device: str | torch.device = "cpu", dtype=None,
                    merge_qkv: bool = True, merge_gate_up: bool = True) -> CausalLM:
    """A ``CausalLM`` from a local HF checkpoint directory (``None``: the embedded model, ``data/pydocs-llama``),
    without instantiating the HF model. ``dtype``: torch dtype or 'fp32' / 'bf16' / 'fp16'; None keeps the
    checkpoint's own."""
    if path is None:
        from labkit.models import EMBEDDED_MODEL_DIR

        path = EMBEDDED_MODEL_DIR
    cfg = ModelConfig.from_pretrained(path)
    with Checkpoint(path) as ckpt:
        declared = _FLOAT_DTYPES.get(cfg.dtype or "") or ckpt.stored_dtype()
        dt = _choose_dtype(dtype, declared, f"checkpoint {str(path)!r}")
        model = empty_model(cfg, device, dt, merge_qkv, merge_gate_up)
        load_weights(model, ckpt)
    return model


def load_hf_model(hf_model, device: str | torch.device | None = None, dtype=None, merge_qkv: bool = True,
                  merge_gate_up: bool = True) -> CausalLM:
    """A ``CausalLM`` with the weights of an HF model in memory (its ``state_dict()``, e.g. what
    ``labkit.models.random_model("llama-3-8b")`` gives). ``device``/``dtype`` default to the HF model's. The
    weights are copied (merged projections are new tensors anyway): free the HF model after if memory is short."""
    cfg = ModelConfig.from_hf(hf_model.config)
    p = next(hf_model.parameters())
    dt = _choose_dtype(dtype, p.dtype, f"{type(hf_model).__name__} in memory")
    model = empty_model(cfg, p.device if device is None else device, dt, merge_qkv, merge_gate_up)
    load_weights(model, hf_model.state_dict())
    return model


def from_config(cfg, device: str | torch.device = "cpu", dtype=torch.bfloat16, seed: int = 0,
                merge_qkv: bool = True, merge_gate_up: bool = True, std: float = 0.02) -> CausalLM:
    """A ``CausalLM`` with random weights, created directly on ``device``: for speed, where values do not matter.

    ``cfg``: a ``ModelConfig``, an HF config (object or dict) or a ``labkit.models`` preset name
    ('llama-3-8b' ...). Matrices and biases are N(0, ``std``) (never zeros); norm weights are the identity."""
    if isinstance(cfg, str):
        from labkit.models import get_spec

        cfg = ModelConfig.from_hf(get_spec(cfg).to_hf_config())
    elif not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.from_hf(cfg)
    dt = _choose_dtype(dtype, None, f"random {cfg.model_type} weights")
    model = empty_model(cfg, device, dt, merge_qkv, merge_gate_up)
    if model.device.type == "meta":
        return model
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0 - cfg.norm_offset)  # the identity for x * w and for x * (1 + w) alike
            else:
                p.normal_(0.0, std, generator=gen)
    return model
