"""The loader: the embedded (sharded, bf16-stored) checkpoint against HF's load of it, an HF model in memory,
random weights, dtype choice, and clear errors for missing, unexpected and misshapen tensors."""

import logging
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from labkit.data import EMBEDDED_MODEL_DIR
from labkit.evaluate import relative_error
from labkit.kvcache import SeqBlocks
from labkit.model import Checkpoint, ModelInput, adopt_hf_model, from_config, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ours():
    return load_checkpoint(dtype=torch.float32)  # None: the embedded model, data/pydocs-llama


def test_embedded_checkpoint_is_sharded():
    with Checkpoint(EMBEDDED_MODEL_DIR) as ckpt:
        assert len({p.name for p in ckpt.files.values()}) == 2
        assert ckpt.stored_dtype() == torch.bfloat16


def test_embedded_model_logits_equal_hf(ours, tiny_model):
    hf, tok = tiny_model
    ids = torch.tensor([tok.encode("def read_json(path):\n    with open(path) as f:\n        return json.load(f)")])
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 8192, (3, 11), generator=g)
    with torch.no_grad():
        for x in (ids, batch):
            assert relative_error(ours(x), hf(x).logits) < 1e-5


def test_embedded_model_greedy_paged_equals_generate(ours, tiny_model):
    hf, tok = tiny_model
    prompts = [tok.encode("import os\nimport sys\n\ndef main("), tok.encode("class Stack:\n    def push(self, x):")]
    ref = []
    for p in prompts:
        ids = torch.tensor([p])
        ref.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist())
    cache = ours.make_cache(num_blocks=32, block_size=16)
    seqs = [SeqBlocks(p, s) for s, p in enumerate(prompts)]
    for seq in seqs:
        cache.allocate(seq)
    got, lens = [[], []], [len(p) for p in prompts]
    for step in range(16):
        inp = ModelInput.build(cache, seqs, lens, 2 if step else 0)
        nxt = ours.forward_paged(inp, cache).argmax(-1).tolist()
        for s, t in enumerate(nxt):
            got[s].append(t)
            cache.mark_computed(seqs[s], seqs[s].num_tokens)
            seqs[s].token_ids.append(t)
            cache.append_slots(seqs[s])
        lens = [1, 1]
    assert got == ref


def test_an_hf_model_in_memory_is_adopted_with_its_weights_shared(tiny_model, ours):
    hf, _ = tiny_model
    mem = adopt_hf_model(hf)
    assert mem.dtype == torch.float32 and mem.device == torch.device("cpu")
    assert mem.model.embed_tokens.weight is hf.model.embed_tokens.weight is mem.lm_head.weight  # shared and tied
    assert adopt_hf_model(mem) is mem  # a CausalLM is itself
    ids = torch.tensor([[5, 17, 300, 2, 41]])
    assert relative_error(mem(ids), ours(ids)) < 1e-5


def test_dtype_defaults_to_the_checkpoints_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="labkit.model"):
        m = load_checkpoint()
    assert m.dtype == torch.bfloat16
    assert "torch.bfloat16 (the checkpoint's own dtype" in caplog.text
    assert load_checkpoint(dtype="fp16").dtype == torch.float16
    with pytest.raises(ValueError, match="dtype="):
        load_checkpoint(dtype="int8")


def test_from_config_random_weights():
    meta = from_config("llama-3-8b", device="meta")  # shapes only, nothing allocated
    assert meta.model.layers[0].self_attn.qkv_proj.weight.shape == (4096 + 2 * 1024, 4096)
    assert sum(p.numel() for p in meta.parameters()) == 8_030_261_248
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    m = from_config(cfg, dtype=torch.float32, seed=3)
    w = m.model.layers[1].mlp.gate_up_proj.weight
    assert (w != 0).all() and 0.015 < w.std() < 0.025
    assert torch.equal(m.model.norm.weight, torch.ones(64))
    assert torch.equal(from_config(cfg, dtype=torch.float32, seed=3).lm_head.weight, m.lm_head.weight)
    assert torch.isfinite(m(torch.randint(0, 128, (2, 5)))).all()


@pytest.fixture()
def small_checkpoint(tmp_path):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with Checkpoint(tmp_path) as ckpt:
        tensors = {n: ckpt[n] for n in ckpt}
    return tmp_path, tensors


def _rewrite(path, tensors):
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(small_checkpoint):
    path, tensors = small_checkpoint
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"missing 1 tensors \['model.layers.0.self_attn.k_proj.weight'\]"):
        load_checkpoint(path)


def test_unexpected_tensor_is_named(small_checkpoint):
    path, tensors = small_checkpoint
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.randn(64)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"unexpected 1 \['model.layers.0.self_attn.q_proj.bias'\]"):
        load_checkpoint(path)


def test_misshapen_tensor_is_named(small_checkpoint):
    path, tensors = small_checkpoint
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(95, 64)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match="gate_up_proj.weight"):
        load_checkpoint(path)


def test_no_safetensors(small_checkpoint):
    path, _ = small_checkpoint
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_checkpoint(path)


def test_paged_forward_rejects_bad_input(ours):
    cache = ours.make_cache(num_blocks=4, block_size=16)
    seq = SeqBlocks([1, 2, 3])
    cache.allocate(seq)
    inp = ModelInput.build(cache, [seq], [3])
    with pytest.raises(ValueError, match=r"positions must be int64 or int32 of shape \(3,\), got torch.int64 \(2,\)"):
        ours.forward_paged(replace(inp, positions=inp.positions[:2]), cache)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        ours.forward_paged(replace(inp, input_ids=inp.input_ids[:2], positions=inp.positions[:2]), cache)
    other = type(cache)(2, 2, 64, 4)
    with pytest.raises(ValueError, match="this model needs"):
        ours.forward_paged(inp, other)
    with pytest.raises(ValueError, match="input_ids hold ids in"):
        ours(torch.tensor([[0, 8192]]))
