"""The notebook's experiments as functions: recipes, one comparison row, memory rows, and the 175B plan."""

import pytest
import torch

from labkit.experiments.finetuning import (
    describe,
    fresh,
    memory_row,
    method_row,
    plan_rows,
    recipe,
    speed_row,
    step_flops_per_token,
)
from labkit.finetune import TrainSetup
from labkit.model import PRESETS, ModelConfig, random_model

SMALL = ModelConfig(name="small", vocab_size=301, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=200, tie_word_embeddings=True, max_position_embeddings=256)


def _ids(n, seed):
    return torch.randint(0, SMALL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_recipes():
    assert recipe("full", 2, 8).optimizer == "adamw" and recipe("full", 2, 8).base_dtype == "fp32"
    assert recipe("lora", 2, 8).base_dtype == "bf16" and recipe("qlora", 2, 8).optimizer == "adamw8bit"
    assert describe(recipe("qlora", 2, 8, checkpointing=True)) == "qlora bf16-mixed adamw8bit ckpt base=nf4+bf16"
    with pytest.raises(ValueError, match="method"):
        recipe("prefix-tuning", 2, 8)


def test_recipes_compute_in_fp32_where_bf16_is_emulated():
    from labkit.device import native_bf16

    assert native_bf16("cuda") and isinstance(native_bf16("cpu"), bool)
    slow = recipe("lora", 2, 8, device="cpu", bf16=False)
    assert slow.precision == "fp32" and slow.base_dtype == "fp32"
    fast = recipe("qlora", 2, 8, device="cpu", bf16=True)
    assert fast.precision == "bf16-mixed" and fast.base_dtype == "bf16"
    assert recipe("full", 2, 8, device="cpu").precision == ("bf16-mixed" if native_bf16("cpu") else "fp32")


def test_method_row_trains_and_reports():
    model = random_model(SMALL, device="cpu", dtype=torch.float32)
    train = _ids(30, 1).repeat(20)
    setup = recipe("lora", batch_size=2, seq_len=24, device="cpu")
    row = method_row(model, setup, train, {"task": train[:200], "other": _ids(200, 2)}, steps=6, lr=1e-2,
                     eval_seq_len=24, eval_windows=4)
    assert row["trainable_params"] == 8 * 2 * (2 * 256 + 2 * 192 + 3 * 328)
    assert 0 < row["trainable_frac"] < 0.2 and row["step_ms"] > 0 and len(row["train_losses"]) == 6
    assert row["task_drop"] == pytest.approx(row["task_before"] - row["task_after"]) and row["task_drop"] > 0


def test_memory_row_within_bar():
    base = random_model(SMALL, device="cpu", dtype=torch.float32)
    row = memory_row(fresh(base), TrainSetup(method="full", precision="fp32", batch_size=2, seq_len=32,
                                             device="cpu"))
    assert row["rel_err"] <= 0.15 and row["measured_peak"] > row["live_at_start"]
    assert next(base.parameters()).grad is None  # the factory's copies were trained, not the original


def test_speed_row():
    row = speed_row(fresh(random_model(SMALL, device="cpu", dtype=torch.float32)),
                    recipe("qlora", batch_size=2, seq_len=16, device="cpu"), steps=3)
    assert row["step_ms"] > 0 and row["tflops_per_s"] > 0


def test_flops_per_token():
    spec = PRESETS["llama-3-8b"]
    full = step_flops_per_token(spec, TrainSetup(seq_len=1))
    assert full == pytest.approx(6 * spec.matmul_params, rel=1e-3)  # the 6N rule at short context
    ckpt = step_flops_per_token(spec, TrainSetup(seq_len=1, checkpointing=True))
    assert ckpt == pytest.approx(8 * spec.matmul_params, rel=1e-3)
    lora = step_flops_per_token(spec, TrainSetup(method="lora", seq_len=1))
    assert lora == pytest.approx(4 * spec.matmul_params, rel=1e-2)


def test_plan_for_175b():
    rows = {r["configuration"]: r for r in plan_rows("gpt3-175b", batch_size=1, seq_len=2048, gpu_memory=141e9)}
    serve = rows["serve bf16, batch 8 x 2048 tokens (1 replica)"]
    assert serve["weights"] == PRESETS["gpt3-175b"].weight_bytes("bf16") and not serve["fits"]
    full = rows["full FT, bf16 autocast, AdamW"]
    assert full["peak_per_gpu"] > 16 * PRESETS["gpt3-175b"].num_params and not full["fits"]
    assert rows["full FT + ckpt, ZeRO-3 / FSDP over 64"]["fits"]
    assert not rows["full FT + ckpt, TP 8 x ZeRO-1 over 8"]["fits"]  # TP alone leaves Adam's state too large
    assert rows["full FT + ckpt, TP 8 x ZeRO-3 over 8"]["fits"]
    assert rows["QLoRA r=8, NF4 base, ckpt"]["fits"]  # one H200 holds a 175B QLoRA step
    assert not rows["LoRA r=8, bf16 base, ckpt"]["fits"]
