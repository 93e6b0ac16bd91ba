"""The layering of labkit, checked on its import graph (read with ``ast``, every ``import`` at module level and
inside functions alike, since a lazy import is still a dependency):

* no cycle between packages: ``labkit.engine``, ``kvcache``, ``quant``, ``kernels``, ``parallel``, ``finetune``,
  ``model``, ``experiments`` and each top-level module (``labkit.plan``, ``labkit.bench``, ...) are the nodes;
* no cycle between files;
* product code never imports ``labkit.experiments`` (the measurements of the notebooks sit on top of the product,
  never under it).
"""

import ast
from pathlib import Path

import pytest

LABKIT = Path(__file__).resolve().parent.parent / "labkit"

# Edges tolerated against the layering while a move is under way (none now); ``test_allowances_are_still_needed``
# fails on an entry that no longer exists.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in LABKIT.rglob("*.py"):
        parts = list(path.relative_to(LABKIT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (``labkit.kvcache.PagedKVCache`` -> ``labkit.kvcache``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(allowed: frozenset | set = frozenset()) -> dict[str, set[str]]:
    """``{module: modules of labkit it imports}``, leaving out the ``allowed`` edges. ``from pkg import name`` is an
    edge to ``pkg.name`` where that is a module, else to ``pkg``."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {_resolve(a.name, mods) for a in node.names if a.name.split(".")[0] == "labkit"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                if base.split(".")[0] != "labkit":
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods else _resolve(base, mods))
        targets.discard(None)
        targets.discard(mod)
        graph[mod] = {t for t in targets if (mod, t) not in allowed}
    return graph


def package_of(mod: str) -> str:
    """``labkit.engine.scheduler`` -> ``labkit.engine``; a top-level module (``labkit.plan``) is its own node."""
    parts = mod.split(".")
    if len(parts) >= 2 and (LABKIT / parts[1]).is_dir():
        return ".".join(parts[:2])
    return mod


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _why(graph: dict[str, set[str]], comp: list[str], node=lambda m: m) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if node(m) in comp and node(t) in comp
                  and node(m) != node(t))


@pytest.fixture(scope="module")
def graph():
    return import_graph(ALLOWED)


def test_the_graph_sees_lazy_imports(graph):
    # a function-level import (labkit.kvcache.attention imports the Triton kernel only when asked for it)
    assert "labkit.kernels.paged_attention" in graph["labkit.kvcache.attention"]
    assert "labkit.engine.scheduler" in graph and "labkit.kvcache" in graph["labkit.engine.scheduler"]


def test_no_cycle_between_packages(graph):
    packages: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        packages.setdefault(package_of(mod), set()).update(package_of(t) for t in targets)
    for pkg, targets in packages.items():
        targets.discard(pkg)
    found = cycles(packages)
    assert not found, "package cycles:\n" + "\n".join(
        f"{comp}: {_why(graph, comp, package_of)}" for comp in found)


def test_no_cycle_between_files(graph):
    found = cycles(graph)
    assert not found, "file cycles:\n" + "\n".join(f"{comp}: {_why(graph, comp)}" for comp in found)


def test_product_code_never_imports_the_experiments(graph):
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                 if t.startswith("labkit.experiments") and not m.startswith("labkit.experiments"))
    assert not bad, f"product modules importing labkit.experiments: {bad}"


def test_allowances_are_still_needed():
    """An allowed edge that no longer exists must leave ``ALLOWED`` (its branch has landed)."""
    real = import_graph()
    stale = sorted(f"{a} -> {b}" for a, b in ALLOWED if b not in real.get(a, set()))
    assert not stale, f"these edges are gone: remove them from ALLOWED in {Path(__file__).name}: {stale}"


PRODUCT = ("model", "engine", "kvcache", "kernels", "quant", "parallel")
MAX_STEP_FILES = 16  # nano-vllm's decode step touches 14 files


def test_a_bf16_decode_step_touches_at_most_16_product_files():
    """The files of the product packages a bf16 decode step enters (``LLMEngine.step`` traced with
    ``sys.setprofile`` on the CPU): a reader follows a step through at most ``MAX_STEP_FILES`` of them."""
    import sys

    import torch

    from labkit.engine import LLMEngine, SamplingParams
    from labkit.model import ModelConfig, from_config

    cfg = ModelConfig(name="micro", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, max_position_embeddings=64)
    engine = LLMEngine(from_config(cfg, dtype=torch.bfloat16), num_blocks=16, block_size=4, max_num_seqs=2)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill; the next step decodes
    roots = tuple(str(LABKIT / p) + "/" for p in PRODUCT)
    files: set[str] = set()

    def profile(frame, event, arg):
        if frame.f_code.co_filename.startswith(roots):
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        out = engine.step()
    finally:
        sys.setprofile(None)
    assert len(out) == 1 and engine.stats.decode_tokens == 1
    names = sorted(Path(f).relative_to(LABKIT).as_posix() for f in files)
    assert "model/layers.py" in names and "engine/scheduler.py" in names, names  # the trace sees the step
    assert len(names) <= MAX_STEP_FILES, names
