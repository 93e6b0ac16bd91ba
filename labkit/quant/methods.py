"""``quantize(model, method, **options)``: one entry point for every weight quantisation method.

The returned model is the same model class with its ``nn.Linear`` modules swapped for quantised ones, by name: for
a Hugging Face model ``generate``, ``StaticCache`` decoding and ``labkit.evaluate.perplexity`` run it unchanged; for a
``labkit.model.CausalLM`` the layers swapped are each decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` (and ``lm_head`` with ``lm_head=``), and the engine runs it with the int8/int4 epilogue fusions.
Embeddings, norms and the LM head stay in the model's dtype: embeddings are a lookup (one row per token, never a matmul
bottleneck), and the LM head is the layer most sensitive to error. ``lm_head=True`` quantises the LM head too;
``lm_head="int8"`` (a method of ``HEAD_METHODS``) quantises it by that method instead, with its default options
(``backend`` shared): a mixed model such as int4 layers with an int8 head, the head's error held near int8's.
For a model with tied embeddings (the embedded model) a quantised head unties them: the embedding stays in full
precision for the lookup and the quantised copy serves the output projection (so the bytes held *grow* on a tied
model).

========== ====================================================== ============================================
method     what                                                   options (default)
========== ====================================================== ============================================
int8       weight-only, per-channel absmax RTN                    backend ('auto')
int4       weight-only, group-wise asymmetric RTN, packed         group_size (128), backend
gptq       int4 as above, calibrated by GPTQ on the 'calib' text  group_size, damp (0.01), calib, tokenizer,
                                                                  calib_samples (64), calib_seq_len (256),
                                                                  calib_split ('calib'), backend, progress
bnb-int8   bitsandbytes LLM.int8 (int8 x int8, fp16 outliers)     threshold (6.0)
bnb-nf4    bitsandbytes NF4, double quantisation                  double_quant (True), blocksize (64)
fp8        e4m3 weights per channel, e4m3 activations per token   backend ('auto': _scaled_mm on Hopper/Ada,
                                                                  emulated on the CPU)
========== ====================================================== ============================================
Every method also takes ``lm_head`` (False, True or a method of ``HEAD_METHODS``) and ``inplace`` (False: the
input model is left untouched, and the weights about to be replaced are not copied), and the int8 / int4 / gptq / fp8
layers take ``dispatch`` ('labkit': labkit's own kernels at every batch, the default; 'measured': the kernel per
batch from the table measured on this machine, ``labkit.quant.dispatch``; or a table, or a table record's path).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from labkit.checks import check_bool, check_int, check_number, check_positive_int, check_type
from labkit.quant.bnb import bnb_int8_linear, bnb_nf4_linear
from labkit.quant.fp8 import Fp8Linear, fp8_supported
from labkit.quant.gptq import gptq_quantize_model
from labkit.quant.weight_only import Int4Linear, Int8Linear, _check_group

METHODS = ("int8", "int4", "gptq", "bnb-int8", "bnb-nf4", "fp8")
"""The ``method`` names ``quantize`` takes."""
HEAD_METHODS = ("int8", "int4", "fp8")  # ``lm_head=<method>``: round-to-nearest methods that need no calibration
"""Methods ``quantize(..., lm_head=method)`` may apply to the LM head."""
_COMMON = {"lm_head": False, "inplace": False, "dispatch": "labkit"}
_OPTIONS: dict[str, dict] = {
    "int8": {"backend": "auto"},
    "int4": {"group_size": 128, "backend": "auto"},
    "gptq": {"group_size": 128, "damp": 0.01, "calib": None, "tokenizer": None, "calib_samples": 64,
             "calib_seq_len": 256, "calib_split": "calib", "seed": 0, "batch_size": 8, "backend": "auto",
             "progress": False},
    "bnb-int8": {"threshold": 6.0},
    "bnb-nf4": {"double_quant": True, "blocksize": 64},
    "fp8": {"backend": "auto"},
}
CALIB_SPLITS = ("calib", "train", "task_train")  # never a held-out split: that would grade on the answers
"""Dataset splits a calibrated method may read."""


def _check_option(name: str, value) -> None:
    """The type (and sign) an option must have (``labkit.checks``: an error naming it and its value otherwise)."""
    if name in ("group_size", "calib_samples", "calib_seq_len", "batch_size", "blocksize"):
        check_positive_int(name, value)
    elif name == "seed":
        check_int(name, value, 0)
    elif name in ("damp", "threshold"):
        check_number(name, value, 0, low_open=True)
    elif name in ("double_quant", "inplace", "progress"):
        check_bool(name, value)
    elif name == "backend":
        check_type(name, value, str)


def _options(method: str, given: dict) -> dict:
    if not isinstance(method, str):
        raise TypeError(f"method={method!r} must be a str, one of {list(METHODS)}; got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; allowed: {list(METHODS)}")
    allowed = {**_COMMON, **_OPTIONS[method]}
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"option(s) {unknown} do not apply to method={method!r}; allowed: {sorted(allowed)}")
    for name, value in given.items():
        _check_option(name, value)
    head = given.get("lm_head", False)
    if not isinstance(head, bool) and head not in HEAD_METHODS:
        raise ValueError(f"lm_head={head!r}: allowed False, True (the head by method={method!r} too) or one of "
                         f"{list(HEAD_METHODS)}")
    return {**allowed, **given}


def target_linears(model: nn.Module, lm_head: bool = False) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules ``quantize`` replaces, by qualified name: all of them but the LM head, unless
    ``lm_head``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and (lm_head or mod is not head)}


def _check_device(model: nn.Module, method: str, opts: dict) -> torch.device:
    device = next(model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the model is on {device}; quantize runs on models on 'cpu' or 'cuda'")
    if method == "fp8" and device.type == "cuda" and not fp8_supported(device) and opts["backend"] == "auto":
        raise ValueError(f"method='fp8' needs FP8 tensor cores (compute capability >= 8.9) and "
                         f"{torch.cuda.get_device_name(device)} has none; pass backend='emulated' to "
                         "emulate it")
    return device


def _calibration_ids(opts: dict) -> torch.Tensor:
    if opts["calib"] is not None:
        return opts["calib"]
    if opts["tokenizer"] is None:
        raise ValueError("method='gptq' needs calibration text: pass tokenizer= (to read the 'calib' split) "
                         "or calib= (int64 token ids [n_sequences, seq_len])")
    if opts["calib_split"] not in CALIB_SPLITS:
        raise ValueError(f"calib_split={opts['calib_split']!r}: allowed {list(CALIB_SPLITS)}; calibrating on "
                         "held-out text would leak the test set into the quantiser")
    from labkit.data import sample_prompts

    rows = sample_prompts(opts["tokenizer"], opts["calib_samples"], opts["calib_seq_len"],
                          split=opts["calib_split"], seed=opts["seed"])
    return torch.tensor(rows, dtype=torch.long)


def _output_head(model: nn.Module) -> tuple[str, nn.Module]:
    """The LM head's qualified name and module."""
    head = model.get_output_embeddings()
    return next(n for n, mod in model.named_modules() if mod is head), head


def _check_groups(linears: dict[str, nn.Module], group_size: int) -> None:
    """Refuse a group size that does not divide every layer's inputs, naming the first layer it fails."""
    for name, lin in linears.items():
        try:
            _check_group(lin.in_features, group_size)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def _replacement(method: str, linear: nn.Linear, opts: dict) -> nn.Module:
    if method == "int8":
        return Int8Linear.from_linear(linear, opts["backend"])
    if method == "int4":
        return Int4Linear.from_linear(linear, opts["group_size"], opts["backend"])
    if method == "bnb-int8":
        return bnb_int8_linear(linear, opts["threshold"])
    if method == "bnb-nf4":
        return bnb_nf4_linear(linear, opts["double_quant"], opts["blocksize"])
    return Fp8Linear.from_linear(linear, opts["backend"])


def _shallow_copy(model: nn.Module, replaced: dict[str, nn.Linear]) -> nn.Module:
    """A deep copy of ``model`` that shares (does not copy) the weights of the layers about to be replaced."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(p) for p in embed.parameters()} if embed is not None else set()  # a tied head stays copied
    memo = {id(t): t for lin in replaced.values() for t in (lin.weight, lin.bias)
            if t is not None and id(t) not in tied}
    return copy.deepcopy(model, memo)


@torch.no_grad()
def quantize(model: nn.Module, method: str, **options) -> nn.Module:
    """``model`` with its linear layers quantised by ``method`` (see the module docstring for methods and
    options). The model's ``labkit_quant`` attribute records the method and options used. A model that is not a
    ``nn.Module`` with parameters, a method that is not one of ``METHODS`` or an option of the wrong type is refused
    (``TypeError`` / ``ValueError`` naming it) before anything is copied."""
    if not isinstance(model, nn.Module) or next(model.parameters(), None) is None:
        raise TypeError(f"model must be a torch nn.Module with parameters (a Hugging Face causal LM), got "
                        f"{type(model).__name__}; did you swap model and method?")
    opts = _options(method, options)
    _check_device(model, method, opts)
    if opts["dispatch"] != "labkit":  # a bad name or a missing record fails before anything is copied
        from labkit.quant.dispatch import resolve

        resolve(opts["dispatch"], next(model.parameters()).device)
    same_head = opts["lm_head"] is True
    if method in ("int4", "gptq"):
        _check_groups(target_linears(model, same_head), opts["group_size"])
    head_method = opts["lm_head"] if isinstance(opts["lm_head"], str) else None
    if head_method:  # checked before anything is copied or replaced, as the layers are
        head_opts = {**_OPTIONS[head_method], "backend": opts.get("backend", "auto")}
        _check_device(model, head_method, head_opts)
        if head_method == "int4":
            _check_groups(dict([_output_head(model)]), head_opts["group_size"])
    if not opts["inplace"]:
        model = _shallow_copy(model, target_linears(model, bool(opts["lm_head"])))
    if method == "gptq":
        calib = _calibration_ids(opts)
        gptq_quantize_model(model, calib, opts["group_size"], opts["damp"], same_head,
                            opts["batch_size"], opts["backend"], opts["progress"])
    else:
        for name in target_linears(model, same_head):
            model.set_submodule(name, _replacement(method, model.get_submodule(name), opts))
    if head_method:  # the head by its own method, with that method's default options
        name, head = _output_head(model)
        model.set_submodule(name, _replacement(head_method, head, head_opts))
    if opts["lm_head"] and getattr(model.config, "tie_word_embeddings", False):
        # the quantised head is no longer the embedding table (labkit.model's config is frozen: a new one)
        if dataclasses.is_dataclass(model.config):
            model.config = dataclasses.replace(model.config, tie_word_embeddings=False)
        else:
            model.config.tie_word_embeddings = False
    if opts["dispatch"] != "labkit":
        from labkit.quant.dispatch import use_dispatch

        opts["dispatch"] = use_dispatch(model, opts["dispatch"])
    model.labkit_quant = {"method": method, **{k: v for k, v in opts.items()
                                               if k not in ("calib", "tokenizer", "inplace", "progress")}}
    return model.eval()
