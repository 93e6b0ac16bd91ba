"""The quantised matmuls' launch parameters as data: one frozen dataclass per choice, a table per device.

``tuning_for(device)`` picks the table: ``HOPPER`` on CUDA (measured on the H200; every CUDA device takes it) and
``INTERPRETER`` on the CPU (small tiles that Triton's interpreter runs quickly, no autotuning). Every public matmul
takes ``tuning=`` to use another (tests, studies); nothing here is a module-level switch. ``stationary_plan``
turns a table's rule into the launch of one ``[N, K]`` stationary GEMV. The split-K GEMVs and the GEMMs autotune on
CUDA over ``SPLITK_CANDIDATES`` and ``GEMM_CANDIDATES`` (once per shape, on the first call: a warm-up before CUDA-graph
capture). The measurements behind each choice: research/README.md (``gemv_study.py``, ``autotune_report.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.kernels.common import next_pow2, num_sms


@dataclass(frozen=True)
class SplitKTile:
    """A fixed launch of a split-K GEMV (``splitk.py``) instead of the autotuner's pick: ``block_n`` rows a program,
    ``block_k`` weights a step (int4: raised to the group), ``split_k`` programs along K (1 to 16), ``load_stages``
    (1: plain loads; 3: pipelined through shared memory on CUDA), ``prefetch`` (int4, whole steps: the next step's
    loads issued a step ahead), ``num_warps``."""

    block_n: int = 16
    block_k: int = 64
    split_k: int = 1
    load_stages: int = 1
    prefetch: bool = False
    num_warps: int = 4


@dataclass(frozen=True)
class GemmTile:
    """A fixed launch of the Tensor-Core GEMMs (``gemm.py``) instead of the autotuner's pick (int4 with power-of-two
    groups narrows ``block_k`` to the group)."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 32
    group_m: int = 4
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class StationaryTile:
    """One tile of the stationary GEMVs: ``block_n`` rows a step, ``block_k`` activations a slice (None: all of K,
    one slice; int4 raises it to the group), ``num_warps``, and ``row_steps`` (row blocks a program, a power of
    two; None: the rule of ``StationaryRule`` picks)."""

    block_n: int
    block_k: int | None = None
    num_warps: int = 2
    row_steps: int | None = None


@dataclass(frozen=True)
class StationaryRule:
    """How one weight format's stationary GEMV picks its tile for ``[N, K]``: ``whole_k`` (programs that own all
    of K) where ``K <= whole_k_max_k`` is a power-of-two number of groups (int4) or words (int8), ``N <=
    whole_k_max_n`` and no RMSNorm is in the prologue, else ``split``; row blocks a program from ``warps_per_sm``
    (whole-K) or ``split_warps_per_sm`` (slices of K); at most ``max_slices`` slices; the last program of a row
    chunk sums the slices' partials ``reduce_floats`` floats at a time."""

    split: StationaryTile
    whole_k: StationaryTile | None = None
    whole_k_max_k: int = 4096
    whole_k_max_n: int = 8192
    warps_per_sm: int = 11
    split_warps_per_sm: int = 22
    max_slices: int = 256
    reduce_floats: int = 4096  # float32 partials per reduction tile of the last program (64 registers a thread)


@dataclass(frozen=True)
class QuantTuning:
    """Everything a quantised matmul call may be told about its launches. ``w4_stationary`` / ``w8_stationary``:
    the stationary GEMVs' rules; ``w8_splitk`` / ``w4_splitk`` and ``gemm``: fixed tiles, or None for the
    autotuner (CUDA only: the interpreter needs fixed tiles); ``sms``: the SM count the row-step rule divides by
    (None: the device's)."""

    w4_stationary: StationaryRule
    w8_stationary: StationaryRule
    w8_splitk: SplitKTile | None = None
    w4_splitk: SplitKTile | None = None
    gemm: GemmTile | None = None
    sms: int | None = None


HOPPER = QuantTuning(
    w4_stationary=StationaryRule(split=StationaryTile(16, 512, 2), whole_k=StationaryTile(4, None, 4)),
    w8_stationary=StationaryRule(split=StationaryTile(8, 512, 2), whole_k=StationaryTile(2, None, 4)))
INTERPRETER = QuantTuning(
    w4_stationary=StationaryRule(split=StationaryTile(8, 128, 1)),
    w8_stationary=StationaryRule(split=StationaryTile(8, 128, 1)),
    w8_splitk=SplitKTile(16, 64), w4_splitk=SplitKTile(16, 64), gemm=GemmTile())


def tuning_for(device: torch.device) -> QuantTuning:
    """The table for ``device``: ``HOPPER`` on CUDA, ``INTERPRETER`` elsewhere."""
    return HOPPER if torch.device(device).type == "cuda" else INTERPRETER


def check_tuning(tuning) -> QuantTuning:
    if not isinstance(tuning, QuantTuning):
        raise TypeError(f"tuning must be a QuantTuning (or None for the device's table), got {type(tuning).__name__}")
    return tuning


# --- autotuner candidates (CUDA) -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitKCandidates:
    """What the split-K GEMVs' autotuners try: tiles ``(block_n, block_k, warps)`` x ``splits`` x ``load_stages``
    (int4 also plain loads prefetched a step ahead), a split only while the grid stays under ``max_ctas_per_sm``
    programs per SM; no register cap (research/README.md, ``gemv_study.py``)."""

    w8_tiles: tuple = ((16, 256, 2), (32, 256, 4), (64, 256, 4), (16, 512, 4), (8, 1024, 4), (16, 1024, 4),
                       (8, 2048, 4), (16, 2048, 8))
    w4_tiles: tuple = ((16, 512, 2), (16, 1024, 4), (8, 2048, 4), (64, 128, 2), (256, 128, 4))
    splits: tuple = (1, 2, 4, 8, 16)
    load_stages: tuple = (1, 3)
    max_ctas_per_sm: int = 8  # the best split measured stayed under it (research/README.md)


SPLITK_CANDIDATES = SplitKCandidates()
# (block_m, block_n, block_k, warps, stages) of the GEMMs' autotuner; GROUP_M 8
GEMM_CANDIDATES = ((16, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
                   (128, 256, 64, 8, 3))


# --- the stationary GEMVs' launch --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StationaryPlan:
    """One stationary GEMV launch: ``block_n`` rows a step, ``block_k`` activations a slice, ``row_steps`` row
    blocks a program, the slice count padded to ``split_p2`` (1: each program owns all of K), the reduction's
    ``red_rows`` rows at a time, ``num_warps``, and ``pair_words`` (int4: two words per float16 lane pair)."""

    block_n: int
    block_k: int
    row_steps: int
    split_p2: int
    red_rows: int
    num_warps: int
    pair_words: bool = False

    def meta(self, bits: int) -> dict:
        """The kernel's tile constexprs (int4 also ``PAIR_WORDS``)."""
        meta = dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, ROW_STEPS=self.row_steps, SPLIT_P2=self.split_p2,
                    RED_ROWS=self.red_rows)
        return meta | ({"PAIR_WORDS": self.pair_words} if bits == 4 else {})


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def stationary_plan(n: int, k: int, unit: int, rule: StationaryRule, sms: int, norm: bool = False,
                    pair_words: bool = False) -> StationaryPlan | None:
    """The stationary GEMV's launch for ``[N, K]`` weights whose slices hold a power-of-two number of ``unit``
    weights (int4: the group; int8: a 4-byte word), or None where its whole tiles do not fit (another kernel takes
    those). ``norm``: the RMSNorm in the prologue (the split tile); ``sms``: the SM count the row-step rule fills;
    ``pair_words``: the int4 kernel's word pairs."""
    whole = rule.whole_k
    if whole is not None and not norm and k <= rule.whole_k_max_k and k % unit == 0 and _pow2(k // unit) \
            and n <= rule.whole_k_max_n and n % whole.block_n == 0:
        tile = whole
    else:
        tile = rule.split
    bn, bk = tile.block_n, max(tile.block_k or k, unit)
    if bk % unit or not _pow2(bk // unit):
        raise ValueError(f"block_k={bk} must hold a power-of-two number of {unit}-weight "
                         f"{'groups' if unit > 4 else 'words'}")
    if n % bn or k % bk or k // bk > rule.max_slices:
        return None
    slices = k // bk
    target = (rule.warps_per_sm if slices == 1 else rule.split_warps_per_sm) * sms
    steps = tile.row_steps or max([s for s in (1, 2, 4, 8, 16, 32) if n % (bn * s) == 0 and
                                   slices * (n // (bn * s)) * tile.num_warps >= target] or [1])
    if not _pow2(steps):
        raise ValueError(f"row_steps={steps} must be a power of two")
    if n % (bn * steps):
        return None
    split_p2 = next_pow2(slices)
    return StationaryPlan(bn, bk, steps, split_p2, min(bn * steps, max(1, rule.reduce_floats // split_p2)),
                          tile.num_warps, pair_words)


def sms_of(tuning: QuantTuning, device: torch.device) -> int:
    """The SM count ``tuning`` fills: its own, or the device's."""
    return tuning.sms or num_sms(device)
