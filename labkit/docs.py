"""The API page: ``docs/api.md``, generated from the docstrings of what each labkit package exports.

    python -m labkit docs            # write docs/api.md
    python -m labkit docs --check    # exit 1 if docs/api.md is not what the docstrings give now

Per package (``PACKAGES``): the first paragraph of its docstring, an example (the first fenced or indented block of
its docstring; without one, the import of its exports), then each name of its ``__all__`` with its signature and the
first paragraph of its docstring. Functions, classes and modules carry their docstring; a constant is documented
by a string literal on the line after its assignment (an attribute docstring), read here from the source of the
module that assigns it. A package that does not exist yet, or exports nothing, gets a line saying so.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from labkit.data import REPO_ROOT

PACKAGES = ("labkit.model", "labkit.kernels", "labkit.kvcache", "labkit.quant", "labkit.engine", "labkit.parallel",
            "labkit.finetune", "labkit.plan", "labkit.roofline", "labkit.profiling", "labkit.bench", "labkit.hardware",
            "labkit.data", "labkit.checks", "labkit.exercises")
API_PAGE = REPO_ROOT / "docs" / "api.md"
REGENERATE = "python -m labkit docs"
_WIDTH = 116
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object reprs in defaults: keep the page the same from run to run
_SHELL = ("python ", "python3 ", "pip ", "torchrun ", "$ ")


@dataclass
class Entry:
    """One exported name: its signature line and docstring (``None`` when it has none)."""

    name: str
    signature: str
    doc: str | None
    problem: str | None = None  # why the name fails the docstring check


@dataclass
class Package:
    """What the page shows of one package or module; ``skipped`` says why it lists no names."""

    name: str
    doc: str = ""
    example: tuple[str, str] | None = None  # (language, code)
    entries: list[Entry] = field(default_factory=list)
    skipped: str | None = None


def first_paragraph(doc: str) -> str:
    """The first paragraph of a docstring, its lines joined into one."""
    para = re.split(r"\n[ \t]*\n", inspect.cleandoc(doc).strip(), maxsplit=1)[0]
    return " ".join(line.strip() for line in para.splitlines())


def example(doc: str) -> tuple[str, str] | None:
    """``(language, code)`` of the first fenced or indented (4+ spaces, after a blank line) block of ``doc``."""
    doc = inspect.cleandoc(doc)
    fenced = re.search(r"^```(\w*)[ \t]*\n(.*?)^```", doc, re.M | re.S)
    block: list[str] = []
    start = None  # line of the indented block's first line
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if block and line.strip() and not line.startswith("    "):
            break
        if block or (line.startswith("    ") and line.strip() and i > 0 and not lines[i - 1].strip()):
            start = i if start is None else start
            block.append(line)
    if fenced and (start is None or doc[:fenced.start()].count("\n") < start):
        code = fenced.group(2).rstrip()
        return (fenced.group(1) or _language(code)), code
    if not block:
        return None
    code = textwrap.dedent("\n".join(block)).rstrip()
    return _language(code), code


def _language(code: str) -> str:
    return "bash" if all(ln.lstrip().startswith(_SHELL) for ln in code.splitlines() if ln.strip()) else "python"


class _Shown(str):
    """An annotation kept as a string (``from __future__ import annotations``), shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def signature(obj, name: str) -> str:
    """``name(params) -> ret`` for a callable, ``class name(params)`` for a class, ``name: type`` for a value."""
    if inspect.ismodule(obj):
        return f"module {obj.__name__}"
    if not callable(obj):
        return f"{name}: {type(obj).__name__}"
    prefix = "class " if inspect.isclass(obj) else ""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins and classes without an __init__ of their own
        return prefix + name if prefix else f"{name}(...)"
    params = [p.replace(annotation=_Shown(p.annotation)) if isinstance(p.annotation, str) else p
              for p in sig.parameters.values()]
    ret = sig.return_annotation
    ret = inspect.Signature.empty if prefix else (_Shown(ret) if isinstance(ret, str) else ret)
    text = _ADDRESS.sub("", str(sig.replace(parameters=params, return_annotation=ret)))
    # a default under the checkout reads the same in every clone: PosixPath('<repo>/x') -> REPO_ROOT / 'x'
    text = re.sub(rf"\w*Path\('{re.escape(str(REPO_ROOT))}/([^']*)'\)", r"REPO_ROOT / '\1'", text)
    return _wrap(prefix + name, text)


def _wrap(head: str, sig: str) -> str:
    """``head(params) -> ret`` on one line, or one parameter a line where that is longer than the page."""
    if len(head + sig) <= _WIDTH:
        return head + sig
    params, depth, quote, cur, end = [], 0, None, "", len(sig)
    for i, ch in enumerate(sig[1:], 1):  # split at commas between parameters, not inside brackets or strings
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:  # the parenthesis that closes the parameters
                end = i
                break
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
            continue
        cur += ch
    params.append(cur.strip())
    return head + "(\n" + "".join(f"    {p},\n" for p in params if p) + ")" + sig[end + 1:]


def docstring(obj, name: str, module: ModuleType) -> str | None:
    """The docstring of ``module.name`` (``obj``), or ``None``: a class's own (not inherited, not the one
    ``dataclass`` writes), a function's or module's, or for a value its attribute docstring in the source."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if dataclasses.is_dataclass(obj) and doc and doc.startswith(obj.__name__ + "("):
            doc = None
    elif inspect.ismodule(obj) or inspect.isroutine(obj):
        doc = obj.__doc__
    else:
        doc = getattr(obj, "__doc__", None)
        if doc == type(obj).__doc__:  # an instance shows its class's docstring, which documents the class
            doc = attribute_doc(module, name)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def attribute_doc(module: ModuleType, name: str, depth: int = 3) -> str | None:
    """The string literal after ``name = ...`` in ``module``'s source, following ``from X import name`` into X."""
    path = getattr(module, "__file__", None)
    if depth == 0 or not path or not path.endswith(".py"):
        return None
    body = ast.parse(Path(path).read_text()).body
    for stmt, nxt in zip(body, body[1:] + [None]):
        targets = (stmt.targets if isinstance(stmt, ast.Assign) else
                   [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                return nxt.value.value
            return None
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    source = importlib.util.resolve_name("." * stmt.level + (stmt.module or ""), module.__package__)
                    return attribute_doc(importlib.import_module(source), alias.name, depth - 1)
    return None


def _import(name: str) -> ModuleType | None:
    """The module, or ``None`` if it does not exist (an import error inside an existing module is raised)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise


def collect_package(name: str) -> Package:
    """What the page shows of the package or module ``name``."""
    module = _import(name)
    if module is None:
        return Package(name, skipped=f"`{name}` does not exist yet.")
    doc = inspect.cleandoc(module.__doc__ or "")
    pkg = Package(name, doc=first_paragraph(doc) if doc else "")
    exported = getattr(module, "__all__", None)
    if not exported:
        pkg.skipped = f"`{name}` exports nothing yet (no names in `__all__`)."
        return pkg
    for n in exported:
        if not hasattr(module, n) and hasattr(module, "__path__"):
            _import(f"{name}.{n}")  # a submodule named in __all__ (``from package import *`` imports it too)
        if not hasattr(module, n):
            pkg.entries.append(Entry(n, n, None, problem="in __all__ but not defined"))
            continue
        obj = getattr(module, n)
        d = docstring(obj, n, module)
        pkg.entries.append(Entry(n, signature(obj, n), d, problem=None if d else "no docstring"))
    pkg.example = example(doc) or ("python", _import_line(name, list(exported)))
    return pkg


def _import_line(module: str, names: list[str]) -> str:
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= _WIDTH:
        return line
    body = textwrap.fill(", ".join(names), _WIDTH - 4, initial_indent="    ", subsequent_indent="    ")
    return f"from {module} import (\n{body},\n)"


def undocumented(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``package.name (why)`` for every exported name without a docstring."""
    return [f"{p.name}.{e.name} ({e.problem})" for p in map(collect_package, packages) for e in p.entries if e.problem]


def render_api_page(packages: tuple[str, ...] = PACKAGES) -> str:
    """The markdown of the API page."""
    pkgs = [collect_package(name) for name in packages]
    out = ["# labkit API", "",
           f"Generated by `{REGENERATE}` from the docstrings of the names each package exports (its `__all__`);",
           "edit the docstrings, not this page.", "",
           " | ".join(f"[{p.name}](#{p.name.replace('.', '')})" for p in pkgs), ""]
    for p in pkgs:
        out += [f"## {p.name}", ""]
        if p.doc:
            out += [textwrap.fill(p.doc, _WIDTH), ""]
        if p.skipped:
            out += [p.skipped, ""]
            continue
        lang, code = p.example
        out += [f"```{lang}", code, "```", ""]
        for e in p.entries:
            out += [f"### `{e.name}`", "", "```python", e.signature, "```", ""]
            text = first_paragraph(e.doc) if e.doc else f"*{e.problem.capitalize()}.*"
            out += [textwrap.fill(text, _WIDTH), ""]
    return "\n".join(out).rstrip() + "\n"


def write_api_page(path: Path | str = API_PAGE, check: bool = False) -> bool:
    """Write the page to ``path`` (with ``check``, only compare); returns whether the file was out of date."""
    path, text = Path(path), render_api_page()
    stale = not path.exists() or path.read_text() != text
    if stale and not check:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return stale
