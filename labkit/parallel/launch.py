"""Start ``world_size`` ranks of torch.distributed from a notebook, a script, or ``torchrun``; collect results.

``launch(fn, world_size)`` spawns one process per rank, gives each a process group (gloo on CPU processes, NCCL
with one GPU per rank), calls ``fn(rank, world_size, *args, **kwargs)`` and returns the list of each rank's
return value. A rank that raises surfaces as ``RankError`` carrying its traceback; the other ranks are stopped.

``fn`` must be importable by name (a top-level function of a module, e.g. one in ``labkit.experiments.parallelism``),
not defined in a notebook cell: spawned processes start a fresh interpreter and import ``fn`` by its qualified
name, and a notebook's ``__main__`` cannot be imported.

The same functions run under ``torchrun``, on one node or many::

    # one node, 4 ranks (gloo on CPU, NCCL with GPUs)
    torchrun --standalone --nproc_per_node=4 -m labkit.parallel.launch labkit.experiments.parallelism:tp_demo
    # two nodes of 8 GPUs; run on every node (c10d rendezvous on the first node's address)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \\
        --rdzv_id=labkit -m labkit.parallel.launch labkit.experiments.parallelism:tp_demo --backend nccl

On CPU each rank gets ``threads`` intra-op threads (default 1) so that several ranks on few cores do not thrash.
NCCL is started with NVLink multicast (NVLS) off, as the project's machines require.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.device import environ

BACKENDS = ("gloo", "nccl")
# NVLink SHARP / multicast stays off everywhere (DESIGN: the machines do not allow cuMulticastCreate).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class RankError(RuntimeError):
    """A rank raised; ``rank`` says which, the message holds its traceback."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank


def free_port() -> int:
    """A TCP port that is free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``nccl`` when CUDA is present, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_backend(backend: str, world_size: int) -> None:
    """Raise a clear ``ValueError`` for an unknown backend or a world size the host cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; allowed: {BACKENDS}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA GPUs and none is present; use backend='gloo' on the CPU")
        if world_size > torch.cuda.device_count():
            raise ValueError(f"world_size={world_size} with backend='nccl' needs one GPU per rank; "
                             f"this host has {torch.cuda.device_count()}")


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


def init_rank(backend: str, threads: int | None = 1, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group described by the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
    as set by ``launch`` or ``torchrun``); returns ``(rank, world_size)``."""
    kwargs = {}
    if backend == "nccl":
        os.environ.update(NO_MULTICAST_ENV)
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(kwargs["device_id"])
    elif threads:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


def _worker(local_rank: int, fn: Callable, world_size: int, port: int, backend: str, threads: int | None,
            timeout_s: float, out_dir: str, args: tuple, kwargs: dict) -> None:
    """Entry of one spawned rank: join the group, run ``fn``, save its result (or traceback) to ``out_dir``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    path = Path(out_dir) / f"rank{local_rank}.pt"
    try:
        rank, world = init_rank(backend, threads, timeout_s)
        result = fn(rank, world, *args, **kwargs)
        torch.save({"ok": True, "result": result}, path)
        # leave together: a rank that tears gloo down while a peer's last send is in flight aborts that peer
        dist.barrier()
    except BaseException:
        torch.save({"ok": False, "traceback": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args, backend: str | None = None, threads: int | None = 1,
           timeout_s: float = 300.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return their results.

    ``fn`` must be a top-level function of an importable module (not a notebook cell) and its result picklable
    (tensors are fine). ``backend`` defaults to NCCL with CUDA, else gloo. ``timeout_s`` bounds every collective,
    so a rank waiting on a dead peer fails instead of hanging. Raises ``RankError`` with the first failing rank's
    traceback.
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    backend = backend or default_backend()
    check_backend(backend, world_size)
    if getattr(fn, "__module__", "__main__") in ("__main__", "__mp_main__") or "<locals>" in fn.__qualname__:
        raise ValueError(f"fn={fn.__qualname__!r} is defined in __main__ or inside a function; spawned ranks "
                         "import fn by name, so define it at the top level of a module (e.g. in labkit)")
    env = {}
    if backend == "gloo" and threads:
        env["OMP_NUM_THREADS"] = str(threads)  # children inherit it before their OpenMP starts
    if backend == "nccl":
        env.update(NO_MULTICAST_ENV)
    with environ(**env), tempfile.TemporaryDirectory(prefix="labkit-launch-") as out_dir:
        try:
            mp.start_processes(_worker, nprocs=world_size, join=True, start_method="spawn",
                               args=(fn, world_size, free_port(), backend, threads, timeout_s, out_dir,
                                     args, kwargs))
        except ProcessException as e:
            raise _first_failure(out_dir, world_size, e) from None
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)["result"]
                for r in range(world_size)]


def _first_failure(out_dir: str, world_size: int, exc: Exception) -> RankError:
    """The ``RankError`` of the rank that raised first (its saved traceback), else of the one torch reports."""
    failed = []
    for r in range(world_size):
        p = Path(out_dir) / f"rank{r}.pt"
        if p.exists():
            rec = torch.load(p, weights_only=False)
            if not rec["ok"]:
                failed.append((p.stat().st_mtime, r, rec["traceback"]))
    if failed:
        _, r, tb = min(failed)
        return RankError(r, tb)
    return RankError(getattr(exc, "error_index", -1),
                     f"{exc}\n(no rank reported an exception: the process died before or outside fn, e.g. it was "
                     "killed, or spawn could not re-import the parent's __main__, as for a script read from stdin; "
                     "see the rank's stderr above)")


def resolve_fn(spec: str) -> Callable:
    """``"package.module:function"`` -> the function."""
    if ":" not in spec:
        raise ValueError(f"fn={spec!r} must be 'module:function', e.g. 'labkit.experiments.parallelism:tp_demo'")
    mod, name = spec.split(":", 1)
    return getattr(importlib.import_module(mod), name)


def main(argv: list[str] | None = None) -> None:
    """``torchrun ... -m labkit.parallel.launch module:function [--backend B]``: run ``fn`` on this rank."""
    ap = argparse.ArgumentParser(description="run a labkit rank function under torchrun")
    ap.add_argument("fn", help="module:function taking (rank, world_size)")
    ap.add_argument("--backend", default=None, choices=BACKENDS)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per CPU rank")
    a = ap.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("RANK is not set: start this module with torchrun (see labkit.parallel.launch's docstring)")
    backend = a.backend or default_backend()
    rank, world = init_rank(backend, a.threads)
    try:
        result = resolve_fn(a.fn)(rank, world)
        if rank == 0:
            print(result)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
