"""GPTQ (Frantar et al. 2022): 4-bit weights calibrated on real activations, in the same packed int4 format.

Round-to-nearest minimises each weight's own error. What matters is the layer's *output* error on real
inputs, ``||X W^T - X Q^T||^2``, whose curvature in the weights is the Hessian ``H = 2 X^T X`` (``K x K``, from
calibration activations). GPTQ quantises one input column at a time and spreads that column's error over the
columns not yet quantised, weighted by ``H^{-1}`` (optimal brain surgeon), so correlated inputs absorb each
other's rounding. The result is ordinary group-wise asymmetric int4 (``labkit.quant.packing``), run by the same
``Int4Linear`` and kernel as RTN: the accuracy gain costs nothing at inference.

Choices, as in the reference implementation: dampening ``0.01 * mean(diag H)``; columns in natural order (no
act-order, so groups stay contiguous for the kernel); a group's scale and zero-point are fitted when the
quantiser reaches the group, on the weights as already updated by earlier columns. Layers are calibrated in
order, each on the outputs of the layers before it *after* they were quantised (so later layers correct for earlier
error). Calibration text comes from the ``calib`` split, never ``heldout``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from tqdm.auto import tqdm

from labkit.quant.packing import pack_int4
from labkit.quant.weight_only import INT4_QMAX, Int4Linear, _check_group, _check_weight, int4_group_params


@contextmanager
def _single_thread_on_cpu(device: torch.device):
    """GPTQ runs thousands of tiny ops on small matrices; on the CPU, thread hand-offs cost more than the work."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, damp: float = 0.01,
                  scale_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-quantise ``weight`` ``[N, K]`` given ``hessian`` ``[K, K]`` (``sum x x^T`` over calibration
    inputs).

    Returns (``packed`` uint8 ``[N, K // 2]``, ``scales``, ``zeros`` ``[N, K // group_size]`` in
    ``scale_dtype``, default the weight's dtype). Math in float32; inputs that never fired (zero diagonal)
    are dropped to zero.
    """
    _check_weight(weight)
    k = weight.shape[1]
    _check_group(k, group_size)
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [K, K] = [{k}, {k}] for weight {tuple(weight.shape)}, got "
                         f"{tuple(hessian.shape)}")
    if not damp > 0:
        raise ValueError(f"damp={damp} must be positive (a fraction of the mean Hessian diagonal, e.g. 0.01)")
    with _single_thread_on_cpu(weight.device):
        return _gptq(weight, hessian, group_size, damp, scale_dtype or weight.dtype)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float, sdt: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = weight.shape[1]
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone().to(w.device)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, device=h.device)
    # Upper Cholesky factor of H^-1: row i holds the OBS update for column i over the columns after it.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q, scales, zeros = _quantize_columns(w, hinv, group_size, sdt)
    return pack_int4(q.to(torch.uint8)), scales.to(sdt), zeros.to(sdt)


def _quantize_columns(w: torch.Tensor, hinv: torch.Tensor, group_size: int, sdt: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ column loop over ``w`` (float32 ``[N, K]``, updated in place) with the upper Cholesky factor
    ``hinv`` of ``H^-1``; returns float codes ``[N, K]``, scales and zeros ``[N, K // group_size]``
    (float32)."""
    n, k = w.shape
    q = torch.empty(n, k, device=w.device)  # integer codes, held as float32 until packed
    scales = torch.empty(n, k // group_size, device=w.device)
    zeros = torch.empty_like(scales)
    # whole groups per block, so that a group is fitted on weights already updated by the columns before it
    block = group_size * max(1, 128 // group_size)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1, err1, hinv1 = w[:, b0:b1].clone(), torch.empty(n, b1 - b0, device=w.device), hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            g, first = divmod(b0 + i, group_size)
            if first == 0:
                scales[:, g], zeros[:, g] = int4_group_params(w1[:, i:i + group_size], sdt)
            s, z = scales[:, g], zeros[:, g]
            code = q[:, b0 + i]
            torch.clamp(torch.round(w1[:, i] / s + z, out=code), 0, INT4_QMAX, out=code)
            err = err1[:, i]
            torch.sub(w1[:, i], (code - z) * s, out=err).div_(hinv1[i, i])
            w1[:, i:].addr_(err, hinv1[i, i:], alpha=-1.0)  # spread this column's error over the rest
        w[:, b1:].addmm_(err1, hinv[b0:b1, b1:], alpha=-1.0)
    return q, scales, zeros


class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the stage being calibrated has run."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Hugging Face causal LM (Llama-style ``model.layers``, GPT-2
    ``transformer.h``)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers"):
        mod = model
        for attr in path.split("."):
            mod = getattr(mod, attr, None)
        if isinstance(mod, nn.ModuleList):
            return mod
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; supported: Llama-style "
                     "(model.layers), GPT-2 (transformer.h), OPT-style (model.decoder.layers)")


@torch.no_grad()
def _hessians(model: nn.Module, stage: nn.Module, linears: dict[str, nn.Linear], calib: torch.Tensor,
              batch_size: int) -> dict[str, torch.Tensor]:
    """``sum x x^T`` (float32 ``[K, K]``) of the inputs to each of ``linears``, running ``model`` on ``calib``
    only as far as ``stage``."""
    hs = {name: torch.zeros(lin.in_features, lin.in_features, device=lin.weight.device)
          for name, lin in linears.items()}

    def accumulate(name):
        def hook(_mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            hs[name].addmm_(x.T, x)
        return hook

    def stop(_mod, _args, _out):
        raise _Stop

    handles = [lin.register_forward_pre_hook(accumulate(name)) for name, lin in linears.items()]
    handles.append(stage.register_forward_hook(stop))
    device = next(model.parameters()).device
    try:
        for i in range(0, len(calib), batch_size):
            try:
                model(input_ids=calib[i:i + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    return hs


def gptq_quantize_model(model: nn.Module, calib: torch.Tensor, group_size: int = 128, damp: float = 0.01,
                        lm_head: bool = False, batch_size: int = 8, backend: str = "auto",
                        progress: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` of the decoder layers (and the LM head if ``lm_head``) of ``model`` in
    place by a GPTQ-calibrated ``Int4Linear``. ``calib``: int64 token ids ``[n_sequences, seq_len]``."""
    if calib.dim() != 2 or calib.dtype != torch.long or len(calib) < 1:
        raise ValueError(f"calib must be int64 token ids [n_sequences, seq_len], got {calib.dtype} "
                         f"{tuple(calib.shape)}")
    stages = [(layer, {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)})
              for layer in decoder_layers(model)]
    if lm_head:
        head = model.get_output_embeddings()
        stages.append((head, {"": head}))
    for stage, linears in tqdm(stages, desc="GPTQ", disable=not progress):
        hessians = _hessians(model, stage, linears, calib, batch_size)
        for name, lin in linears.items():
            packed, scales, zeros = gptq_quantize(lin.weight, hessians[name], group_size, damp)
            new = Int4Linear(packed, scales, zeros, group_size, lin.bias, backend)
            if name:
                stage.set_submodule(name, new)
            else:
                model.set_output_embeddings(new)
    return model
