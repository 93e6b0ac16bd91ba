"""labkit.parallel.launch: real spawned ranks (gloo), results per rank, a failing rank's traceback, bad input."""

import pytest
import torch

from labkit.experiments import parallelism as ex
from labkit.parallel import RankError, launch
from labkit.parallel.launch import check_backend, resolve_fn

pytestmark = pytest.mark.distributed


def test_launch_returns_each_ranks_result():
    out = launch(ex.hello, 2, 2.5, backend="gloo")
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 2.5 * (1 + 2) for r in out)


def test_failing_rank_surfaces_its_traceback():
    with pytest.raises(RankError) as info:
        launch(ex.fail_on, 2, bad_rank=1, backend="gloo", timeout_s=60)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "fail_on" in str(info.value)  # the traceback, not just the message


def _local_fn(rank, world_size):
    return rank


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "mpi"}, "backend='mpi' is unknown"),
    ({"world_size": 0}, "world_size=0 must be a positive int"),
])
def test_bad_backend_or_world_size(kwargs, match):
    args = {"fn": ex.hello, "world_size": 2, "backend": "gloo"} | kwargs
    with pytest.raises(ValueError, match=match):
        launch(args.pop("fn"), args.pop("world_size"), **args)


def test_fn_must_be_importable():
    def inner(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="top level of a module"):
        launch(inner, 2, backend="gloo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        check_backend("nccl", 2)


def test_resolve_fn():
    assert resolve_fn("labkit.experiments.parallelism:hello") is ex.hello
    with pytest.raises(ValueError, match="module:function"):
        resolve_fn("labkit.experiments.parallelism.hello")


@pytest.mark.gpu
def test_nccl_launch_on_the_gpus():
    n = torch.cuda.device_count()
    out = launch(ex.hello, n, backend="nccl")
    assert all(r["sum"] == n * (n + 1) / 2 for r in out)


def test_the_same_function_runs_under_torchrun():
    import subprocess
    import sys

    from labkit.data import REPO_ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "labkit.parallel.launch", "labkit.experiments.parallelism:hello", "--backend", "gloo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'sum': 3.0" in proc.stdout and "'world_size': 2" in proc.stdout
