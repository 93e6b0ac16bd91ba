"""PagedModelRunner on the embedded model: logits against HF's forward, greedy tokens against HF ``generate``
token for token (float32), after chunked prefill, fork with copy on write, and a prefix-cache hit."""

import pytest
import torch

from labkit.data import sample_prompts
from labkit.evaluate import relative_error
from labkit.kvcache import PagedKVCache
from labkit.kvcache.model import PagedModelRunner, prepare_step
from labkit.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_tok():
    return load_model()


@pytest.fixture(scope="module")
def prompts(model_tok):
    ps = sample_prompts(model_tok[1], 3, 29, seed=11)
    return [ps[0], ps[1][:6], ps[2] + ps[0][:13]]  # 29, 6 and 42 tokens


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_prefill_logits_match_hf_forward(model_tok, prompts):
    model, _ = model_tok
    cache = PagedKVCache.for_model(model, num_blocks=16, block_size=5)
    runner = PagedModelRunner(model, cache)
    cache.allocate("a", prompts[2])
    logits = runner.forward(prepare_step(cache, ["a"]), all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([prompts[2]])).logits[0]
    assert logits.shape == ref.shape and relative_error(logits, ref) <= 1e-5
    assert cache.seqs["a"].num_computed == len(prompts[2])


def test_batched_greedy_matches_hf_generate(model_tok, prompts):
    model, _ = model_tok
    n = 20
    cache = PagedKVCache.for_model(model, num_blocks=40, block_size=7)
    runner = PagedModelRunner(model, cache)
    # prefill all three in one flat batch, then decode them together
    for i, p in enumerate(prompts):
        cache.allocate(i, p)
    first = runner.forward(prepare_step(cache, [0, 1, 2]))
    out = runner.greedy([0, 1, 2], first, n)
    for p, o in zip(prompts, out, strict=True):
        assert o == hf_greedy(model, p, n)
    cache.check_invariants()


def test_chunked_prefill_then_decode_matches_hf(model_tok, prompts):
    model, _ = model_tok
    p = prompts[2]
    cache = PagedKVCache.for_model(model, num_blocks=20, block_size=4)
    runner = PagedModelRunner(model, cache)
    cache.allocate("s", p)
    for chunk in (10, 3, 17):  # chunks attend to the tokens cached before them
        runner.forward(prepare_step(cache, ["s"], [chunk]))
    last = runner.forward(prepare_step(cache, ["s"]))  # the remaining 12 tokens
    assert cache.seqs["s"].num_computed == len(p)
    assert runner.greedy(["s"], last, 12)[0] == hf_greedy(model, p, 12)
    with pytest.raises(ValueError, match="reserve slots first"):
        prepare_step(cache, ["s"])


def test_fork_copy_on_write_keeps_both_branches_exact(model_tok, prompts):
    model, _ = model_tok
    p = prompts[0]  # 29 tokens: the last block of 8 is partly filled and shared after the fork
    cache = PagedKVCache.for_model(model, num_blocks=20, block_size=8)
    runner = PagedModelRunner(model, cache)
    first = runner.prefill("parent", p)
    cache.fork("parent", "child")
    a = int(first.argmax())
    b = int(first.topk(2).indices[1])  # the child continues with the runner-up token instead
    logits = runner.decode(["parent", "child"], [a, b])
    assert cache.seqs["parent"].block_table[-1] != cache.seqs["child"].block_table[-1]
    outs = runner.greedy(["parent", "child"], logits, 10)
    assert [a, *outs[0]] == hf_greedy(model, p, 11)
    assert outs[1] == hf_greedy(model, p + [b], 10)
    cache.check_invariants()


def test_prefix_cache_hit_gives_identical_output(model_tok, prompts):
    model, _ = model_tok
    system = prompts[2][:24]
    a, b = system + prompts[0][:5], system + prompts[1]
    cache = PagedKVCache.for_model(model, num_blocks=30, block_size=8, enable_prefix_caching=True)
    runner = PagedModelRunner(model, cache)
    out_a = runner.greedy(["a"], runner.prefill("a", a)[None], 8)[0]
    cache.free("a")  # its blocks stay cached until evicted
    assert cache.allocate("b", b) == 24  # three full blocks of the shared prefix are reused
    out_b = runner.greedy(["b"], runner.forward(prepare_step(cache, ["b"])), 8)[0]
    assert out_a == hf_greedy(model, a, 8) and out_b == hf_greedy(model, b, 8)


def test_bad_arguments(model_tok):
    model, _ = model_tok
    with pytest.raises(ValueError, match="does not match the model"):
        PagedModelRunner(model, PagedKVCache(8, 2, 32, 4, 4))
    with pytest.raises(TypeError, match="Llama-family"):
        PagedModelRunner(torch.nn.Linear(2, 2), PagedKVCache.for_model(model, 4, 4))
    with pytest.raises(ValueError, match="attention_backend='flash' is unknown"):
        PagedModelRunner(model, PagedKVCache.for_model(model, 4, 4), attention_backend="flash")
    with pytest.raises(ValueError, match="seq_ids is empty"):
        prepare_step(PagedKVCache.for_model(model, 4, 4), [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_matches_hf_and_the_kernel_path(model_tok, prompts):
    model, _ = model_tok
    model = model.to("cuda")
    try:
        for backend in ("torch", "auto"):
            cache = PagedKVCache.for_model(model, num_blocks=40, block_size=16)
            runner = PagedModelRunner(model, cache, attention_backend=backend)
            for i, p in enumerate(prompts):
                cache.allocate(i, p)
            out = runner.greedy([0, 1, 2], runner.forward(prepare_step(cache, [0, 1, 2])), 16)
            for p, o in zip(prompts, out, strict=True):
                ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                assert o == ref[0, len(p):].tolist(), backend
    finally:
        model.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_cuda_quantised_decode_kernel_matches_torch_path(model_tok, prompts, kv_dtype):
    """int8/fp8 pools go to the Triton kernel with their scales; the torch path dequantises first."""
    model, _ = model_tok
    model = model.to("cuda")
    try:
        logits = {}
        for backend in ("torch", "auto"):
            cache = PagedKVCache.for_model(model, num_blocks=40, block_size=16, kv_dtype=kv_dtype)
            runner = PagedModelRunner(model, cache, attention_backend=backend)
            for i, p in enumerate(prompts):
                cache.allocate(i, p)
            first = runner.forward(prepare_step(cache, [0, 1, 2]))
            logits[backend] = runner.decode([0, 1, 2], first.argmax(-1).tolist())
        assert relative_error(logits["auto"], logits["torch"]) <= 1e-4
    finally:
        model.to("cpu")
