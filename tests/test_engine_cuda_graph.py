"""CUDA-graph decode steps: bucket sizes and lookup everywhere; on CUDA, replayed steps give the eager steps' logits
(fp32 on the embedded model, bf16 on 4 layers of the Llama-3-8B shape), with a padding row in the batch."""

from types import SimpleNamespace

import pytest
import torch

from labkit.engine.cuda_graph import DecodeGraphs, default_graph_batch_sizes
from labkit.engine.model_runner import ModelRunner
from labkit.evaluate import relative_error
from labkit.kvcache import PagedKVCache


def nan_cache(model, **kw) -> PagedKVCache:
    cache = PagedKVCache.for_model(model, **kw)
    for t in cache.k_caches + cache.v_caches:
        t.fill_(float("nan"))  # a slot read before it is written poisons the output
    return cache


def test_bucket_sizes_and_lookup():
    assert default_graph_batch_sizes(1) == [1]
    assert default_graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_graph_batch_sizes(256)[-3:] == [192, 224, 256]
    graphs = SimpleNamespace(batch_sizes=[1, 2, 4, 8])
    assert [DecodeGraphs.bucket(graphs, n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def test_refused_on_the_cpu(tiny_model):
    runner = ModelRunner(tiny_model[0], PagedKVCache.for_model(tiny_model[0], 4, 4), kernels="torch")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="need a CUDA device"):
            DecodeGraphs(runner, [1, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(dtype):
    from labkit.models import load_model, random_model

    if dtype == torch.float32:
        model = load_model(device="cuda")[0]
    else:  # a real GQA shape with random weights: 4 layers of Llama-3-8B
        model = random_model("llama-3-8b", device="cuda", dtype="bf16", num_layers=4)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 33, 17)]
    caches, runners = [], []
    for graphs in (False, True):
        cache = nan_cache(model, num_blocks=64, block_size=16)
        runners.append(ModelRunner(model, cache, cuda_graphs=graphs, max_num_seqs=4, max_model_len=128))
        caches.append(cache)
    assert runners[1].graph_batch_sizes == [1, 2, 4] and not runners[0].graph_batch_sizes
    steps = torch.randint(3, vocab, (6, 3), generator=g).tolist()  # the same fed tokens for both runners
    logits = []
    for cache, runner in zip(caches, runners):
        for i, p in enumerate(prompts):
            cache.allocate(i, p)
        out = [runner.execute([0, 1, 2], [len(p) for p in prompts], 0)]
        for t in steps:  # batch 3 replays the graph of 4 (one padding row)
            for i in range(3):
                cache.append_slots(i, [t[i]])
            out.append(runner.execute([0, 1, 2], [1, 1, 1], 3))
        logits.append(out)
    for eager, graph in zip(*logits):
        assert torch.isfinite(graph).all() and relative_error(graph, eager) <= tol
