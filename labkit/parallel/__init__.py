"""Tensor and pipeline parallelism on torch.distributed: launch, TP layers, the DTensor plan, pipeline stages and
schedules, the collectives the TP layers issue (``comm``) and the analytical cost model (``cost_model``). Start with
``launch`` (runs a rank function on N processes); what notebook 06 measures with these is in
``labkit.experiments.parallelism``.

    from labkit.parallel import launch
    results = launch(fn, 2, *args, backend="gloo")       # one result per rank; fn importable by name
"""

from labkit.parallel import comm, cost_model
from labkit.parallel.dtensor_plan import check_dtensor_tp_size, dtensor_tensor_parallel, llama_tp_plan
from labkit.parallel.launch import (
    RankError,
    check_backend,
    default_backend,
    free_port,
    init_rank,
    launch,
    rank_device,
    resolve_fn,
)
from labkit.parallel.pipeline import (
    LlamaStage,
    StageKVCache,
    build_stage,
    head_cost_layers,
    partition_layers,
    pipeline_generate,
    sync_tied_embeddings,
)
from labkit.parallel.schedules import (
    SCHEDULES,
    bubble_formula,
    gpipe_forward,
    pipeline_train_step,
    torch_pipelining_forward,
)
from labkit.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allowed_tp_sizes,
    check_tp_size,
    head_rows,
    shard_range,
    tensor_parallel,
)

__all__ = ["comm", "cost_model", "launch", "RankError", "rank_device", "init_rank", "default_backend",
           "check_backend", "free_port", "resolve_fn", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "tensor_parallel", "allowed_tp_sizes", "check_tp_size", "head_rows",
           "shard_range", "dtensor_tensor_parallel", "llama_tp_plan", "check_dtensor_tp_size",
           "LlamaStage", "StageKVCache", "build_stage", "partition_layers", "head_cost_layers", "pipeline_generate",
           "sync_tied_embeddings", "SCHEDULES", "bubble_formula", "gpipe_forward",
           "pipeline_train_step", "torch_pipelining_forward"]
