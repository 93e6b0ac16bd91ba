"""labkit.parallel.dtensor_plan: PyTorch's parallelize_module plan against the hand-written TP (2 gloo ranks)."""

import pytest
import torch

from labkit.experiments import parallelism as ex
from labkit.parallel import launch
from labkit.parallel.dtensor_plan import check_dtensor_tp_size, llama_tp_plan


def test_plan_covers_every_linear_and_refuses_kv_replication():
    from transformers import AutoConfig

    from labkit.data import EMBEDDED_MODEL_DIR

    plan = llama_tp_plan()
    assert {k.split(".")[-1] for k in plan} == {"embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj", "lm_head"}
    config = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    check_dtensor_tp_size(config, 2)
    with pytest.raises(ValueError, match=r"tp=4.*allowed: \[1, 2\]"):
        check_dtensor_tp_size(config, 4)


@pytest.fixture(scope="module")
def two_ranks():
    """Each rank's ``(dtensor_check, labkit_dtensor_check)`` results from one launch (``ex.sequence``): starting
    the ranks and joining the group cost more than the two checks."""
    calls = [(ex.dtensor_check, (torch.randint(8192, (2, 11), generator=torch.Generator().manual_seed(3)),),
              {"max_new_tokens": 5}),
             (labkit_dtensor_check, (torch.randint(8192, (2, 11), generator=torch.Generator().manual_seed(4)),), {})]
    return launch(ex.sequence, 2, calls, backend="gloo", timeout_s=180)


@pytest.mark.distributed
def test_dtensor_plan_equals_hand_written_tp(two_ranks):
    for res, _ in two_ranks:
        assert res["plan_vs_hand_rel_err"] < 1e-5
        assert res["plan_vs_single_rel_err"] < 1e-5
        assert torch.equal(res["tokens_plan"], res["tokens_hand"])
        assert res["local_q_proj_shape"] == (128, 256)  # 2 of 4 heads x head_dim 64


def labkit_dtensor_check(rank: int, world_size: int, prompt_ids: torch.Tensor) -> dict:
    """One rank: labkit.model's decoder (separate projections) under the DTensor plan against the unsharded one."""
    from labkit.evaluate import relative_error
    from labkit.model import load_checkpoint
    from labkit.parallel import dtensor_tensor_parallel

    model = load_checkpoint(dtype=torch.float32, merge_qkv=False, merge_gate_up=False)
    with torch.no_grad():
        ref = model(prompt_ids)
        got = dtensor_tensor_parallel(model)(prompt_ids)
    return {"rel_err": relative_error(got, ref), "heads": model.model.layers[0].self_attn.num_heads}


@pytest.mark.distributed
def test_dtensor_plan_on_labkit_model(two_ranks):
    from labkit.model import load_checkpoint

    for _, res in two_ranks:
        assert res["rel_err"] < 1e-5 and res["heads"] == 2
    with pytest.raises(ValueError, match="merge_qkv=False"):
        from labkit.parallel.dtensor_plan import _labkit_ready

        _labkit_ready(load_checkpoint(), 2)
