"""One name per meaning: no two public functions of labkit share a name with different parameters, and no two public
classes share a name at all. Every module of every labkit package is walked (``labkit.experiments`` and
``labkit.exercises`` included): a name defined there without a leading underscore is public."""

import importlib
import inspect
import pkgutil
from collections import defaultdict

import labkit


def public_definitions() -> dict[str, list[tuple[str, str, tuple]]]:
    """``{name: [(module, 'function' | 'class', parameter names)]}`` of every public function and class, where it
    is defined (re-exports are not counted twice)."""
    out = defaultdict(list)
    for info in pkgutil.walk_packages(labkit.__path__, "labkit."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isclass(obj):
                out[name].append((info.name, "class", ()))
            elif inspect.isfunction(obj):
                params = tuple((p.name, p.kind) for p in inspect.signature(obj).parameters.values())
                out[name].append((info.name, "function", params))
    return out


def doubles(defs: dict[str, list[tuple[str, str, tuple]]]) -> dict[str, list[str]]:
    """Names defined twice with different meanings: two classes, a class and a function, or two functions whose
    parameters differ."""
    bad = {}
    for name, where in defs.items():
        if len(where) < 2:
            continue
        kinds = {k for _, k, _ in where}
        params = {p for _, k, p in where if k == "function"}
        if "class" in kinds or len(params) > 1:
            bad[name] = [f"{m} ({k}{'' if k == 'class' else ': ' + ', '.join(n for n, _ in p)})" for m, k, p in where]
    return bad


def test_the_walk_sees_every_package():
    defs = public_definitions()
    assert {"LLMEngine", "PagedKVCache", "CausalLM", "tensor_parallel", "rms_norm"} <= set(defs)
    assert any(m.startswith("labkit.experiments.") for where in defs.values() for m, _, _ in where)


def test_doubles_are_found():
    fake = {"f": [("a", "function", (("x", 1),)), ("b", "function", (("y", 1),))],
            "g": [("a", "function", (("x", 1),)), ("b", "function", (("x", 1),))], "C": [("a", "class", ()),
                                                                                         ("b", "class", ())]}
    assert set(doubles(fake)) == {"f", "C"}


def test_no_two_public_functions_share_a_name_with_different_signatures():
    bad = doubles(public_definitions())
    assert not bad, "rename one of each pair:\n" + "\n".join(f"{n}: {w}" for n, w in sorted(bad.items()))
