"""patch_model: the embedded model with Triton kernels gives the same greedy tokens as without, in float32."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.patch import patch_model, patch_summary, unpatch

PROMPT = 'def read_file(path):\n    """Return'
# the shared fixture's model lives on the CPU, where the kernels need the interpreter; CUDA has its own tests
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter path; see the gpu tests")


def _greedy(model, new_tokens=6, **inputs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)


@cpu_only
def test_patched_greedy_matches_token_for_token(tiny_model, two_layers):
    model, (_, tok) = two_layers, tiny_model  # two layers: the interpreter runs every patched module in each
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref_logits = model(ids).logits
    ref = _greedy(model, input_ids=ids)
    patch_model(model)
    try:
        s, n = patch_summary(model), model.config.num_hidden_layers
        assert n == 2 and s["norm"] == 2 * n + 1 and s["mlp"] == n and s["layer"] == n
        assert s["attention"] == "labkit_triton"
        with torch.no_grad():
            assert relative_error(model(ids).logits, ref_logits) < 1e-5
        assert torch.equal(_greedy(model, input_ids=ids), ref)
    finally:
        unpatch(model)
    assert patch_summary(model) == {"patched": False} and model.config._attn_implementation == "sdpa"
    assert torch.equal(_greedy(model, input_ids=ids), ref)


@cpu_only
def test_patched_padded_batch_uses_the_mask(tiny_model, two_layers):
    """Left padding makes HF build a boolean mask; the kernel must apply it, not plain causal attention (two layers:
    the mask reaches the kernel of each)."""
    model, (_, tok) = two_layers, tiny_model
    side = tok.padding_side
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    try:
        batch = tok(["import os\nos.path.join(", PROMPT], return_tensors="pt", padding=True)
        assert (batch.attention_mask == 0).any()
        ref = _greedy(model, new_tokens=4, **batch)
        patch_model(model)
        try:
            assert torch.equal(_greedy(model, new_tokens=4, **batch), ref)
        finally:
            unpatch(model)
    finally:
        tok.padding_side = side


@cpu_only
def test_patch_is_idempotent_and_selective(tiny_model):
    model, _ = tiny_model
    patch_model(model, attention=False, mlp=False)
    try:
        assert patch_model(model) is model  # second call: no-op
        s = patch_summary(model)
        assert s["mlp"] == 0 and s["attention"] == "sdpa"
    finally:
        unpatch(model)
    assert patch_summary(model) == {"patched": False}


def test_patch_refuses_a_model_without_llama_modules():
    with pytest.raises(ValueError, match="no Llama-style"):
        patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), attention=False)


@cpu_only
def test_patched_static_cache_decode_step(two_layers):
    """The decode step the notebook times (HF StaticCache: a boolean mask over the whole cache), on two layers."""
    from labkit.experiments.decode_step import StaticDecodeStep

    model = two_layers
    ref = StaticDecodeStep(model, batch_size=2, context_len=21, cuda_graph=False).step().clone()
    patch_model(model)
    try:
        got = StaticDecodeStep(model, batch_size=2, context_len=21, cuda_graph=False).step()
    finally:
        unpatch(model)
    assert relative_error(got, ref) < 1e-5


@pytest.mark.gpu
def test_patched_bf16_decode_step_replays_in_a_cuda_graph():
    """Llama-3-8B's layer shape in bf16 (two layers), the notebook's static-cache step captured as a graph."""
    from labkit.experiments.decode_step import StaticDecodeStep
    from labkit.model import random_model

    model = random_model("llama-3-8b", device="cuda", num_layers=2)
    ref = StaticDecodeStep(model, batch_size=4, context_len=300, cuda_graph=True).step().float().clone()
    patch_model(model)
    try:
        got = StaticDecodeStep(model, batch_size=4, context_len=300, cuda_graph=True).step().float()
    finally:
        unpatch(model)
    assert relative_error(got, ref) < 2e-2


@pytest.mark.gpu
def test_patched_greedy_matches_on_cuda_in_float32():
    from labkit.model import load_model

    model, tok = load_model(device="cuda")
    ids = tok(PROMPT, return_tensors="pt").input_ids.cuda()
    ref = _greedy(model, new_tokens=16, input_ids=ids)
    patch_model(model)
    try:
        assert torch.equal(_greedy(model, new_tokens=16, input_ids=ids), ref)
    finally:
        unpatch(model)
