"""labkit.model.fusion: the kernel plan is resolved once, into a frozen plan. ``CausalLM.use`` is the one path (it
returns the model over the same weights with the resolved plan); an engine build resolves once; the weight layout is
the model's, not the plan's; ``FusionPlan.without`` is the one place a fusion is turned off with what needs it."""

import dataclasses
import sys

import pytest
import torch

from labkit.model import CausalLM, FusionPlan, ModelConfig, from_config
from labkit.model.fusion import resolve_plan

CFG = ModelConfig(name="micro", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, max_position_embeddings=64)


def test_the_plan_is_frozen_and_use_returns_a_resolved_view():
    model = from_config(CFG, dtype=torch.float32)
    assert model.plan == FusionPlan()  # a model as built runs the torch references
    with pytest.raises(AttributeError):
        model.plan = FusionPlan.triton()
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.plan.norm = "triton"
    fast = model.use("triton")
    assert isinstance(fast, CausalLM) and fast is not model and model.plan == FusionPlan()
    assert fast.plan.norm == fast.plan.attention == "triton" and fast.plan.rope_cache_write
    # float weights: the int8/int4 epilogue fusions (and what needs them) are resolved off, once
    assert not (fast.plan.quant_epilogues or fast.plan.qkv_rope_cache or fast.plan.gemv_pdl)
    assert all(a is b for a, b in zip(fast.parameters(), model.parameters()))  # the same weights
    with pytest.raises(ValueError, match="kernels='cuda' is unknown"):
        model.use("cuda")


def test_a_cache_in_another_format_resolves_the_cache_write_off_and_is_checked():
    from labkit.kvcache import SeqBlocks
    from labkit.model import ModelInput

    model = from_config(CFG, dtype=torch.float32)
    int8 = model.make_cache(8, 4, kv_dtype="int8")
    plan = model.use("triton", int8).plan
    assert plan.rope == "triton" and not plan.rope_cache_write
    seq = SeqBlocks([1, 2, 3])
    int8.allocate(seq)
    with pytest.raises(ValueError, match="model.use\\(kernels, cache\\)"):
        model.use("triton").forward_paged(ModelInput.build(int8, [seq], [3]), int8)


def test_the_weight_layout_is_the_models_not_the_plans():
    assert {"merge_qkv", "merge_gate_up"}.isdisjoint(f.name for f in dataclasses.fields(FusionPlan))
    split = from_config(CFG, dtype=torch.float32, merge_qkv=False, merge_gate_up=False)
    assert (split.merge_qkv, split.merge_gate_up) == (False, False)
    assert split.use("triton").plan == FusionPlan.triton().without("quant_epilogues")


def test_without_turns_off_what_needs_the_field():
    full = FusionPlan.triton()
    assert full.without("quant_epilogues") == dataclasses.replace(full, quant_epilogues=False, qkv_rope_cache=False,
                                                                  gemv_pdl=False)
    assert full.without("rope") == dataclasses.replace(full, rope="torch", rope_cache_write=False)
    assert full.without("gemv_pdl") == dataclasses.replace(full, gemv_pdl=False)
    with pytest.raises(ValueError, match="merge_qkv"):
        full.without("merge_qkv")


def test_one_paged_forward_per_layer():
    """The fused int8/int4 path is an argument of the layer's one paged forward, not a forward of its own."""
    from labkit.model import Attention, DecoderLayer

    assert not hasattr(DecoderLayer, "forward_fused") and not hasattr(Attention, "fused_input")
    assert [n for n in vars(DecoderLayer) if n.startswith("forward")] == ["forward", "forward_paged"]


def test_an_engine_build_resolves_the_plan_once():
    """``LLMEngine`` (config, runner, graph sizes) resolves ``kernels`` once: calls counted by ``sys.setprofile``."""
    from labkit.engine import LLMEngine

    model = from_config(CFG, dtype=torch.float32)
    watched = {resolve_plan.__code__: "resolve_plan", FusionPlan.named.__func__.__code__: "named"}
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            calls.append(watched[frame.f_code])

    sys.setprofile(profile)
    try:
        engine = LLMEngine(model, kernels="triton", num_blocks=8, block_size=4, max_num_seqs=2)
    finally:
        sys.setprofile(None)
    assert sorted(calls) == ["named", "resolve_plan"]
    assert engine.runner.plan == FusionPlan.triton().without("quant_epilogues") and model.plan == FusionPlan()
