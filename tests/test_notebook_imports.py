"""Every labkit name a notebook imports exists, on every branch: a cell that runs only under the gpu profile (or
only on CUDA) is never executed by CI, so an import there of a module that was moved or deleted would first fail on
a GPU. Scripts and research files are checked the same way."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("notebooks/src", "scripts", "research") for p in sorted((ROOT / d).glob("*.py"))]


def _labkit_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "labkit" or node.module.startswith("labkit.")):
            for alias in node.names:
                yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("labkit"):
                    yield node.lineno, alias.name, None


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_labkit_import_resolves(path):
    missing = []
    for line, module, name in _labkit_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: import {module}: {e}")
            continue
        if name and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{path.name}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)
