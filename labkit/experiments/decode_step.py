"""One decode step of a Hugging Face causal LM over a static KV cache, replayable as a CUDA graph.

At batch 1 a decode step of an 8B model launches several hundred kernels of a few microseconds each; timed
eagerly, Python and launch overhead hide what the kernels and the bytes cost. Capturing the step once in a CUDA
graph and timing its replays (as gpt-fast does) removes that overhead, so a change that saves bytes (quantised
weights, a fused kernel) shows up in the time. This module does exactly that with HF's own ``StaticCache`` and the
model's own forward, so any module swapped into the model (quantised linears, patched kernels) is what runs.

The cache holds ``context_len`` tokens of random K/V (never zeros) and one free slot; each step writes the new
token's K/V into that slot and attends over all ``context_len + 1`` positions.
"""

from __future__ import annotations

import inspect

import torch

from labkit.bench import Timing, time_fn


def _cache_kwarg(model) -> str:
    """HF renamed ``past_key_values`` to ``cache`` (5.2x); use whichever this version's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class StaticDecodeStep:
    """A decode forward at a fixed ``batch_size`` and ``context_len``, callable and (on CUDA) graph-replayable.

    ``step()`` returns logits ``[batch_size, 1, vocab]`` in the model's dtype. ``time()`` gives a ``Timing`` of
    graph replays on CUDA (``cuda_graph=True``) or of eager calls. ``prompt_ids`` (int64 ``[batch_size,
    context_len]``) prefills the cache with real tokens instead of random K/V, for checking against a full forward.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, context_len: int, cuda_graph: bool = True,
                 seed: int = 0, prompt_ids: torch.Tensor | None = None):
        from transformers import StaticCache

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if context_len < 1 or (max_pos is not None and context_len + 1 > max_pos):
            raise ValueError(f"context_len={context_len} must be in [1, {max_pos - 1 if max_pos else 'inf'}] "
                             "(the new token needs one more position)")
        self.device = next(model.parameters()).device
        if cuda_graph and self.device.type != "cuda":
            cuda_graph = False  # CUDA graphs exist only on CUDA; the CPU path is the same step, eager
        self.model, self.batch_size, self.context_len, self.cuda_graph = model, batch_size, context_len, cuda_graph
        self._kw = _cache_kwarg(model)
        g = torch.Generator(device="cpu").manual_seed(seed)
        vocab = model.config.vocab_size
        self.input_ids = torch.randint(vocab, (batch_size, 1), generator=g).to(self.device)
        self.position_ids = torch.full((batch_size, 1), context_len, dtype=torch.long, device=self.device)
        self.cache = StaticCache(config=model.config, max_cache_len=context_len + 1)
        if prompt_ids is not None:
            if tuple(prompt_ids.shape) != (batch_size, context_len):
                raise ValueError(f"prompt_ids must have shape [batch_size, context_len] = [{batch_size}, "
                                 f"{context_len}], got {tuple(prompt_ids.shape)}")
            self._prefill(prompt_ids.to(self.device))
        else:
            self._fill_cache(seed)
        self._graph = None
        self.logits = None
        if cuda_graph:
            self._capture()

    @torch.no_grad()
    def _fill_cache(self, seed: int) -> None:
        """Initialise the cache with one forward, then overwrite its K/V with random values."""
        self._forward()
        torch.manual_seed(seed)
        for layer in self.cache.layers:
            layer.keys.normal_()
            layer.values.normal_()

    @torch.no_grad()
    def _prefill(self, prompt_ids: torch.Tensor) -> None:
        positions = torch.arange(self.context_len, device=self.device).expand(self.batch_size, -1)
        self.model(input_ids=prompt_ids, position_ids=positions, use_cache=True, **{self._kw: self.cache})

    def _forward(self) -> torch.Tensor:
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "is_initialized", False):
                # rewind to context_len: every replay writes the same slot, as a fresh decode step would
                layer.cumulative_length.fill_(self.context_len)
        out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=True,
                         **{self._kw: self.cache})
        return out.logits

    @torch.no_grad()
    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self.logits = self._forward()
        torch.cuda.synchronize()

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Run one decode step; returns logits ``[batch_size, 1, vocab]``."""
        if self._graph is not None:
            self._graph.replay()
            return self.logits
        return self._forward()

    def time(self, warmup: int = 3, iters: int = 20) -> Timing:
        """Median time of one step: graph replays timed with CUDA events, or eager calls."""
        t = time_fn(self.step, device=self.device, warmup=warmup, iters=iters)
        t.method = "cuda_graph_replay" if self._graph is not None else t.method
        t.extra.update(batch_size=self.batch_size, context_len=self.context_len)
        return t

    def kernel_breakdown(self, top: int = 15, steps: int = 3) -> dict:
        """Where a step's device time goes (``labkit.profiling.step_breakdown`` of ``steps`` steps)."""
        from labkit.profiling import step_breakdown

        return step_breakdown(self.step, top, steps)


def time_decode_step(model: torch.nn.Module, batch_size: int, context_len: int, cuda_graph: bool = True,
                     iters: int = 20, breakdown: int = 0) -> Timing:
    """Time one decode step of ``model`` at ``batch_size`` with ``context_len`` cached tokens.

    On CUDA with ``cuda_graph=True`` the step is captured once and its replays are timed; elsewhere it runs eagerly.
    ``breakdown > 0`` also profiles the step and puts ``StaticDecodeStep.kernel_breakdown(breakdown)`` in
    ``timing.extra["breakdown"]``.
    """
    step = StaticDecodeStep(model, batch_size, context_len, cuda_graph=cuda_graph)
    timing = step.time(iters=iters)
    if breakdown:
        timing.extra["breakdown"] = step.kernel_breakdown(breakdown)
    del step
    return timing
