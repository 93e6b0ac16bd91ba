import os

import pytest

from labkit.device import environ, resolve_device


def test_environ_sets_unsets_and_restores(monkeypatch):
    monkeypatch.setenv("LABKIT_T_KEEP", "old")
    monkeypatch.delenv("LABKIT_T_NEW", raising=False)
    with environ(LABKIT_T_KEEP=None, LABKIT_T_NEW="1"):
        assert "LABKIT_T_KEEP" not in os.environ and os.environ["LABKIT_T_NEW"] == "1"
    assert os.environ["LABKIT_T_KEEP"] == "old" and "LABKIT_T_NEW" not in os.environ


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="device='tpu'"):
        resolve_device("tpu")
