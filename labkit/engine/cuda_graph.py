"""Decode steps captured as CUDA graphs, one per batch-size bucket, and replayed.

Why: at batch 1 a decode step of an 8B model is ~400 kernels of a few microseconds each; launched one by one
from Python, the GPU idles between them (notebook 00 measured HF ``generate`` at 3% of the bandwidth floor).
A CUDA graph records the whole step once and replays it with one launch.

A graph replays fixed addresses and shapes, so (as vLLM and nano-vllm do):

* the step's inputs live in pre-allocated static buffers (``input_ids``, ``positions``, ``slot_mapping``,
  ``context_lens``, ``block_tables``) that each step copies into before the replay;
* a batch is padded up to the next captured size; padding rows write their K/V into a private *scratch block*
  taken from the allocator (so they touch no sequence's cache) and attend to that one slot;
* block tables are padded to ``max_model_len / block_size`` columns, whatever the batch's longest sequence.

Graphs are captured largest first and share one memory pool (only one replays at a time). Each is preceded by
one eager run of the same step, which autotunes the Triton kernels and creates cuBLAS handles outside capture.

A graph's output is a fixed tensor too: every replay overwrites it, and with the shared pool a replay of one
bucket may overwrite another bucket's output. So ``run`` returns a copy of the real rows, never the buffer itself
(a caller that keeps a step's logits would otherwise see them change under it). Nothing the captured step computes
may depend on host copies of the inputs' values (``.item()``, ``.tolist()``, a split count chosen from the
context lengths): the graph would replay the capture's value forever. The CUDA calls sit in a few small methods
so that the tests can run this module on the CPU against a stand-in that checks exactly that
(``tests/test_engine_cuda_graph.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from functools import partial

import torch

from labkit.engine.model_runner import ModelInput, ModelRunner


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 64, then every 32, and ``max_num_seqs`` itself (padding wastes at most
    about a third of a small batch)."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 16)) + list(range(96, max(max_num_seqs, 96) + 32, 32))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """One captured all-decode step of ``runner`` per batch size in ``batch_sizes``."""

    def __init__(self, runner: ModelRunner, batch_sizes: Sequence[int]):
        self._check_device(runner)
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1 or not all(isinstance(b, int) for b in sizes):
            raise ValueError(f"graph_batch_sizes={list(batch_sizes)} must be positive ints")
        self.runner, self.batch_sizes = runner, sizes
        if runner.scratch_block is None:
            (runner.scratch_block,) = runner.cache.allocator.allocate(1)
        self.static = runner._to_device([], [], [], [], [], [], [], 0, sizes[-1], runner.max_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):
            inp = self._static_input(bs)
            self.runner.forward(inp)  # warm-up, eager: Triton autotuning and cuBLAS handles happen here
            self._synchronize()
            graph = self._new_graph()
            self.logits[bs] = self._capture_into(graph, pool, partial(self.runner.forward, inp))
            pool = self._pool(graph)
            self.graphs[bs] = graph
        self._synchronize()

    # --- the CUDA calls (the tests replace these with a host stand-in) ---------------------------------------
    @staticmethod
    def _check_device(runner: ModelRunner) -> None:
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; this runner is on the CPU")

    def _new_graph(self):
        return torch.cuda.CUDAGraph()

    def _capture_into(self, graph, pool, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(graph, pool=pool):
            return step()

    def _pool(self, graph):
        return graph.pool()

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.runner.device)

    def _static_input(self, bs: int) -> ModelInput:
        s = self.static
        return ModelInput([], s.input_ids[:bs], s.positions[:bs], s.slot_mapping[:bs], s.block_tables[:bs],
                          s.context_lens[:bs], [1] * bs, [1] * bs, [], bs)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_seqs`` rows, or ``None``."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def run(self, inp: ModelInput, bs: int) -> torch.Tensor:
        """Copy ``inp`` (already padded to ``bs`` rows, block tables ``max_blocks`` wide) into the static buffers
        and replay; returns a new tensor: the logits of ``inp``'s real rows ``[len(inp.seq_ids), vocab]`` (the
        graph's own output buffer is overwritten by the next replay of any bucket)."""
        if bs not in self.graphs:
            raise ValueError(f"batch size {bs} has no captured graph; captured: {self.batch_sizes}")
        s = self.static
        for name, dst, src in (("input_ids", s.input_ids, inp.input_ids), ("positions", s.positions, inp.positions),
                               ("slot_mapping", s.slot_mapping, inp.slot_mapping),
                               ("context_lens", s.context_lens, inp.context_lens),
                               ("block_tables", s.block_tables, inp.block_tables)):
            if src.shape != dst[:bs].shape or src.dtype != dst.dtype:  # copy_ would broadcast or cast silently
                raise ValueError(f"{name} {tuple(src.shape)} {src.dtype} does not fit the captured step of batch "
                                 f"{bs}: need {tuple(dst[:bs].shape)} {dst.dtype} (prepare with pad_to={bs}, "
                                 f"width=max_blocks)")
            dst[:bs].copy_(src)
        return self.replay(bs)[:len(inp.seq_ids)].clone()

    def replay(self, bs: int) -> torch.Tensor:
        """Replay the step of batch ``bs`` on whatever its buffers hold (for timing the device alone: the last
        step's inputs rewrite the same slots with the same K/V). Returns the graph's output buffer itself,
        ``[bs, vocab]``: valid until the next replay."""
        if bs not in self.graphs:
            raise ValueError(f"batch size {bs} has no captured graph; captured: {self.batch_sizes}")
        self.graphs[bs].replay()
        return self.logits[bs]
