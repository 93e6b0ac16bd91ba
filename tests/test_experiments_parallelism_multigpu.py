"""labkit.experiments.parallelism.multigpu and scripts/bench_multigpu.py: the issue-11 measurement script, run by
torchrun on 2 gloo CPU ranks with tiny shapes (the NCCL runs need several GPUs). Only the shape of the output is
checked."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from labkit.data import REPO_ROOT
from labkit.experiments.parallelism.multigpu import random_tp_model

SCRIPT = REPO_ROOT / "scripts" / "bench_multigpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_multigpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_multicast_is_off_and_arguments_are_checked(monkeypatch):
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(k, raising=False)
    mod = _script()
    assert (os.environ["NCCL_NVLS_ENABLE"], os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
            os.environ["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
    with pytest.raises(SystemExit):
        mod.parse(["--sections", "comm,fsdp"])
    full = mod.plan(mod.parse([]), world=8)
    assert full["tp_sizes"] == [1, 2, 4, 8] and full["sizes"][-1] == 2**30
    assert full["tp_presets"] == [("llama-3-8b", None), ("llama-3-70b", 20)]


def test_random_model_from_meta_is_materialised():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = random_tp_model("tiny", None, torch.device("cpu"), num_layers=1, dtype=torch.float32)
    params = list(model.parameters())
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in params)
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones(256))
    ref = LlamaRotaryEmbedding(model.config)
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.inv_freq)  # rebuilt, not left uninitialised
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.distributed
def test_script_runs_under_torchrun_on_gloo(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--backend", "gloo", "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = {s: json.loads((tmp_path / "records" / f"multigpu_{s}.json").read_text())["data"]
           for s in ("comm", "tp", "pp")}
    assert {r["op"] for r in rec["comm"]["rows"]} == {"all_reduce", "all_gather", "send_recv"}
    assert set(rec["comm"]["fits"]) == {"all_reduce@2", "all_gather@2", "send_recv@2"}
    tp = {(r["tp"], r["batch"]): r for r in rec["tp"]["rows"]}
    assert set(tp) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert 0 <= tp[2, 1]["comm_frac"] <= 1 and "predicted_comm_datasheet_s" in tp[2, 1]
    assert "split_overlap_s" in tp[2, 2]  # two half-batches on two communicators
    fwd = [r for r in rec["pp"]["rows"] if r["kind"] == "forward"]
    assert [(r["pp"], r["m"]) for r in fwd] == [(2, 1), (2, 2)]
    assert all(r["bubble_formula"] == 1 / (r["m"] + 1) for r in fwd)
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert set(figures) == {"parallel.gloo_allreduce_busbw_gb_s", "parallel.tp_scaling_efficiency"}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_script_smoke_on_nccl(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--backend", "nccl", "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parallel.nccl_allreduce_busbw_gb_s" in json.loads((tmp_path / "figures.json").read_text())


@pytest.mark.gpu
def test_tp_decode_row_on_the_gpus():
    """Meta-built random model, CUDA-graph capture of the decode step (with NCCL collectives when >= 2 GPUs)."""
    from labkit.experiments.parallelism.multigpu import tp_row_check
    from labkit.parallel import launch

    n = min(torch.cuda.device_count(), 2)
    rows = launch(tp_row_check, n, backend="nccl", timeout_s=300)
    assert rows[0]["graph"] and rows[0]["step_s"] > 0
    if n > 1:
        assert 0 <= rows[0]["comm_frac"] <= 1 and rows[0]["split_overlap_s"] > 0
