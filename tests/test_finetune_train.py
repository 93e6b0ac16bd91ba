"""The training loop: batches, held-out loss, checkpointing, mixed precision, learning, bad input, GPU paths."""

import copy
import math

import pytest
import torch

from labkit.evaluate import perplexity, relative_error
from labkit.experiments.finetuning import measure_step_memory
from labkit.finetune import TrainSetup, training_memory
from labkit.finetune.lora import trainable_parameters
from labkit.finetune.train import (
    finetune,
    heldout_loss,
    heldout_windows,
    make_optimizer,
    prepare_model,
    train_step,
    training_batches,
    warmup_cosine,
)
from labkit.model import TINY, ModelConfig, get_config, random_model

SMALL = ModelConfig(name="small", vocab_size=331, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=200, tie_word_embeddings=True, max_position_embeddings=256)


def _small(seed=0):
    return random_model(SMALL, device="cpu", dtype=torch.float32, seed=seed)


def _ids(n, seed, vocab=SMALL.vocab_size):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_training_batches_are_windows_of_the_stream():
    ids = torch.arange(1000)
    b = training_batches(ids, batch_size=3, seq_len=17, steps=4, seed=1)
    assert b.shape == (4, 3, 17) and b.dtype == torch.long
    assert torch.equal(b[..., 1:] - b[..., :-1], torch.ones(4, 3, 16, dtype=torch.long))  # contiguous slices
    assert torch.equal(b, training_batches(ids, 3, 17, 4, seed=1))
    with pytest.raises(ValueError, match="seq_len"):
        training_batches(ids, 2, 1000, 1)
    with pytest.raises(ValueError, match="batch_size"):
        training_batches(ids, 0, 8, 1)


def test_heldout_windows_spread_over_the_split():
    ids = torch.arange(1001)
    assert heldout_windows(ids, 100).shape == (10, 101)
    w = heldout_windows(ids, 100, num_windows=3)
    assert w[:, 0].tolist() == [0, 400, 900]  # windows 0, 4 and 9 of 10
    assert w[-1, -1] == 1000
    with pytest.raises(ValueError, match="num_windows"):
        heldout_windows(ids, 100, num_windows=11)
    with pytest.raises(ValueError, match="seq_len"):
        heldout_windows(ids, 2000)


def test_heldout_loss_is_log_perplexity():
    model = _small()
    ids = _ids(32 * 6 + 1, seed=2)
    ref = math.log(perplexity(model, ids, seq_len=32, batch_size=4))
    assert abs(heldout_loss(model, ids, seq_len=32, batch_size=4) - ref) < 1e-5
    assert abs(heldout_loss(model, ids, seq_len=32, precision="bf16-mixed") - ref) < 1e-2 * ref
    with pytest.raises(ValueError, match="precision"):
        heldout_loss(model, ids, precision="fp16")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_checkpointing_changes_memory_not_math(method):
    batch = _ids(2 * 24, seed=3).view(2, 24)
    grads = []
    for ckpt in (False, True):
        model = prepare_model(_small(), TrainSetup(method=method, precision="fp32", checkpointing=ckpt))
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        grads.append((loss.detach(), torch.cat([p.grad.flatten() for p in trainable_parameters(model)])))
    (l0, g0), (l1, g1) = grads
    assert relative_error(l1, l0) < 1e-5
    assert g0.abs().sum() > 0 and relative_error(g1, g0) < 1e-5


def test_bf16_autocast_step_matches_fp32_step():
    batch = _ids(2 * 20, seed=4).view(2, 20)
    losses = []
    for precision in ("fp32", "bf16-mixed"):
        model = prepare_model(_small(), TrainSetup(method="full", precision=precision))
        opt = make_optimizer(trainable_parameters(model), "sgd", lr=1e-3)
        losses.append(train_step(model, opt, batch, precision))
        assert all(p.grad is None for p in model.parameters())  # freed after the step
    assert abs(losses[1] - losses[0]) < 1e-2 * losses[0]


@pytest.mark.parametrize("method,precision,optimizer,base", [
    ("full", "fp32", "adamw8bit", "fp32"), ("lora", "bf16-mixed", "adamw", "bf16"),
    ("qlora", "bf16-mixed", "adamw8bit", "bf16"),
])
def test_loss_decreases(method, precision, optimizer, base):
    # a short stream repeated: a few steps must learn it, whatever the method
    ids = _ids(40, seed=5).repeat(20)
    setup = TrainSetup(method=method, precision=precision, optimizer=optimizer, base_dtype=base, batch_size=4,
                       seq_len=32, device="cpu")
    model = prepare_model(_small(), setup)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    result = finetune(model, ids, setup, steps=8, lr=1e-2 if method != "full" else 3e-3, warmup_steps=0)
    assert len(result.losses) == 8 and len(result.step_times.samples_s) == 7
    assert result.losses[-1] < 0.9 * result.losses[0], result.losses
    for n, p in model.named_parameters():  # nothing frozen moved
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_warmup_cosine_schedule():
    f = warmup_cosine(steps=100, warmup=10, floor=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 99))


def test_bad_input():
    model = _small()
    with pytest.raises(ValueError, match="fp32 master"):
        prepare_model(copy.deepcopy(model).to(torch.bfloat16), TrainSetup(method="full"))
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer(list(model.parameters()), "adam16", lr=1e-3)
    with pytest.raises(ValueError, match="lr"):
        make_optimizer(list(model.parameters()), "adamw", lr=0.0)
    with pytest.raises(ValueError, match="empty"):
        make_optimizer([], "adamw", lr=1e-3)
    setup = TrainSetup(method="lora", precision="fp32", batch_size=2, seq_len=16)
    prepare_model(model, setup)
    with pytest.raises(ValueError, match="steps"):
        finetune(model, _ids(100, 6), setup, steps=1, lr=1e-3)
    with pytest.raises(ValueError, match="warmup_steps"):
        finetune(model, _ids(100, 6), setup, steps=4, lr=1e-3, warmup_steps=5)
    with pytest.raises(ValueError, match="batch has shape"):
        measure_step_memory(model, setup, _ids(30, 7).view(2, 15))
    with pytest.raises(ValueError, match="precision"):
        train_step(model, make_optimizer(trainable_parameters(model), "sgd", 1e-3), _ids(32, 8).view(2, 16),
                   "fp8")


# --- on the GPU (the lead's H200 run) ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_gpu_memory_model_matches_cuda_allocator(tiny_model, method):
    from labkit.experiments.finetuning import recipe

    model = copy.deepcopy(tiny_model[0]).to("cuda")
    setup = recipe(method, batch_size=4, seq_len=256, device="cuda")
    prepare_model(model, setup)
    ids = torch.randint(0, TINY.vocab_size, (4, 256), generator=torch.Generator().manual_seed(9))
    measured = measure_step_memory(model, setup, ids)
    predicted = training_memory(get_config(model), setup)
    assert "cuda" in measured["method"]
    assert abs(predicted.peak - measured["peak"]) / measured["peak"] <= 0.15, (predicted.peak_phase, measured)


@pytest.mark.gpu
def test_gpu_qlora_learns(tiny_model):
    from labkit.experiments.finetuning import recipe

    model = copy.deepcopy(tiny_model[0]).to("cuda")
    setup = recipe("qlora", batch_size=4, seq_len=64, device="cuda")
    prepare_model(model, setup)
    ids = _ids(60, seed=10, vocab=TINY.vocab_size).repeat(20)
    result = finetune(model, ids, setup, steps=10, lr=1e-2, warmup_steps=0)
    assert result.losses[-1] < 0.9 * result.losses[0], result.losses


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["full-fp32", "full-bf16-8bit-ckpt", "lora-ckpt"])
def test_gpu_memory_model_of_notebook_07_variants(tiny_model, variant):
    """Notebook 07's extra variants at its gpu check size (8 x 512) within the 15% bar on CUDA. Full fp32 missed
    by 19.8% on an H100 before the model counted SDPA's math backend (fp32 with grouped-query attention on CUDA
    saves the attention probabilities and K/V expanded per head: ``activations.sdpa_math_backend``)."""
    from labkit.experiments.finetuning import memory_row, recipe

    setup = {"full-fp32": TrainSetup(method="full", precision="fp32", batch_size=8, seq_len=512, device="cuda"),
             "full-bf16-8bit-ckpt": TrainSetup(method="full", precision="bf16-mixed", optimizer="adamw8bit",
                                               checkpointing=True, batch_size=8, seq_len=512, device="cuda"),
             "lora-ckpt": recipe("lora", 8, 512, device="cuda", checkpointing=True, bf16=True)}[variant]
    row = memory_row(lambda: copy.deepcopy(tiny_model[0]).to("cuda"), setup)
    assert row["rel_err"] <= 0.15, row


@pytest.mark.gpu
def test_gpu_lora_lowers_the_heldout_loss_at_notebook_07_sizes(tiny_model):
    """LoRA as notebook 07's gpu profile trains it (16 x 512 tokens, 40 steps: two passes over task_train) lowers
    the task's held-out loss. At 400 steps (20 passes) the same recipe raised it by 0.11 nats on an H100: the
    held-out loss falls for about two passes, then over-fitting turns it up."""
    from labkit.data import split_tokens
    from labkit.experiments.finetuning import DEFAULT_LR, method_row, recipe
    from labkit.model import load_model

    _, tok = load_model()
    train, held = split_tokens("task_train", tok), split_tokens("task_heldout", tok)
    row = method_row(copy.deepcopy(tiny_model[0]).to("cuda"), recipe("lora", 16, 512, device="cuda", bf16=True),
                     train, {"task_heldout": held}, steps=40, lr=DEFAULT_LR["lora"], eval_seq_len=512,
                     eval_windows=None)
    assert row["task_heldout_drop"] > 0.1, row["task_heldout_drop"]
