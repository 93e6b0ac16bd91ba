"""Rules of the house (issue 41), checked on the source with ``ast``:

* no test assigns to an attribute of labkit: no ``monkeypatch.setattr`` at all, no ``setattr`` / ``setitem`` /
  ``delattr`` / ``delitem`` of a monkeypatch (or its ``context()``) on anything but the third-party objects of
  ``THIRD_PARTY_PATCHES``, no ``mock.patch``, no assignment to an attribute or item of a name imported from labkit.
  Tests observe through public seams instead: arguments (``run_workbook(execute=)``, ``show(display=)``,
  ``claims --summary``), environment variables (``LABKIT_SUMMARY``), subclasses, and the kernel log
  (``labkit.kernels.common.KernelLog``: ``log=`` of the quantised matmuls, ``ModelRunner(kernel_log=)``,
  ``KernelChoice.log``);
* the product packages hold no module-global mutable state: a module-level dict, list or set is a constant, an
  UPPER_CASE name that nothing in the product packages mutates (no item assignment, no mutating method), besides
  the few of ``MUTABLE_STATE``; no ``global`` statement;
* the product packages import no clock, save the engine's request clock.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PRODUCT = ("model", "engine", "kvcache", "kernels", "quant", "parallel")

THIRD_PARTY_PATCHES = {
    # the CPU stand-in for a CUDA graph records Triton's interpreted launches and refuses host reads inside a step
    ("test_engine_cuda_graph.py", "interp.GridExecutor"),
    ("test_engine_cuda_graph.py", "torch.Tensor"),
}
"""(test file, the patched object's expression): patches of third-party objects, where no labkit seam can help."""

MUTABLE_STATE = {
    # the split GEMVs' device workspace: one per device, shared by every launch, kept while a captured CUDA graph
    # points at it (made before capture, grown never during one)
    ("kernels/quantized_matmul/splitk.py", "_SPLIT_BUFFERS"),
    ("kernels/quantized_matmul/splitk.py", "_RETIRED_BUFFERS"),
    # gemlite's process-wide autotune setting, set once (gemlite.set_autotune is global in gemlite itself)
    ("quant/peers.py", "GEMLITE_SETUP"),
}
"""(product file, name): module-global state that is state by nature, each with its reason."""

CLOCKS = {"engine/llm_engine.py"}
"""Product files that may import ``time``: the engine's request timestamps (TTFT, TPOT), its one clock."""

MUTATING = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add", "discard",
            "popitem", "sort", "reverse", "__setitem__", "__delitem__"}


def _tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def _product() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / "labkit" / pkg).rglob("*.py"))


def _labkit_names(tree: ast.Module) -> set[str]:
    """Names a test binds to labkit modules or objects (``import labkit.x as y``, ``from labkit.x import y``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] == "labkit"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit":
            names |= {a.asname or a.name for a in node.names}
    return names


def _base(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _patchers(tree: ast.Module) -> set[str]:
    """``monkeypatch`` and the names ``with monkeypatch.context() as m`` binds."""
    names = {"monkeypatch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name) and \
                "monkeypatch.context" in ast.unparse(node.context_expr):
            names.add(node.optional_vars.id)
    return names


def test_no_test_patches_labkit():
    bad = []
    for path in _tests():
        text = path.read_text()
        tree = ast.parse(text)
        labkit, patchers = _labkit_names(tree), _patchers(tree)
        where = lambda node, path=path: f"{path.name}:{node.lineno}: {ast.unparse(node)[:100]}"  # noqa: E731
        if "monkeypatch.setattr(" in text:
            bad.append(f"{path.name}: monkeypatch.setattr(")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                if f.attr in ("setattr", "setitem", "delattr", "delitem") and _base(f.value) in patchers:
                    target = ast.unparse(node.args[0]) if node.args else ""
                    if (path.name, target) not in THIRD_PARTY_PATCHES:
                        bad.append(where(node))
                if f.attr == "patch" and "mock" in ast.unparse(f.value):
                    bad.append(where(node))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr",
                                                                                                 "delattr"):
                if node.args and _base(node.args[0]) in labkit:
                    bad.append(where(node))
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and _base(t) in labkit:
                    bad.append(where(node))
    assert not bad, "tests that patch labkit (use a public seam):\n" + "\n".join(bad)


def _module_containers(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to a dict, list or set (a literal, a comprehension or a constructor call)."""
    out = {}
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        v = node.value
        call = isinstance(v, ast.Call) and (getattr(v.func, "id", None) or getattr(v.func, "attr", None))
        if isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or \
                call in ("dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name) and t.id != "__all__":
                    out[t.id] = node.lineno
    return out


def _mutated(trees: list[ast.Module]) -> set[str]:
    """Names that some product code mutates in place: ``NAME[k] = v``, ``del NAME[k]``, ``NAME.update(...)``, ..."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                [node.target] if isinstance(node, ast.AugAssign) else []
            names |= {t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING \
                    and isinstance(node.func.value, ast.Name):
                names.add(node.func.value.id)
    return names


def test_product_packages_hold_no_module_global_mutable_state():
    trees = {p: ast.parse(p.read_text()) for p in _product()}
    mutated = _mutated(list(trees.values()))
    bad = []
    for path, tree in trees.items():
        rel = path.relative_to(ROOT / "labkit").as_posix()
        bad += [f"{rel}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
        for name, line in _module_containers(tree).items():
            if (rel, name) in MUTABLE_STATE:
                continue
            if not name.lstrip("_").isupper() or name in mutated:
                bad.append(f"{rel}:{line}: {name} (module-level, {'mutated' if name in mutated else 'not a constant'})")
    assert not bad, "module-global mutable state in the product packages:\n" + "\n".join(bad)
    assert all((ROOT / "labkit" / f).exists() and n in _module_containers(ast.parse((ROOT / "labkit" / f)
                                                                                       .read_text()))
               for f, n in MUTABLE_STATE), "an entry of MUTABLE_STATE is gone: drop it"


def test_product_packages_import_no_clock_but_the_request_clock():
    bad = []
    for path in _product():
        rel = path.relative_to(ROOT / "labkit").as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            clock = isinstance(node, ast.Import) and any(a.name == "time" for a in node.names) or \
                isinstance(node, ast.ImportFrom) and node.module == "time"
            if clock and rel not in CLOCKS:
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "clocks in the product packages (measurement belongs to labkit.bench):\n" + "\n".join(bad)


def test_the_rules_see_what_they_forbid(tmp_path):
    """The walkers find what they look for (a rule that sees nothing passes for nothing)."""
    tree = ast.parse("import labkit.model as m\nfrom labkit.kvcache import quant\nm.X = 1\nquant.KV[1] = 2\n"
                     "with monkeypatch.context() as mp:\n    mp.setattr(m, 'y', 3)\n")
    assert _labkit_names(tree) == {"m", "quant"} and _patchers(tree) == {"monkeypatch", "mp"}
    tree = ast.parse("A = {}\n_B = [1]\nc = set()\nD: dict = dict()\n__all__ = []\ndef f():\n    A['k'] = 1\n"
                     "    _B.append(2)\n")
    assert _module_containers(tree) == {"A": 1, "_B": 2, "c": 3, "D": 4} and _mutated([tree]) == {"A", "_B"}
    assert importlib.util.find_spec("labkit.kernels.common") is not None
