"""Notebook 06 (parallelism): a column-parallel and a row-parallel linear layer, with ranks simulated in one process.

The learner's functions take the full weight and the tensor-parallel size ``tp`` and return what each rank holds
(a list indexed by rank), so the checker sees the sharding itself, not only the final sum. The all-reduce of a
row-parallel layer is simulated by summing the ranks' partial outputs. The real layers, on ``torch.distributed``,
are labkit's ``ColumnParallelLinear`` and ``RowParallelLinear``; the solutions follow them and use their
``shard_range``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.exercises.core import Case, Exercise, diff, register
from labkit.parallel.tensor_parallel import shard_range


def column_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int) -> list[torch.Tensor]:
    """Solution: rank ``r``'s output ``[..., out / tp]`` (its rows of ``weight`` [out, in] and of ``bias``) from the
    full input ``x`` [..., in]; returns the ``tp`` outputs by rank."""
    outs = []
    for r in range(tp):
        rows = shard_range(weight.shape[0], tp, r, "out_features")
        outs.append(F.linear(x, weight[rows], None if bias is None else bias[rows]))
    return outs


def row_parallel(x_shards: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None,
                 tp: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Solution: rank ``r`` multiplies its input slice ``x_shards[r]`` [..., in / tp] by its columns of ``weight``
    [out, in]; returns ``(partials by rank, all-reduced output + bias)``; the bias is added once, after the sum."""
    partials = []
    for r in range(tp):
        cols = shard_range(weight.shape[1], tp, r, "in_features")
        partials.append(F.linear(x_shards[r], weight[:, cols]))
    y = torch.stack(partials).sum(0)
    return partials, (y if bias is None else y + bias)


SHAPES = [((3, 12), 8, 2, True), ((5, 16), 24, 4, True), ((2, 3, 20), 12, 4, False), ((1, 30), 45, 3, True),
          ((7, 64), 128, 8, True), ((4, 10), 10, 1, True)]


def _tensors(lead_in, out, bias, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead_in, generator=g, dtype=torch.float64)
    w = torch.randn(out, lead_in[-1], generator=g, dtype=torch.float64) * scale
    b = torch.randn(out, generator=g, dtype=torch.float64) if bias else None
    return x, w, b


def _col_cases() -> list[Case]:
    return [Case(f"x {list(s)}, weight [{o}, {s[-1]}], bias {'yes' if b else 'no'}, tp={tp}", (s, o, tp, b))
            for s, o, tp, b in SHAPES]


def _run_col(fn, data):
    s, o, tp, b = data
    x, w, bias = _tensors(s, o, b, sum(s) + o)
    return list(fn(x, w, bias, tp))


def _compare_ranks(expected, actual):
    if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
        n = len(actual) if isinstance(actual, (list, tuple)) else type(actual).__name__
        return f"expected one output per rank ({len(expected)}), got {n}"
    for r, (e, a) in enumerate(zip(expected, actual)):
        d = diff(e, a, path=f"rank {r}")
        if d:
            return d
    return None


register(Exercise(
    "06.column_parallel", "column-parallel linear: each rank computes its slice of the output", column_parallel,
    _col_cases, _run_col, _compare_ranks,
    hint="rank r keeps rows r*out/tp .. (r+1)*out/tp - 1 of weight [out, in] and the same slice of the bias"))


def _row_cases() -> list[Case]:
    return [Case(f"x {list(s[:-1]) + [o]} split {tp} ways along the last dim, weight [{s[-1]}, {o}], "
                 f"bias {'yes' if b else 'no'}, tp={tp}", (s, o, tp, b)) for s, o, tp, b in SHAPES]


def _run_row(fn, data):
    s, o, tp, b = data
    # the row-parallel layer reads the column-parallel layer's outputs: input width o, output width s[-1]
    x, w, bias = _tensors((*s[:-1], o), s[-1], b, sum(s) * 3 + o)
    x_shards = list(x.chunk(tp, dim=-1))
    partials, y = fn(x_shards, w, bias, tp)
    return {"partial outputs by rank": list(partials), "output after the all-reduce": y}


register(Exercise(
    "06.row_parallel", "row-parallel linear: partial products summed by an all-reduce, bias added once",
    row_parallel, _row_cases, _run_row,
    hint="rank r multiplies x_shards[r] by columns r*in/tp .. (r+1)*in/tp - 1 of weight; the partials carry no "
         "bias; add the bias once after summing, not once per rank"))
