"""labkit.parallel.pipeline: stages of the embedded model, in one process and on 2 and 3 gloo ranks (3 has a middle
stage; the notebook's gpu profile runs 4).

Logits within 1e-5 of the unsharded model, greedy micro-batched decoding identical to HF generate, the same through
torch.distributed.pipelining, and training gradients (GPipe and 1F1B) equal to the unsharded model's.
"""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.experiments.parallelism import pp_check, sequence
from labkit.parallel import launch
from labkit.parallel.pipeline import StageKVCache, build_stage, causal_mask, head_cost_layers, partition_layers

TOL = 1e-5


def test_partition_balances_the_head():
    assert partition_layers(8, 2, head_cost=8 / 3) == [range(0, 5), range(5, 8)]
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    parts = partition_layers(7, 3, head_cost=1.5)
    assert [i for r in parts for i in r] == list(range(7)) and all(len(r) >= 1 for r in parts)
    with pytest.raises(ValueError, match="num_stages=9 must be in"):
        partition_layers(8, 9)


def test_causal_mask_and_cache():
    m = causal_mask(2, 3, torch.float32, torch.device("cpu"))
    assert m.shape == (1, 1, 2, 5)
    assert (m[0, 0, 0, :4] == 0).all() and m[0, 0, 0, 4] < -1e30 and (m[0, 0, 1] == 0).all()
    cache = StageKVCache()
    k = torch.randn(1, 2, 3, 4)
    cache.update(k, k + 1, layer_idx=5)
    k2, v2 = cache.update(k[:, :, :1], k[:, :, :1], layer_idx=5)
    assert k2.shape == (1, 2, 4, 4) and cache.get_seq_length() == 4 and torch.equal(v2[:, :, :3], k + 1)


def test_stages_chained_in_one_process(tiny_model):
    model, _ = tiny_model
    layer_weights = 256 * (4 * 64 * 2 + 2 * 64 * 2) + 3 * 256 * 768  # q, o + k, v + gate, up, down
    assert head_cost_layers(model.config) == pytest.approx(8192 * 256 / layer_weights)
    ids = torch.randint(8192, (3, 10), generator=torch.Generator().manual_seed(0))
    stages = [build_stage(model, s, 3) for s in range(3)]
    with torch.no_grad():
        ref = model(ids).logits
        h = ids
        for st in stages:
            h = st(h)
        assert relative_error(h, ref) < TOL
        # prefill 9 tokens into per-stage caches, then decode the 10th: the last position's logits again
        caches = [StageKVCache() for _ in stages]
        h = ids[:, :9]
        for st, c in zip(stages, caches, strict=True):
            h = st(h, c)
        h = ids[:, 9:]
        for st, c in zip(stages, caches, strict=True):
            h = st(h, c)
        assert relative_error(h[:, 0], ref[:, -1]) < TOL


def test_bad_stage_arguments(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="stage_index=2 must be in"):
        build_stage(model, 2, 2)
    with pytest.raises(ValueError, match="must cover layers"):
        build_stage(model, 0, 2, partition=[range(0, 3), range(4, 8)])
    from labkit.parallel.pipeline import LlamaStage

    with pytest.raises(ValueError, match=r"layers=range\(-1, 2\) must be a non-empty range of layer indices in "
                                         r"\[0, 8\)"):
        LlamaStage(model, range(-1, 2), 0, 2)  # used to take the last layer first
    with pytest.raises(ValueError, match=r"layers=range\(6, 9\)"):
        LlamaStage(model, range(6, 9), 1, 2)
    with pytest.raises(ValueError, match=r"stage_index=-1 must be an int in \[0, num_stages=2\)"):
        LlamaStage(model, range(0, 4), -1, 2)


# per world size (3: a middle stage): pp_check's (batch, micro-batches, train), labkit_pp_check's (batch, micro-batches)
PP_CASES = {2: ((4, 2, True), (2, 2)), 3: ((3, 3, False), (3, 1))}


@pytest.fixture(scope="module")
def pp_ranks():
    """``run(world)``: each rank's results of both checks of ``PP_CASES[world]``, ``[(pp_check's, labkit_pp_check's)]``,
    from one launch per world size (``sequence``): starting the ranks (each imports torch, transformers and labkit)
    and joining the group cost more than the checks."""
    runs = {}

    def run(world: int) -> list:
        if world not in runs:
            (batch, m, train), (labkit_batch, labkit_m) = PP_CASES[world]
            calls = [(pp_check, (torch.randint(8192, (batch, 11), generator=torch.Generator().manual_seed(world)),),
                      {"max_new_tokens": 5, "num_microbatches": m, "train": train}),
                     (labkit_pp_check, (torch.randint(8192, (labkit_batch, 9),
                                                      generator=torch.Generator().manual_seed(7)),),
                      {"num_microbatches": labkit_m})]
            runs[world] = launch(sequence, world, calls, backend="gloo", timeout_s=240)
        return runs[world]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("world, batch, m, train", [(w, *c[0]) for w, c in PP_CASES.items()])
def test_pipeline_matches_single_process(pp_ranks, world, batch, m, train):
    out = [pp for pp, _ in pp_ranks(world)]
    last = out[-1]
    assert last["logits_rel_err"] < TOL
    assert last["torch_pipelining_rel_err"] < TOL
    assert sorted(i for r in out for i in r["layers"]) == list(range(8))
    for res in out:
        assert torch.equal(res["tokens"], res["ref_tokens"])  # micro-batched decode == HF greedy generate
        for sched in ("gpipe", "1f1b") if train else ():
            assert res[f"train_{sched}"]["grad_rel_err_max"] < TOL
    if train:
        assert last["train_1f1b"]["loss_rel_err"] < TOL


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pipeline_on_nccl():
    prompt = torch.randint(8192, (4, 11), generator=torch.Generator().manual_seed(5))
    out = launch(pp_check, 2, prompt, max_new_tokens=5, num_microbatches=2, backend="nccl", timeout_s=300)
    assert out[-1]["logits_rel_err"] < 1e-5
    assert all(torch.equal(r["tokens"], r["ref_tokens"]) for r in out)


def labkit_pp_check(rank: int, world_size: int, prompt: torch.Tensor, max_new_tokens: int = 5,
                    num_microbatches: int = 1) -> dict:
    """One rank: its stage (a layer range) of labkit.model's decoder of the embedded model, greedy decoding through
    the pipeline (each stage on its own paged cache), and HF ``generate`` of the same checkpoint."""
    from labkit.model import load_checkpoint, load_model
    from labkit.parallel.pipeline import LabkitStage, build_stage, pipeline_generate

    hf, _ = load_model()
    ref = hf.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    stage = build_stage(load_checkpoint(dtype=torch.float32), rank, world_size)
    assert isinstance(stage, LabkitStage)
    tokens = pipeline_generate(stage, prompt, max_new_tokens, num_microbatches)
    return {"tokens": tokens, "ref_tokens": ref, "layers": list(stage.layer_ids)}


@pytest.mark.distributed
@pytest.mark.parametrize("world, batch, m", [(w, *c[1]) for w, c in PP_CASES.items()])
def test_labkit_model_pipeline_matches_hf(pp_ranks, world, batch, m):
    """labkit.model split by layer ranges over 2 and 3 gloo ranks (micro-batched or not): HF's greedy tokens."""
    out = [labkit for _, labkit in pp_ranks(world)]
    assert sorted(i for r in out for i in r["layers"]) == list(range(8))
    for res in out:
        assert torch.equal(res["tokens"], res["ref_tokens"])
