"""Argument checks shared by every public entry point: one helper per kind of argument.

Each returns the value it accepted (converted where the conversion loses nothing: a numpy int to ``int``, a
device string to ``torch.device``) or raises naming the argument, the value and what is allowed. Nothing is
coerced that would change meaning: ``2.5`` is not an int, ``True`` is not a count, ``5`` is not a list of token
ids and ``"abc"`` is not one either. A value of the wrong kind raises ``ArgumentTypeError`` (a ``TypeError``, and a
``ValueError`` too, so code that catches either for bad input catches it); one of the right kind out of range a
``ValueError``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import numpy as np
import torch

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Floating dtypes of weights and activations, by labkit's short names."""
_FLOAT_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong kind (a float for a count, a string for token ids, ...)."""


def _is_int(value) -> bool:
    # ``type(value) is int`` first: the engine checks a few hundred counts a decode step at batch 64, and an
    # isinstance against the ``numbers.Integral`` ABC costs ~20x more than the exact-type test (bool is not int's type)
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_int(name: str, value, low: int | None = None, high: int | None = None, none_ok: bool = False) -> int | None:
    """``value`` as an ``int`` in ``[low, high)`` (either bound may be None); ``None`` passes when ``none_ok``."""
    if value is None and none_ok:
        return None
    if not _is_int(value):
        raise ArgumentTypeError(f"{name}={value!r} must be an int{' or None' if none_ok else ''}, got "
                                f"{type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value >= high):
        allowed = f"in [{low}, {high})" if low is not None and high is not None else \
            f">= {low}" if low is not None else f"< {high}"
        raise ValueError(f"{name}={value!r} must be an int {allowed}")
    return int(value)


def check_positive_int(name: str, value, none_ok: bool = False) -> int | None:
    """An ``int >= 1`` (a count, a size)."""
    return check_int(name, value, 1, none_ok=none_ok)


def check_number(name: str, value, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, none_ok: bool = False) -> float | None:
    """A finite real number (not a bool) within the bounds given (closed unless ``*_open``), as a ``float``."""
    if value is None and none_ok:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name}={value!r} must be a number, got {type(value).__name__}")
    v = float(value)
    bad = not math.isfinite(v) or (low is not None and (v < low or (low_open and v == low))) or \
        (high is not None and (v > high or (high_open and v == high)))
    if bad:
        lo = "" if low is not None and low_open else "="
        hi = "" if high is not None and high_open else "="
        rng = " and ".join(([f">{lo} {low}"] if low is not None else []) + ([f"<{hi} {high}"] if high is not None
                                                                           else []))
        raise ValueError(f"{name}={value!r} must be a finite number" + (f" {rng}" if rng else ""))
    return v


def check_bool(name: str, value) -> bool:
    """``True`` or ``False`` exactly (not 1, not 'yes')."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name}={value!r} must be True or False")
    return value


def check_choice(name: str, value, allowed: Iterable):
    """One of ``allowed`` (compared by equality)."""
    allowed = tuple(allowed)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) or value not in allowed:
        raise ValueError(f"{name}={value!r} is unknown; allowed: {list(allowed)}")
    return value


def check_type(name: str, value, types: type | tuple[type, ...], what: str | None = None):
    """An instance of ``types`` (``what`` says it in words for the message)."""
    if not isinstance(value, types):
        want = what or "a " + (" or ".join(t.__name__ for t in types) if isinstance(types, tuple) else types.__name__)
        raise ArgumentTypeError(f"{name} must be {want}, got {type(value).__name__} {value!r:.60}")
    return value


def check_attrs(name: str, value, attrs: Iterable[str], what: str):
    """An object with every attribute in ``attrs`` (a duck type; ``what`` says in words what is expected)."""
    missing = [a for a in attrs if not hasattr(value, a)]
    if missing:
        raise ArgumentTypeError(f"{name} must be {what}, got {type(value).__name__} {value!r:.60} (it has no "
                                f"{', '.join(missing)})")
    return value


def check_token_ids(name: str, ids, vocab_size: int | None = None, allow_empty: bool = False) -> list[int]:
    """Token ids as a list of ints: from a list or tuple of ints or a 1-D integer tensor or array; every id in
    ``[0, vocab_size)`` (``>= 0`` without one). A string, a single int or floats are refused, not wrapped."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        integral = (not torch.is_floating_point(ids) and not ids.is_complex() and ids.dtype != torch.bool
                    if isinstance(ids, torch.Tensor) else ids.dtype.kind in "iu")
        if ids.ndim != 1 or not integral:
            raise ArgumentTypeError(f"{name} must be a 1-D integer tensor of token ids, got {ids.dtype} of shape "
                            f"{tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise ArgumentTypeError(f"{name} must be a list of token ids (ints), got {type(ids).__name__} {ids!r:.60}")
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty; it needs at least one token id")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ArgumentTypeError(f"{name}[{i}] is {t!r} ({type(t).__name__}); token ids must be ints")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{name}[{i}] is {t}, outside the vocabulary; allowed: {allowed}")
    return [int(t) for t in ids]


def check_device(name: str, device) -> torch.device:
    """``None`` / ``'auto'`` (CUDA when present, else the CPU), ``'cpu'``, ``'cuda'``, ``'cuda:N'`` or a
    ``torch.device``; CUDA where none is present is refused (``'meta'`` is not a device to run on)."""
    if device is None or device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(f"{name}={device!r} must be a device name ('cpu', 'cuda', 'cuda:N', 'auto') or a "
                        f"torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}={device!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'auto'") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={device!r}: labkit runs on 'cpu' or 'cuda', not {dev.type!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={device!r} asks for CUDA but no CUDA device is present; use 'cpu' or 'auto'")
    return dev


def check_dtype(name: str, dtype, allowed: dict[str, torch.dtype] | None = None) -> torch.dtype:
    """A torch dtype, given as one or by name ('fp32', 'bfloat16', 'half', ...), among ``allowed`` (default: the
    floating ``FLOAT_DTYPES``)."""
    allowed = FLOAT_DTYPES if allowed is None else allowed
    if isinstance(dtype, torch.dtype):
        if dtype in allowed.values():
            return dtype
    elif isinstance(dtype, str):
        key = _FLOAT_ALIASES.get(dtype.lower(), dtype.lower())
        if key in allowed:
            return allowed[key]
    else:
        raise ArgumentTypeError(f"{name}={dtype!r} must be a torch dtype or its name; allowed: {sorted(allowed)}")
    raise ValueError(f"{name}={dtype!r} is not allowed here; allowed: {sorted(allowed)} (or those torch dtypes)")
