"""The experiments of notebook 07, as functions: full fine-tuning vs LoRA vs QLoRA on one model (trainable
parameters, measured and predicted peak memory, step time, held-out loss before and after), the memory model
checked on several set-ups, and the memory model applied to a large preset (the 175B).

Recipes (``recipe``) are the usual ones: full fine-tuning keeps fp32 master weights with bf16 autocast and
AdamW; LoRA freezes a bf16 base and trains fp32 adapters with AdamW; QLoRA freezes an NF4 base (bf16 elsewhere)
and uses 8-bit AdamW, as the QLoRA paper's recipe does.

Measured memory (``peak_memory``, ``live_tensor_bytes``, ``measure_step_memory``): peak bytes allocated while a
function runs, on the GPU and on the CPU, and live tensor bytes.

On CUDA the caching allocator keeps the counters (``torch.cuda.max_memory_allocated``). The CPU allocator keeps
none, but when the profiler runs with ``profile_memory=True`` every allocation and free through c10's CPU
allocator is reported with the running total of bytes allocated since profiling began (the profiler's
``Allocation`` events, ``total_allocated``). Its maximum is the CPU analogue of ``max_memory_allocated`` over the
region: it sees the intermediates inside operators (attention workspaces, optimizer temporaries) that a
saved-tensor hook or a scan of live tensors would miss, and nothing outside torch (Python objects, the
interpreter). Blocks allocated before the region and freed inside it are not subtracted (the profiler does not
know their size), so a measured region should free only what it allocated: e.g. a training step that starts
with ``grad = None`` and ends with ``zero_grad(set_to_none=True)``.

Both paths return the peak *above the bytes live at the start*; add ``live_tensor_bytes`` of the tensors alive
at the start (parameters, optimizer state, the batch) to get the absolute peak. Counting it this way on the GPU
too keeps other models that a notebook still holds out of the number.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from labkit.device import native_bf16
from labkit.finetune import (
    TrainSetup,
    count_trainable,
    finetune,
    heldout_loss,
    inference_memory,
    make_optimizer,
    prepare_model,
    train_step,
    trainable_parameters,
    training_memory,
)
from labkit.model import ModelConfig, get_config

METHOD_NAMES = ("full", "lora", "qlora")
# learning rates that work for a few hundred steps on the embedded model (adapters take larger steps)
DEFAULT_LR = {"full": 1e-4, "lora": 3e-3, "qlora": 3e-3}


def recipe(method: str, batch_size: int, seq_len: int, device: str = "cuda", checkpointing: bool = False,
           lora_rank: int = 8, bf16: bool | None = None) -> TrainSetup:
    """The ``TrainSetup`` of a standard recipe for ``method`` ('full', 'lora' or 'qlora'): bf16 autocast (and a
    bf16 frozen base for the adapters) where ``bf16`` (default: where ``device`` multiplies bf16 natively,
    ``labkit.device.native_bf16``), else the same recipe computing in fp32."""
    if method not in METHOD_NAMES:
        raise ValueError(f"method={method!r} is unknown; allowed: {list(METHOD_NAMES)}")
    bf16 = native_bf16(device) if bf16 is None else bf16
    kw = dict(method=method, precision="bf16-mixed" if bf16 else "fp32", batch_size=batch_size, seq_len=seq_len,
              device=device, checkpointing=checkpointing, lora_rank=lora_rank)
    if method == "full":
        return TrainSetup(optimizer="adamw", **kw)
    return TrainSetup(optimizer="adamw" if method == "lora" else "adamw8bit", base_dtype="bf16" if bf16 else "fp32",
                      **kw)


def memory_row(model_factory: Callable[[], torch.nn.Module], setup: TrainSetup, label: str | None = None,
               seed: int = 0) -> dict:
    """Measured peak of one training step of a fresh model prepared as ``setup`` against the memory model."""
    model = prepare_model(model_factory(), setup)
    spec = get_config(model)
    ids = torch.randint(0, spec.vocab_size, (setup.batch_size, setup.seq_len),
                        generator=torch.Generator().manual_seed(seed))
    measured = measure_step_memory(model, setup, ids)
    predicted = training_memory(spec, setup)
    del model
    _release()
    return {"setup": label or describe(setup), "measured_peak": measured["peak"], "predicted_peak": predicted.peak,
            "rel_err": abs(predicted.peak - measured["peak"]) / measured["peak"], "phase": predicted.peak_phase,
            "weights": predicted.weights, "grads": predicted.grads, "optimizer": predicted.optimizer_states,
            "activations": predicted.activations, "transient": predicted.transient,
            "live_at_start": measured["live_at_start"], "measure": measured["method"]}


def _release() -> None:
    """Free a finished model now (HF modules hold reference cycles), so the next fresh one has the memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(setup: TrainSetup) -> str:
    """A short label: 'lora bf16-mixed adamw ckpt base=bf16'."""
    parts = [setup.method, setup.precision, setup.optimizer]
    if setup.checkpointing:
        parts.append("ckpt")
    if setup.method != "full":
        parts.append(f"base={'nf4+' if setup.method == 'qlora' else ''}{setup.base_dtype}")
    return " ".join(parts)


def method_row(model: torch.nn.Module, setup: TrainSetup, train_ids: torch.Tensor,
               eval_sets: dict[str, torch.Tensor], steps: int, lr: float, eval_seq_len: int,
               eval_windows: int | None, seed: int = 0, progress: bool = False) -> dict:
    """Fine-tune ``model`` (fp32, consumed: prepared in place) as ``setup`` and return one row of the
    comparison: trainable parameters, step time, training losses, and the loss on each of ``eval_sets`` before
    (the prepared model at step 0, so a QLoRA row starts from its quantised weights) and after."""
    prepare_model(model, setup)
    trainable, total = count_trainable(model)

    def losses() -> dict[str, float]:
        return {name: heldout_loss(model, ids, seq_len=eval_seq_len, num_windows=eval_windows,
                                   precision=setup.precision) for name, ids in eval_sets.items()}

    before = losses()
    result = finetune(model, train_ids, setup, steps=steps, lr=lr, seed=seed, progress=progress)
    after = losses()
    row = {"method": setup.method, "setup": describe(setup), "trainable_params": trainable, "total_params": total,
           "trainable_frac": trainable / total, "step_ms": result.step_times.median_ms,
           "tokens_per_s": result.tokens_per_s, "lr": lr, "steps": steps, "train_losses": result.losses,
           "step_times": result.step_times}
    for name in eval_sets:
        row[f"{name}_before"], row[f"{name}_after"] = before[name], after[name]
        row[f"{name}_drop"] = before[name] - after[name]
    return row


def fresh(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """A factory of deep copies of ``model`` (so every method starts from the same weights)."""
    return lambda: copy.deepcopy(model)


# --- arithmetic for large models ------------------------------------------------------------------------------
def step_flops_per_token(spec: ModelConfig, setup: TrainSetup) -> float:
    """Matmul FLOPs per trained token: forward 2N, backward 2N for activation gradients, plus 2N for weight
    gradients when the weights train (full), plus another forward when checkpointing recomputes; attention
    scores and the adapters' own matmuls included (N = weights in matmuls)."""
    n = spec.matmul_params
    attn = spec.attention_flops_per_token((setup.seq_len + 1) / 2)
    fwd = 2.0 * n + attn
    passes = 3.0 if setup.method == "full" else 2.0  # forward + input grads (+ weight grads for full)
    total = passes * fwd + (fwd if setup.checkpointing else 0.0)
    if setup.method != "full":
        r = setup.lora_rank
        h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
        adapters = r * spec.num_layers * (2 * (h + q) + 2 * (h + kv) + (3 if spec.gated_mlp else 2) * (h + i))
        total += 6.0 * adapters
    return total


def plan_rows(preset: str | ModelConfig, batch_size: int, seq_len: int, gpu_memory: float,
              data_parallel: int = 64, tensor_parallel: int = 8, serve_batch: int = 8) -> list[dict]:
    """The memory model on a large model: serving against full fine-tuning, sharded and not, LoRA and QLoRA.

    Each row: bytes per GPU by kind, peak, whether it fits ``gpu_memory``, and the GPUs the configuration uses.
    """
    spec = get_config(preset)
    rows = []
    inf = inference_memory(spec, batch_size=serve_batch, context_len=seq_len)
    rows.append({"configuration": f"serve bf16, batch {serve_batch} x {seq_len} tokens (1 replica)", "gpus": 1,
                 "weights": inf.weights, "grads": 0.0, "optimizer": 0.0, "activations / KV": inf.kv_cache,
                 "peak_per_gpu": inf.peak})
    dp, tp = data_parallel, tensor_parallel
    configs = [
        ("full FT, bf16 autocast, AdamW", dict(), 1),
        ("full FT + checkpointing", dict(checkpointing=True), 1),
        ("full FT + checkpointing + 8-bit AdamW", dict(checkpointing=True, optimizer="adamw8bit"), 1),
        (f"full FT + ckpt, ZeRO-3 / FSDP over {dp}", dict(checkpointing=True, zero_stage=3, data_parallel=dp), dp),
        (f"full FT + ckpt, TP {tp} x ZeRO-1 over {dp // tp}",
         dict(checkpointing=True, tensor_parallel=tp, zero_stage=1, data_parallel=dp // tp), dp),
        (f"full FT + ckpt, TP {tp} x ZeRO-3 over {dp // tp}",
         dict(checkpointing=True, tensor_parallel=tp, zero_stage=3, data_parallel=dp // tp), dp),
        ("LoRA r=8, bf16 base, ckpt", dict(method="lora", base_dtype="bf16", checkpointing=True), 1),
        ("QLoRA r=8, NF4 base, ckpt", dict(method="qlora", base_dtype="bf16", checkpointing=True,
                                            optimizer="adamw8bit"), 1),
    ]
    for name, kw, gpus in configs:
        kw = {"precision": "bf16-mixed", "batch_size": batch_size, "seq_len": seq_len, **kw}
        m = training_memory(spec, TrainSetup(**kw))
        rows.append({"configuration": name, "gpus": gpus, "weights": m.weights, "grads": m.grads,
                     "optimizer": m.optimizer_states, "activations / KV": m.activations, "peak_per_gpu": m.peak})
    for r in rows:
        r["fits"] = r["peak_per_gpu"] <= gpu_memory
    return rows


def speed_row(model_factory: Callable[[], torch.nn.Module], setup: TrainSetup, steps: int = 6,
              seed: int = 0) -> dict:
    """Step time of a fresh model prepared as ``setup``, on random tokens (speed does not depend on the data or
    the weights' values), with the matmul FLOP rate it implies (``step_flops_per_token``)."""
    model = prepare_model(model_factory(), setup)
    spec = get_config(model)
    ids = torch.randint(0, spec.vocab_size, (setup.tokens * 4,), generator=torch.Generator().manual_seed(seed))
    result = finetune(model, ids, setup, steps=steps, lr=1e-5, seed=seed)
    del model
    _release()
    flops = step_flops_per_token(spec, setup) * setup.tokens
    return {"setup": describe(setup), "step_ms": result.step_times.median_ms, "tokens_per_s": result.tokens_per_s,
            "tflops_per_s": flops / result.step_times.median_s / 1e12, "step_times": result.step_times}


# --- measured memory ----------------------------------------------------------------------------------------
@dataclass
class PeakMemory:
    """Peak bytes allocated above the start of a region, and how they were measured."""

    peak_above_start: int
    method: str
    result: object = None


def _walk(nodes):
    for n in nodes:
        yield n
        yield from _walk(n.children)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (Kineto prints two 'USDT ... profiler_start/stop' lines from C++ on every
    profiled region, which would flood a notebook); Python exceptions still propagate."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak(fn: Callable[[], object]) -> PeakMemory:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    peak = 0
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            peak = max(peak, node.extra_fields.total_allocated)
    return PeakMemory(int(peak), "torch.profiler CPU allocator events (max total_allocated)", result)


def _cuda_peak(fn: Callable[[], object], device: torch.device) -> PeakMemory:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    return PeakMemory(int(peak), "torch.cuda.max_memory_allocated - memory_allocated at start", result)


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> PeakMemory:
    """Run ``fn()`` once and return the peak bytes allocated above the start (and ``fn``'s result)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return _cuda_peak(fn, dev)
    if dev.type == "cpu":
        return _cpu_peak(fn)
    raise ValueError(f"device={str(device)!r}: peak memory is measured on 'cpu' or 'cuda', not {dev.type!r}")


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors(state)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "absmax"):  # a bitsandbytes QuantState: absmax, code, nested state2, offset
        for name in ("absmax", "code", "offset", "state2"):
            v = getattr(obj, name, None)
            if v is not None:
                yield from _tensors(v)


def live_tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages held by tensors, modules (parameters, buffers, quantisation states,
    ``.grad``) and optimizers (their state), each storage counted once however many views share it."""
    seen: dict[tuple, int] = {}
    for obj in objs:
        for t in _tensors(obj):
            extra = [t.grad] if t.grad is not None else []
            qs = getattr(t, "quant_state", None)
            if qs is not None:
                extra += list(_tensors(qs))
            for u in [t, *extra]:
                s = u.untyped_storage()
                seen[(u.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def measure_step_memory(model: torch.nn.Module, setup: TrainSetup, batch: torch.Tensor, lr: float = 1e-4) -> dict:
    """Measured peak memory of one training step of a prepared model, in bytes.

    One warm-up step allocates the optimizer state; then the second step is measured (``peak_memory``) starting
    from parameters, optimizer state and the batch (``live_at_start``) with no gradients, so the region frees only
    what it allocates. ``peak = live_at_start + peak_above_start``.
    """
    if batch.shape != (setup.batch_size, setup.seq_len):
        raise ValueError(f"batch has shape {tuple(batch.shape)}, setup says ({setup.batch_size}, {setup.seq_len})")
    device = next(model.parameters()).device
    batch = batch.to(device)
    opt = make_optimizer(trainable_parameters(model), setup.optimizer, lr)
    train_step(model, opt, batch, setup.precision)
    live = live_tensor_bytes(model, opt, batch)
    pk = peak_memory(lambda: train_step(model, opt, batch, setup.precision), device)
    return {"peak": live + pk.peak_above_start, "live_at_start": live, "peak_above_start": pk.peak_above_start,
            "method": pk.method, "loss": pk.result}
