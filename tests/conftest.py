"""Shared fixtures: the embedded model, loaded once per test session; the studies of research/, by name."""

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)

if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # pytest -n N: the workers share the machine's cores; a torch thread pool per worker only oversubscribes them
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model():
    """``(model, tokenizer)`` of the embedded model in float32 on the CPU, eval mode."""
    from labkit.model import load_model

    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="module")
def two_layers(tiny_model):
    """The embedded model cut to two layers (a copy per test module): the interpreter's runs of the Triton path cost
    a quarter, and every path of a step still runs in each layer, on more than one layer's cache."""
    model = copy.deepcopy(tiny_model[0])
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    return model


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: the embedded model's matmuls are too small to gain from threads, and on a
    shared 2-core machine extra threads only contend. Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


RESEARCH = Path(__file__).resolve().parent.parent / "research"


@pytest.fixture(scope="session")
def research_study():
    """``research_study(name)``: the module of ``research/<name>.py``, imported by its path once per session
    (research/ is a folder of scripts, not a package)."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"research_{name}", RESEARCH / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]
    return load


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
