"""labkit.parallel.tensor_parallel: the hand-written Megatron TP of the embedded model on 2 and 4 gloo ranks.

Float32 logits within 1e-5 relative of the unsharded model, greedy tokens identical, two all-reduces per layer,
gradients of sharded weights equal the matching slices of the unsharded gradients; bad sizes raise clearly.
"""

import pytest
import torch

from labkit.experiments import parallelism as ex
from labkit.model import PRESETS
from labkit.parallel import launch
from labkit.parallel.tensor_parallel import allowed_tp_sizes, check_tp_size, head_rows

TOL = 1e-5  # DESIGN: float32


@pytest.fixture(scope="module")
def config():
    from transformers import AutoConfig

    from labkit.data import EMBEDDED_MODEL_DIR

    return AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)


def _prompt(batch=2, length=13, seed=0):
    return torch.randint(8192, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_allowed_sizes_and_clear_errors(config):
    assert allowed_tp_sizes(config) == [1, 2, 4]  # 4 query heads, 2 KV heads (replicated at tp=4)
    with pytest.raises(ValueError, match=r"tp=3 cannot shard.*allowed: \[1, 2, 4\]"):
        check_tp_size(config, 3)
    with pytest.raises(ValueError, match="tp=8"):
        check_tp_size(config, 8)
    big = PRESETS["llama-3-70b"].to_hf_config()
    assert {1, 2, 4, 8} <= set(allowed_tp_sizes(big))


def test_kv_heads_are_split_or_replicated(config):
    d = config.head_dim
    q, kv, rep = head_rows(config, 2, 1)
    assert (q, kv, rep) == (slice(2 * d, 4 * d), slice(d, 2 * d), 1)
    # tp=4: query head r uses KV head r // 2, which ranks 2r, 2r+1 both keep
    rows = [head_rows(config, 4, r) for r in range(4)]
    assert [r[1].start // d for r in rows] == [0, 0, 1, 1] and {r[2] for r in rows} == {2}


# One launch per world size runs every check of that size (ex.sequence): starting the ranks (each imports torch,
# transformers and labkit) and joining the group cost more than most checks.
@pytest.fixture(scope="module")
def tp2():
    calls = [(ex.tp_layers_check, (), {}), (ex.tp_check, (_prompt(),), {"max_new_tokens": 6}),
             (labkit_tp_check, (_prompt(batch=2, length=11, seed=2),), {})]
    return launch(ex.sequence, 2, calls, backend="gloo", timeout_s=240)


@pytest.fixture(scope="module")
def tp4():
    calls = [(ex.tp_check, (_prompt(batch=1, length=9, seed=1),), {"max_new_tokens": 4, "check_grad": False}),
             (labkit_tp_check, (_prompt(batch=2, length=11, seed=2),), {})]
    return launch(ex.sequence, 4, calls, backend="gloo", timeout_s=240)


@pytest.mark.distributed
def test_tp_layers_on_irregular_shapes(tp2):
    for layers, _, _ in tp2:
        assert max(layers.values()) < TOL, layers


@pytest.mark.distributed
def test_tp2_matches_single_process(tp2, config):
    for _, res, _ in tp2:
        assert res["logits_rel_err"] < TOL
        assert torch.equal(res["tokens"], res["ref_tokens"])
        assert max(res["grad_rel_err"].values()) < TOL, res["grad_rel_err"]
        # two all-reduces per layer (o_proj, down_proj) + the vocab-parallel embedding; the logits all-gathered
        assert res["collectives_per_forward"] == {"all_reduce": 2 * config.num_hidden_layers + 1, "all_gather": 1}
        batch, seq = _prompt().shape
        assert res["bytes_per_forward"]["all_reduce"] == (2 * config.num_hidden_layers + 1) * batch * seq * \
            config.hidden_size * 4


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_labkit_model_tp_matches_single_process(tp, request):
    """The merged q/k/v sharded per head group (KV heads replicated at tp=4), gate/up per half: the logits within
    1e-5, and the engine's greedy tokens on every rank equal the unsharded engine's (``labkit_tp_check``, run in
    the launch of its world size)."""
    for *_, res in request.getfixturevalue(f"tp{tp}"):
        assert res["logits_rel_err"] < TOL
        assert res["tokens"] == res["ref_tokens"]
        assert res["kv_heads"] == (2, 1)


@pytest.mark.distributed
def test_tp4_replicates_kv_heads_and_matches(tp4):
    for res, _ in tp4:
        assert res["logits_rel_err"] < TOL
        assert torch.equal(res["tokens"], res["ref_tokens"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_nccl():
    out = launch(ex.tp_check, 2, _prompt(), max_new_tokens=6, backend="nccl", timeout_s=300)
    for res in out:
        assert res["logits_rel_err"] < 1e-3  # float32 on GPUs: TF32/reduction order may differ (DESIGN: 1e-3)
        assert torch.equal(res["tokens"], res["ref_tokens"])


def labkit_tp_check(rank: int, world_size: int, prompt_ids: torch.Tensor, max_new_tokens: int = 6) -> dict:
    """One rank: labkit.model's decoder of the embedded model, its logits and the engine's greedy tokens before and
    after ``tensor_parallel`` (the engine runs the sharded model on this rank's share of the KV heads)."""
    from labkit.engine import LLMEngine, SamplingParams
    from labkit.evaluate import relative_error
    from labkit.model import load_checkpoint
    from labkit.parallel import tensor_parallel

    model = load_checkpoint(dtype=torch.float32)
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)

    def run(m):
        with torch.no_grad():
            logits = m(prompt_ids)
        engine = LLMEngine(m, kernels="torch", num_blocks=16, block_size=8, max_num_seqs=2, cuda_graphs=False)
        return logits, [o.output_token_ids for o in engine.generate(prompt_ids.tolist(), params, progress=False)]

    ref_logits, ref_tokens = run(model)
    full_heads = model.config.num_kv_heads
    tensor_parallel(model)
    logits, tokens = run(model)
    return {"logits_rel_err": relative_error(logits, ref_logits), "tokens": tokens, "ref_tokens": ref_tokens,
            "kv_heads": (full_heads, model.config.num_kv_heads)}
