"""Accuracy measurements shared by every notebook: held-out perplexity, a unigram baseline, logit error."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model: torch.nn.Module, token_ids: torch.Tensor, seq_len: int = 512, batch_size: int = 8,
               max_windows: int | None = None, progress: bool = False) -> float:
    """Perplexity of ``model`` on a 1-D token stream, cut into non-overlapping windows of ``seq_len + 1`` tokens.

    Every window predicts its last ``seq_len`` tokens from the ones before, so each scored token sees at least
    one token of context and at most ``seq_len``. ``max_windows`` scores only the first windows (explicitly;
    nothing is dropped silently other than the ragged tail shorter than one window).
    """
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be positive")
    n_windows = (len(token_ids) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than one window of seq_len+1={seq_len + 1}")
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    device = next(model.parameters()).device
    windows = token_ids[: n_windows * seq_len + 1]
    nll, count = 0.0, 0
    starts = range(0, n_windows, batch_size)
    for i in tqdm(starts, desc="perplexity", disable=not progress):
        rows = [windows[j * seq_len: (j + 1) * seq_len + 1] for j in range(i, min(i + batch_size, n_windows))]
        batch = torch.stack(rows).to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum")
        nll += loss.item()
        count += batch[:, 1:].numel()
    return math.exp(nll / count)


def unigram_perplexity(train_ids: torch.Tensor, heldout_ids: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on ``train_ids``, scored on ``heldout_ids``
    (all held-out tokens after the first, the same tokens ``perplexity`` scores)."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return math.exp(-logp[heldout_ids[1:]].mean().item())


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives NaN (never passes a bound)."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64)).item()
