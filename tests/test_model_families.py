"""labkit.model against Hugging Face, one tiny random checkpoint per family and feature (made with the family's
HF config class, saved with ``save_pretrained``, loaded by our loader): logits of the plain forward within 1e-5
of HF's on irregular lengths, and greedy decoding on the paged forward (two sequences of irregular lengths in one
batch, prefill then step by step) equal to HF ``generate`` token for token."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from labkit.evaluate import relative_error
from labkit.kvcache import SeqBlocks
from labkit.model import ModelInput, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.05, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)

# name -> (config class, overrides); each case turns on one family or feature
CASES = {
    "llama": (LlamaConfig, {}),
    "llama-mha-tied": (LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope": (LlamaConfig, dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=16))),
    "llama-linear-rope": (LlamaConfig, dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                 factor=2.0))),
    "llama-dynamic-rope": (LlamaConfig, dict(max_position_embeddings=16, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama-yarn-rope": (LlamaConfig, dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                               original_max_position_embeddings=16))),
    "llama-bias": (LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "mistral-window": (MistralConfig, dict(sliding_window=4)),
    "qwen2": (Qwen2Config, {}),
    "qwen2-window": (Qwen2Config, dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": (Qwen3Config, dict(head_dim=16)),
    "gemma": (GemmaConfig, dict(head_dim=16)),
    "phi3": (Phi3Config, {}),
    "phi3-partial-window": (Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=6)),
}


def make_checkpoint(name, path):
    cls, over = CASES[name]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cls(**{**TINY, **over}), dtype=torch.float32).eval()
    if name == "gemma":  # HF initialises Gemma's (1 + w) norms at w = 0: make them count
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.normal_(0.0, 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, path)
    return request.param, hf, load_checkpoint(path, dtype=torch.float32)


def test_logits_match_hf(pair):
    name, hf, ours = pair
    g = torch.Generator().manual_seed(1)
    for batch, length in ((2, 13), (1, 1), (3, 7), (1, 24)):  # 24: past the dynamic model's 16 positions
        ids = torch.randint(0, 256, (batch, length), generator=g)
        with torch.no_grad():
            ref = hf(ids).logits
            out = ours(ids)
        assert out.shape == ref.shape
        assert relative_error(out, ref) < 1e-5, (name, batch, length)


def greedy_paged(model, prompts, steps, block_size=4):
    """Prefill every prompt in one step, then decode all of them together, greedily, ``steps`` tokens each.
    Returns each sequence's tokens and its logits ``[steps, vocab]``."""
    cache = model.make_cache(num_blocks=64, block_size=block_size)
    for t in cache.k_caches + cache.v_caches:
        t.fill_(float("nan"))  # a slot read before it is written poisons the output
    seqs = [SeqBlocks(p, s) for s, p in enumerate(prompts)]
    for seq in seqs:
        cache.allocate(seq)
    out, step_logits = [[] for _ in prompts], [[] for _ in prompts]
    lens = [len(p) for p in prompts]
    for _ in range(steps):
        inp = ModelInput.build(cache, seqs, lens, len(seqs) if lens[0] == 1 else 0)
        logits = model.forward_paged(inp, cache)
        assert logits.dtype == torch.float32 and logits.shape == (len(seqs), model.config.vocab_size)
        for s, seq in enumerate(seqs):
            cache.mark_computed(seq, seq.num_tokens)
            tok = int(logits[s].argmax())
            step_logits[s].append(logits[s])
            out[s].append(tok)
            seq.token_ids.append(tok)
            cache.append_slots(seq)
        lens = [1] * len(seqs)
    return out, [torch.stack(x) for x in step_logits]


def test_greedy_paged_decode_matches_hf_generate(pair):
    name, hf, ours = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11)]
    ref, ref_logits = [], []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
        ref.append(gen.sequences[0, len(p):].tolist())
        ref_logits.append(torch.cat(gen.logits).float())
    assert all(len(r) == 20 for r in ref)
    tokens, logits = greedy_paged(ours, prompts, 20)
    assert tokens == ref, name
    for out, want in zip(logits, ref_logits):  # every step's logits, not only their argmax
        assert relative_error(out, want) < 1e-5, name


@pytest.mark.parametrize("name", ["mistral-window", "llama"])
def test_chunked_prefill_and_mixed_step(name, tmp_path):
    """A prompt prefilled in chunks, then a step mixing its decode with another prompt: each sequence's last
    logits equal HF's full forward over its tokens (windows reach into the cached chunk)."""
    hf = make_checkpoint(name, tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 256, (17,), generator=g).tolist(), torch.randint(0, 256, (6,), generator=g).tolist()
    cache = ours.make_cache(num_blocks=32, block_size=4)
    sa, sb = SeqBlocks(a[:7], "a"), SeqBlocks(b, "b")
    cache.allocate(sa)
    for chunk in (7, 10):
        if chunk == 10:
            sa.token_ids += a[7:]
            cache.append_slots(sa)
        last = ours.forward_paged(ModelInput.build(cache, [sa], [chunk]), cache)
        cache.mark_computed(sa, sa.num_tokens)
    nxt = int(last[0].argmax())
    sa.token_ids.append(nxt)
    cache.append_slots(sa)
    cache.allocate(sb)
    logits = ours.forward_paged(ModelInput.build(cache, [sa, sb], [1, 6], 1), cache)
    with torch.no_grad():
        ref_a = hf(torch.tensor([a + [nxt]])).logits[0, -1]
        ref_b = hf(torch.tensor([b])).logits[0, -1]
    assert relative_error(logits[0], ref_a) < 1e-5
    assert relative_error(logits[1], ref_b) < 1e-5


def test_separate_projections_give_the_same_logits(tmp_path):
    """merge_qkv / merge_gate_up off keeps HF's separate projections (and splits Phi-3's fused ones)."""
    for name in ("qwen2", "phi3"):
        path = tmp_path / name
        hf = make_checkpoint(name, path)
        ours = load_checkpoint(path, dtype=torch.float32, merge_qkv=False, merge_gate_up=False)
        assert hasattr(ours.model.layers[0].self_attn, "q_proj")
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            assert relative_error(ours(ids), hf(ids).logits) < 1e-5, name


def test_int8_cache_runs_close(tmp_path):
    """A quantised cache is written through PagedKVCache.write and read dequantised."""
    hf = make_checkpoint("mistral-window", tmp_path)
    ours = load_checkpoint(tmp_path, dtype=torch.float32)
    p = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = ours.make_cache(num_blocks=8, block_size=4, kv_dtype="int8")
    seq = SeqBlocks(p)
    cache.allocate(seq)
    out = ours.forward_paged(ModelInput.build(cache, [seq], [11]), cache)
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1]
    assert relative_error(out[0], ref) < 2e-2


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_logits_match_hf_bf16(name, tmp_path):
    """In bf16 each step rounds where HF's rounds (norms, RoPE tables, Gemma's embedding scale): within the bf16
    bound of the tolerance table (on the CPU the logits come out bit for bit equal)."""
    make_checkpoint(name, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours = load_checkpoint(tmp_path, dtype="bf16")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out, ref = ours(ids), hf(ids).logits
    assert out.dtype == torch.bfloat16
    assert relative_error(out.float(), ref.float()) < 1e-2
