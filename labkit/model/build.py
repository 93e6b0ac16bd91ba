"""One way to build a model from each source.

==================  ==================================================  ==========================================
source              labkit's decoder (``CausalLM``, what the engine     Hugging Face's model (the baseline and the
                    runs)                                               correctness reference)
==================  ==================================================  ==========================================
a checkpoint        ``load_checkpoint(path)``                           ``load_model(path)`` (with its tokenizer)
a preset or config  ``from_config("llama-3-8b")`` (random weights)      ``random_model("llama-3-8b")``
an HF model         ``adopt_hf_model(hf_model)`` (weights shared)       (itself)
==================  ==================================================  ==========================================

``path=None`` is the embedded model (``data/pydocs-llama``); any local HF checkpoint directory works the same way and
nothing is downloaded. Random weights are created directly on the device (``"meta"``: shapes only), N(0, 0.02),
never zeros: for speed, which does not depend on weight values. ``dtype``: a torch dtype or 'fp32' / 'bf16' /
'fp16'; labkit's decoder keeps a checkpoint's own dtype by default, HF's model loads in float32 (the accuracy
reference); each choice is logged (loggers ``labkit.model``, ``labkit.model.build``).

``adopt_hf_model`` takes the HF model's own modules (the embedding, o/down projections and the LM head as they are,
the norms' weights), so nothing is held twice and a model quantised by ``labkit.quant.quantize`` runs with its
quantised layers; q/k/v and gate/up become one merged layer each where ``labkit.quant.concat_linears`` can merge
them (plain, int8 and int4 linears: the HF layers are re-pointed at row slices of the merged weights, so the HF
model still works), else stay separate (fp8, bitsandbytes). No HF module is called by the result's forwards.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from labkit.checks import ArgumentTypeError, check_device, check_dtype, check_int, check_positive_int, check_token_ids
from labkit.data import EMBEDDED_MODEL, EMBEDDED_MODEL_DIR
from labkit.model.config import ModelConfig
from labkit.model.loader import FLOAT_DTYPE_NAMES, Checkpoint, load_weights, logger
from labkit.model.model import CausalLM
from labkit.model.presets import get_config
from labkit.quant.weight_only import concat_linears


# --- labkit's decoder ----------------------------------------------------------------------------------------
def load_checkpoint(path: str | Path | None = None, device: str | torch.device = "cpu", dtype=None,
                    merge_qkv: bool = True, merge_gate_up: bool = True) -> CausalLM:
    """A ``CausalLM`` from a local HF checkpoint directory (``None``: the embedded model), without instantiating the
    HF model. ``dtype`` None keeps the checkpoint's own."""
    path = _checkpoint_dir(path)
    cfg = ModelConfig.from_pretrained(path)
    with Checkpoint(path) as ckpt:
        declared = FLOAT_DTYPE_NAMES.get(cfg.dtype or "") or ckpt.stored_dtype()
        dt = _choose_dtype(dtype, declared, f"checkpoint {str(path)!r}")
        model = _empty_model(cfg, device, dt, merge_qkv, merge_gate_up)
        load_weights(model, ckpt)
    return model


def from_config(cfg, device: str | torch.device = "cpu", dtype=torch.bfloat16, seed: int = 0,
                merge_qkv: bool = True, merge_gate_up: bool = True, std: float = 0.02) -> CausalLM:
    """A ``CausalLM`` with random weights, created directly on ``device``, for ``cfg``: a preset name, a
    ``ModelConfig``, an HF config or model (``get_config``). Matrices and biases are N(0, ``std``); norm weights are
    the identity."""
    cfg = get_config(cfg, "cfg")
    dt = _choose_dtype(dtype, None, f"random {cfg.model_type} weights")
    model = _empty_model(cfg, device, dt, merge_qkv, merge_gate_up)
    if model.device.type == "meta":
        return model
    gen = torch.Generator(device=model.device).manual_seed(check_int("seed", seed, 0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0 - cfg.norm_offset)  # the identity for x * w and for x * (1 + w) alike
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def adopt_hf_model(hf_model, merge: bool = True) -> CausalLM:
    """A ``CausalLM`` whose layers are ``hf_model``'s (module names of HF's Llama family: ``model.embed_tokens``,
    ``model.layers[i].self_attn.{q,k,v,o}_proj`` or a fused ``qkv_proj``, ``mlp.{gate,up,down}_proj`` or
    ``gate_up_proj``, the norms, ``lm_head``), on its device and in its dtype (module docstring). ``merge``: merge
    q/k/v and gate/up where the layers allow it. Raises ``ValueError`` for a family or feature ``ModelConfig``
    refuses; a ``CausalLM`` is returned as it is."""
    if isinstance(hf_model, CausalLM):
        return hf_model
    inner = getattr(hf_model, "model", None)
    if not isinstance(hf_model, nn.Module) or inner is None or not hasattr(inner, "layers") \
            or not hasattr(hf_model, "lm_head"):
        raise ArgumentTypeError(f"model={hf_model!r:.60} ({type(hf_model).__name__}): need a labkit.model.CausalLM "
                                f"or an HF causal LM with .model.layers and .lm_head")
    cfg = ModelConfig(**{**ModelConfig.from_hf(hf_model.config).__dict__, "eos_token_ids": eos_ids(hf_model)})
    layers = list(inner.layers)
    qkv = [_merged(ly.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), merge) for ly in layers]
    gate_up = [_merged(ly.mlp, "gate_up_proj", ("gate_proj", "up_proj"), merge) for ly in layers]
    merge_qkv, merge_gate_up = all(m is not None for m in qkv), all(m is not None for m in gate_up)
    with torch.device("meta"):
        model = CausalLM(cfg, merge_qkv, merge_gate_up)
    ours = model.model
    ours.embed_tokens = inner.embed_tokens
    ours.norm.weight = inner.norm.weight  # our RMSNorms compute with HF's weight tensors (eps from the config)
    for i, (mine, theirs) in enumerate(zip(ours.layers, layers)):
        mine.input_layernorm.weight = theirs.input_layernorm.weight
        mine.post_attention_layernorm.weight = theirs.post_attention_layernorm.weight
        a, b = mine.self_attn, theirs.self_attn
        if merge_qkv:
            a.qkv_proj = qkv[i]
        else:
            a.q_proj, a.k_proj, a.v_proj = b.q_proj, b.k_proj, b.v_proj
        a.o_proj = b.o_proj
        if a.q_norm is not None:
            a.q_norm.weight, a.k_norm.weight = b.q_norm.weight, b.k_norm.weight
        if merge_gate_up:
            mine.mlp.gate_up_proj = gate_up[i]
        else:
            mine.mlp.gate_proj, mine.mlp.up_proj = theirs.mlp.gate_proj, theirs.mlp.up_proj
        mine.mlp.down_proj = theirs.mlp.down_proj
    model.lm_head = hf_model.lm_head
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"{type(hf_model).__name__}: no weights found for {left[:8]}")
    return model.eval()


def eos_ids(model) -> tuple[int, ...]:
    """Every end-of-sequence id a model declares: its config's ``eos_token_ids`` (labkit.model) or ``eos_token_id``
    (an id or a list, as Llama 3 Instruct's [128001, 128009]), then its ``generation_config``'s, without repeats."""
    ids: list[int] = []
    for src in (model.config, getattr(model, "generation_config", None)):
        for name in ("eos_token_ids", "eos_token_id"):
            v = getattr(src, name, None) if src is not None else None
            if v is not None:
                ids += check_token_ids(name, [v] if isinstance(v, int) else v, allow_empty=True)
    return tuple(dict.fromkeys(ids))


def _merged(parent: nn.Module, fused: str, parts: tuple[str, ...], merge: bool) -> nn.Module | None:
    """The parent's fused layer (Phi-3 stores one), a merge of its ``parts`` (``concat_linears``), or None."""
    if hasattr(parent, fused):
        return getattr(parent, fused)
    return concat_linears([getattr(parent, p) for p in parts]) if merge else None


def _choose_dtype(dtype, declared: torch.dtype | None, what: str) -> torch.dtype:
    if dtype is not None:
        chosen, why = check_dtype("dtype", dtype), "dtype= argument"
    elif declared is not None:
        chosen, why = declared, "the checkpoint's own dtype; pass dtype= to change it"
    else:
        chosen, why = torch.float32, "no dtype declared; pass dtype= to change it"
    logger.info("labkit.model: %s in %s (%s)", what, chosen, why)
    return chosen


def _empty_model(cfg: ModelConfig, device, dtype: torch.dtype, merge_qkv: bool, merge_gate_up: bool) -> CausalLM:
    """A ``CausalLM`` with uninitialised weights, allocated once on ``device`` in ``dtype`` (``"meta"``: shapes)."""
    dev = torch.device("meta") if str(device) == "meta" else check_device("device", device)
    with torch.device("meta"):
        model = CausalLM(cfg, merge_qkv, merge_gate_up).to(dtype)
    if dev.type != "meta":
        model.to_empty(device=dev)
        if cfg.tie_word_embeddings:  # to_empty gives each name its own tensor: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


# --- Hugging Face's model ------------------------------------------------------------------------------------
def load_model(name_or_path: str | Path | None = None, device: str | torch.device | None = "cpu",
               dtype: str | torch.dtype | None = torch.float32):
    """``(model, tokenizer)`` of HF's model from the embedded model (``None``) or a local checkpoint directory, in
    eval mode on ``device`` in ``dtype``: float32 by default (the accuracy reference), so a bfloat16 checkpoint (the
    embedded one too) is upcast unless you pass ``torch.bfloat16`` (or ``"auto"``: the dtype its config.json
    names). The choice is logged (logger ``labkit.model.build``, INFO)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, dev = _checkpoint_dir(name_or_path), check_device("device", device)
    cfg = json.loads((path / "config.json").read_text())
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    want = stored if dtype == "auto" else dtype
    dt = torch.float32 if want is None else check_dtype("dtype", want)
    logging.getLogger(__name__).info("load_model(%s): %s on %s (%s; the checkpoint stores %s)", path.name, dt,
                                     dev.type, "asked" if dtype != torch.float32 else "the default", stored)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(dev).eval()
    return model, AutoTokenizer.from_pretrained(path)


def random_model(preset: str | ModelConfig, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = torch.bfloat16, seed: int = 0, num_layers: int | None = None):
    """HF's causal LM of a preset's architecture (``get_config``) at full size with random weights, created directly
    on ``device`` (``"meta"``: shapes only) by the model's own initialiser (N(0, 0.02)); ``num_layers`` truncates
    the depth (same per-layer shape)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    cfg = get_config(preset, "preset")
    if num_layers is not None:
        cfg = replace(cfg, num_layers=check_positive_int("num_layers", num_layers), layer_types=())
    dev = torch.device("meta") if str(device) == "meta" else check_device("device", device)
    dt = check_dtype("dtype", torch.bfloat16 if dtype is None else dtype)
    _check_fits(cfg, dev, dt)
    torch.manual_seed(check_int("seed", seed, 0))
    if dev.type == "cuda":
        torch.cuda.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg.to_hf_config(), dtype=dt)
    return model.eval()


def _check_fits(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    need = cfg.weight_bytes(dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    elif device.type == "cpu":
        import psutil

        free = psutil.virtual_memory().available
    else:
        return
    if need > 0.9 * free:
        raise MemoryError(f"random_model({cfg.name!r}) needs {need / 2**30:.1f} GiB of weights in {dtype}, but "
                          f"{device} has {free / 2**30:.1f} GiB free; use a smaller preset, dtype or device='meta'")


def _checkpoint_dir(name_or_path) -> Path:
    """The checkpoint directory of ``None`` / 'pydocs-llama' (the embedded model) or a local path."""
    if name_or_path is None or name_or_path == EMBEDDED_MODEL:
        return EMBEDDED_MODEL_DIR
    if not isinstance(name_or_path, (str, Path)):
        raise ArgumentTypeError(f"name_or_path={name_or_path!r} must be a checkpoint directory (a str or Path), or "
                                f"None for the embedded model; got {type(name_or_path).__name__}")
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"name_or_path={str(name_or_path)!r} is not a Hugging Face checkpoint directory "
                         f"(no config.json at {path}); allowed: None or {EMBEDDED_MODEL!r} for the embedded "
                         f"model, or a local directory holding config.json and weights. Nothing is downloaded.")
    return path
