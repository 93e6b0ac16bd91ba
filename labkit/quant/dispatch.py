"""One quantised linear, the best kernel per batch: which path multiplies a layer's weights at how many rows, from a
table measured on the machine it runs on.

A weight format's fastest kernel changes with the number of rows: labkit's GEMVs stream int4 weights at batch one
faster than anything else measured here, while at serving batches a tensor-core kernel built for more rows wins (see
``labkit.experiments.quantization.format_gemm`` and notebook 04). ``DispatchTable`` holds, per format, the measured
batches and the fastest path that the engine can run at each (labkit's own or a peer of ``labkit.quant.peers``); it is
data, ``results/<machine>/records/quant_dispatch.json``, written by the measurement on that machine. ``KernelChoice``
attaches it to one layer: the peer kernels it needs are built once, from the layer's own codes and scales, and
``kernel_for(x)`` returns the callable for ``x``'s rows (None: the layer's own kernel). A number of rows between
measured batches takes the path of the nearest measured batch (by ratio; a tie goes to the larger batch).

``use_dispatch(model, "measured")`` attaches the table of the machine the model is on to every labkit int8 / int4 /
FP8 layer; where no table was measured for that machine it says so and leaves labkit's own kernels (the fallback).
``quantize(model, method, dispatch=...)`` does the same as it quantises. The engine runs whatever the layers choose:
with a peer taking a step's rows, the decoder runs the unfused layer (norms, SwiGLU and RoPE as their own Triton
kernels around the peer GEMMs) instead of folding them into labkit's GEMVs.

A peer keeps its own copy of the weights in its packing beside labkit's: two kernels, two layouts. A deployment that
picks one kernel per format holds one.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from labkit.quant.peers import LABKIT_PATHS, PeerUnavailable, build_peer, engine_paths, layer_format

TABLE_NAME = "quant_dispatch"
"""Record name of a machine's table (``results/<machine>/records/quant_dispatch.json``)."""
DISPATCH_MODES = ("labkit", "measured")
"""``dispatch=`` names: labkit's own kernels at every batch, or the table measured on this machine."""


@dataclass(frozen=True)
class DispatchTable:
    """``paths``: per format, ``((batch, path), ...)`` ascending by batch: the fastest engine path measured at that
    batch. ``machine``: the device it was measured on; ``source``: the record it comes from."""

    paths: dict
    machine: str
    source: str = ""

    def __post_init__(self) -> None:
        for fmt, rows in self.paths.items():
            allowed = engine_paths(fmt)
            if not rows:
                raise ValueError(f"paths[{fmt!r}] is empty: a format with no measured batch has no table row")
            for b, p in rows:
                if not isinstance(b, int) or b < 1 or p not in allowed:
                    raise ValueError(f"paths[{fmt!r}] holds ({b!r}, {p!r}); need a batch >= 1 and one of {allowed}")

    def path_for(self, fmt: str, rows: int) -> str:
        """The path of ``fmt`` at ``rows`` rows: the table's at the nearest measured batch (ratio; ties larger), or
        labkit's own where the table has no row for ``fmt``."""
        table = self.paths.get(fmt)
        if not table:
            return LABKIT_PATHS[fmt]
        rows = max(1, int(rows))
        return min(table, key=lambda r: (abs(math.log(r[0] / rows)), -r[0]))[1]

    def to_dict(self) -> dict:
        return {"machine": self.machine, "source": self.source,
                "paths": {f: [{"batch": b, "path": p} for b, p in rows] for f, rows in self.paths.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> DispatchTable:
        paths = {f: tuple(sorted((int(r["batch"]), r["path"]) for r in rows)) for f, rows in d["paths"].items()}
        return cls(paths, d.get("machine", "?"), d.get("source", ""))


def table_from_rows(rows: list[dict], machine: str, source: str = "", preset: str | None = None) -> DispatchTable:
    """The table of a per-format GEMM measurement (``labkit.experiments.quantization.format_gemm`` rows: ``weights``,
    ``path``, ``batch``, ``us``, ``status``, ``preset``): at each batch, the fastest path that timed and that the
    engine can run. ``preset``: the layer shape to choose on (default the first measured)."""
    presets = list(dict.fromkeys(r.get("preset") for r in rows))
    preset = presets[0] if preset is None else preset
    best: dict[tuple[str, int], tuple[float, str]] = {}
    for r in rows:
        fmt = r["weights"]
        if r.get("preset") != preset or fmt not in LABKIT_PATHS or r.get("status", "ok") != "ok":
            continue
        if r["path"] not in engine_paths(fmt) or not (r["us"] == r["us"]):
            continue
        key = (fmt, int(r["batch"]))
        if key not in best or r["us"] < best[key][0]:
            best[key] = (r["us"], r["path"])
    paths: dict[str, list] = {}
    for (fmt, b), (_, p) in sorted(best.items()):
        paths.setdefault(fmt, []).append((b, p))
    return DispatchTable({f: tuple(v) for f, v in paths.items()}, machine, source)


def table_path(machine: str, root: Path | str | None = None) -> Path:
    """Where ``machine``'s table lives: ``results/<class>/records/quant_dispatch.json``."""
    from labkit.data import REPO_ROOT, machine_class

    root = Path(root) if root is not None else REPO_ROOT / "results"
    return root / machine_class(machine) / "records" / f"{TABLE_NAME}.json"


def load_table(device: torch.device | str | None = None, path: Path | str | None = None
               ) -> tuple[DispatchTable | None, str]:
    """(the table measured on ``device``'s machine, or None, and a sentence saying which and why). ``path``: a table
    record to read instead (a fresh measurement)."""
    if path is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cuda":
            return None, "no kernel table on the CPU: labkit's own kernels at every batch"
        name = torch.cuda.get_device_name(dev)
        path = table_path(name)
        if not path.exists():
            return None, (f"no kernel table measured on {name} ({path.name} absent under results/): labkit's own "
                          "kernels at every batch")
    path = Path(path)
    data = json.loads(path.read_text())
    table = DispatchTable.from_dict(data.get("data", data))
    return table, f"kernels by batch from {path} (measured on {table.machine})"


@dataclass(eq=False)
class KernelChoice:
    """A layer's kernel by number of rows: its format's ``table`` rows, the layer, and the peers built for it so far.

    A peer is built the first time its rows run (an eager call: the engine's warm-up before each CUDA-graph capture,
    the first step of ``generate``), so only layers that run hold a peer's weights (the separate q/k/v layers of an
    HF model whose merged q/k/v the engine runs never do); ``prepare`` builds them all now. Building one inside a
    CUDA-graph capture is refused with a clear error. A peer that cannot be built here leaves labkit's own kernel
    at its batches (``skipped`` says why, and a warning once). ``log``: a ``labkit.kernels.common.KernelLog`` each
    call through ``kernel_for`` records its path and rows in (op 'matmul'), or None."""

    fmt: str
    table: DispatchTable
    layer: nn.Module
    kernels: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    log: list | None = None

    @classmethod
    def build(cls, layer: nn.Module, table: DispatchTable, prepare: bool = False) -> KernelChoice:
        fmt = layer_format(layer)
        if fmt is None:
            raise ValueError(f"{type(layer).__name__} is not one of labkit's int8 / int4 / FP8 layers")
        choice = cls(fmt, table, layer)
        if prepare:
            choice.prepare()
        return choice

    def prepare(self) -> KernelChoice:
        """Build every peer the table names for this format now."""
        for _, name in self.table.paths.get(self.fmt, ()):
            self._kernel(name)
        return self

    def _kernel(self, name: str):
        if name == LABKIT_PATHS[self.fmt] or name in self.skipped:
            return None
        if name not in self.kernels:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{name} would be built inside a CUDA-graph capture: run one eager step of this "
                                   "batch first (the engine's capture does), or call KernelChoice.prepare()")
            try:
                self.kernels[name] = build_peer(name, self.layer)
            except PeerUnavailable as e:
                self.skipped[name] = str(e)
                warnings.warn(f"kernel table path {name} is not available here, labkit's kernel kept at its "
                              f"batches: {e}", stacklevel=3)
                return None
        return self.kernels[name]

    def planned(self, rows: int) -> str:
        """The table's path at ``rows`` rows (without building anything)."""
        return self.table.path_for(self.fmt, rows)

    def path_for(self, rows: int) -> str:
        """The path taken at ``rows`` rows: the table's, or labkit's own where its peer cannot be built here."""
        name = self.planned(rows)
        return name if self._kernel(name) is not None else LABKIT_PATHS[self.fmt]

    def takes(self, rows: int) -> bool:
        """Whether a peer (not the layer's own kernel) multiplies ``rows`` rows."""
        return self.path_for(rows) != LABKIT_PATHS[self.fmt]

    def kernel_for(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The peer for ``x`` ``[M, K]``'s rows, or None for the layer's own kernel."""
        kernel = self._kernel(self.planned(x.shape[0]))
        if self.log is not None:
            self.log.record("matmul", self.path_for(x.shape[0]), rows=x.shape[0])
        return kernel

    def for_layer(self, layer: nn.Module) -> KernelChoice:
        """The same table on another layer of the format (a merged q/k/v): its peers built from its weights."""
        return KernelChoice.build(layer, self.table)


def quantised_layers(model: nn.Module) -> dict[str, nn.Module]:
    """labkit's int8 / int4 / FP8 layers of ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if layer_format(m) is not None}


def resolve(dispatch, device: torch.device | str) -> tuple[DispatchTable | None, str]:
    """``dispatch`` ('labkit', 'measured', a ``DispatchTable`` or a path to a table record) as a table or None,
    with the sentence saying which."""
    if isinstance(dispatch, DispatchTable):
        return dispatch, f"kernels by batch from the given table (measured on {dispatch.machine})"
    if dispatch == "labkit":
        return None, "labkit's own kernels at every batch"
    if dispatch == "measured":
        return load_table(device)
    if isinstance(dispatch, (str, Path)) and Path(dispatch).suffix == ".json":
        if not Path(dispatch).exists():
            raise ValueError(f"dispatch={str(dispatch)!r}: no such table record")
        return load_table(path=dispatch)
    raise ValueError(f"dispatch={dispatch!r} is unknown; allowed: {list(DISPATCH_MODES)}, a DispatchTable or the "
                     "path of a quant_dispatch.json record")


def use_dispatch(model: nn.Module, dispatch="measured", quiet: bool = False) -> str:
    """Attach ``dispatch`` (``resolve``) to every labkit int8 / int4 / FP8 layer of ``model`` ('labkit' detaches:
    the layers' own kernels); returns the sentence saying what was attached, which is also printed unless ``quiet``.
    Peers are built when their rows first run (``KernelChoice``); one that cannot be built here is named in a
    warning, and its batches keep labkit's kernel."""
    layers = quantised_layers(model)
    device = next(model.parameters()).device
    table, why = resolve(dispatch, device)
    for lin in layers.values():
        lin.dispatch = None if table is None else KernelChoice.build(lin, table)
    if not quiet:
        print(why)
    return why
