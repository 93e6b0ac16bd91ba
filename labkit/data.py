"""The repository's data: the embedded model (``data/pydocs-llama``) and its text, the Python 3.11 documentation
sources, split by file (``data/pydocs``).

Splits: ``train`` (pre-training), ``calib`` (quantisation calibration), ``heldout`` (perplexity only),
``task_train`` and ``task_heldout`` (the C-API pages, unseen in pre-training, for fine-tuning).
``scripts/prepare_corpus.py`` made them; its docstring says how.
"""

from __future__ import annotations

import gzip
import re
from functools import cache
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
EMBEDDED_MODEL = "pydocs-llama"
"""The embedded model's name: a small Llama-architecture model trained by this project (its model card in data/)."""
EMBEDDED_MODEL_DIR = DATA_DIR / EMBEDDED_MODEL
CORPUS_DIR = DATA_DIR / "pydocs"
SPLITS = ("train", "calib", "heldout", "task_train", "task_heldout")


@cache
def read_split(split: str) -> str:
    """The text of one split (documents separated by ``<|endoftext|>``)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; allowed: {list(SPLITS)}")
    if split == "train":
        with gzip.open(CORPUS_DIR / "train.txt.gz", "rt", encoding="utf-8") as fh:
            return fh.read()
    return (CORPUS_DIR / f"{split}.txt").read_text(encoding="utf-8")


def split_tokens(split: str, tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of a split as one int64 tensor; ``max_tokens`` keeps the first that many (explicitly)."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens} must be at least 2 (or None for the whole split)")
    ids = tokenizer(read_split(split), return_attention_mask=False, verbose=False)["input_ids"]
    t = torch.tensor(ids, dtype=torch.long)
    return t if max_tokens is None else t[:max_tokens]


def sample_prompts(tokenizer, n: int, prompt_len: int, split: str = "heldout", seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` tokens cut from random places of a split (reproducible)."""
    ids = split_tokens(split, tokenizer)
    if prompt_len < 1 or prompt_len >= len(ids):
        raise ValueError(f"prompt_len={prompt_len} must be in [1, {len(ids) - 1}] for split {split!r}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - prompt_len, (n,), generator=g)
    return [ids[s:s + prompt_len].tolist() for s in starts]


KNOWN_MACHINES = {"cpu": "cpu", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}
"""Device names (``torch.cuda.get_device_name``, or ``cpu``) of the machines the workbook targets, by class."""


def machine_class(machine: str) -> str:
    """The class figures are kept under: ``h100``, ``h200`` or ``cpu`` for the machines the workbook targets; any
    other device name gets its own slug (``NVIDIA A100-SXM4-80GB`` -> ``a100-sxm4-80gb``, ``NVIDIA H100 PCIe`` ->
    ``h100-pcie``), never another machine's class. A figure derived from records of several machines
    (``NVIDIA H100 80GB HBM3 + NVIDIA H200``) is of the joined class ``h100+h200``."""
    if not isinstance(machine, str) or not machine.strip():
        raise ValueError(f"machine={machine!r}: need a device name, e.g. 'NVIDIA H200' or 'cpu'")
    parts = [p.strip() for p in machine.split(" + ")]
    if len(parts) > 1:
        return "+".join(sorted({machine_class(p) for p in parts}))
    name = parts[0]
    if name in KNOWN_MACHINES:
        return KNOWN_MACHINES[name]
    slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"^nvidia\s+", "", name.strip().lower())).strip("-")
    return slug or "unknown"
