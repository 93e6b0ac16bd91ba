"""Shared fixtures: the embedded model, loaded once per test session."""

import pytest
import torch

import labkit  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)


@pytest.fixture(scope="session")
def tiny_model():
    """``(model, tokenizer)`` of the embedded model in float32 on the CPU, eval mode."""
    from labkit.models import load_model

    torch.manual_seed(0)
    return load_model()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
