"""Engine steps captured as CUDA graphs and replayed: all-decode steps per batch-size bucket, steps that carry
prefill chunks per token-count bucket, and speculative decoding's verify steps (every row's logits) per token-count
bucket.

Why: at batch 1 a decode step of an 8B model is ~400 kernels of a few microseconds each; launched one by one
from Python, the GPU idles between them. A CUDA graph records the whole step once and replays it with one launch.
Under continuous batching most steps carry a prefill chunk beside the decodes, and run eagerly such a step costs
several replayed decode steps (research/README.md), so those steps are captured too.

A graph replays fixed addresses and shapes, so (as vLLM and nano-vllm do):

* the step's inputs live in pre-allocated static buffers (``input_ids``, ``positions``, ``slot_mapping``,
  ``context_lens``, ``query_start_loc``, ``logits_indices``, ``block_tables``) that each step copies into
  before the replay;
* a decode batch is padded up to the next captured size; padding rows write their K/V into a private *scratch
  block* taken from the allocator (so they touch no sequence's cache) and attend to that one slot;
* a step with prefill chunks is padded up to the next captured token count ``T`` and to ``min(T,
  max_num_seqs)`` sequences: padding tokens write to the scratch block, padding sequences own no tokens, and its
  attention (``paged_prefill_attention``) has a grid that depends on ``T`` and the sequence count alone;
* a *verify* step (speculative decoding: every sequence decodes, some with ``1 + n`` rows, its pending token and
  ``n`` proposals) is captured as a step with prefill chunks is (the same attention, ``paged_prefill_attention`` over
  ``query_start_loc``, the same padding), but returns the logits of every token row (its ``logits_indices`` are a
  fixed device ``arange``, never packed), so the caller splits them per sequence; its token counts go up to
  ``max_num_seqs * (k + 1)`` (``default_graph_verify_sizes``). A verify step with a prefill chunk beside it runs
  eagerly (its logits rows are each chunk's last and every decode row);
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
import gc
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from labkit.device import host_to_device
from labkit.model.attention import ModelInput, fill_placeholders


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 64, then every 32, and ``max_num_seqs`` itself (padding wastes at most
    about a third of a small batch)."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 16)) + list(range(96, max(max_num_seqs, 96) + 32, 32))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def default_graph_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts for steps with prefill chunks: powers of two from 16 to 128, then every 64 to 512, every 128
    to 1,024 and every 256 beyond, up to ``max_num_batched_tokens`` (included). Past ~150 tokens an 8B step is
    compute-bound, where each padding token costs its FLOPs, hence the finer steps there."""
    sizes = [16, 32, 64, 128] + list(range(192, 513, 64)) + list(range(640, 1025, 128)) + \
        list(range(1280, max(max_num_batched_tokens, 1280) + 256, 256))
    return sorted({s for s in sizes if s < max_num_batched_tokens} | {max_num_batched_tokens})


def default_graph_verify_sizes(max_num_seqs: int, num_speculative_tokens: int) -> list[int]:
    """Token counts of captured verify steps for ``k = num_speculative_tokens``: ``(k + 1) * b`` for each decode batch
    size ``b`` of ``default_graph_batch_sizes(max_num_seqs)`` (``b`` sequences that each propose ``k`` fill one
    exactly), up to ``max_num_seqs * (k + 1)``."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
    return [(num_speculative_tokens + 1) * b for b in default_graph_batch_sizes(max_num_seqs)]


@contextmanager
def _no_collection():
    """Python's garbage collector collected first and then held off while the steps are captured: a collection
    that frees an earlier engine's graphs in the middle of a capture calls ``cudaGraphExecDestroy`` inside it,
    which invalidates the capture (notebook 09 on an H100: "operation failed due to a previous error during
    capture", after "operation not permitted when stream is capturing (function reset)"). torch no longer
    collects before a capture unless ``force_cudagraph_gc`` is set."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class GraphKey:
    """A captured step: ``decode`` batch of ``seqs`` single-token rows, ``mixed``: ``tokens`` rows of ``seqs``
    sequences that may carry prefill chunks (each sequence's last row's logits), or ``verify``: ``tokens`` rows of
    ``seqs`` sequences, every row's logits (speculative decoding's verify step)."""

    kind: str
    seqs: int
    tokens: int


class StepGraphs:
    """Captured steps of ``runner`` (the ``ModelRunner`` that builds this object; a capture uses its ``forward``,
    ``cache``, ``scratch_block`` and sizes): an all-decode step per batch size in ``batch_sizes``, a step of each
    token count in ``token_sizes`` (any mix of prefill chunks and decodes) and a verify step of each token count in
    ``verify_sizes`` (every row's logits); the last two need the runner's Triton path."""

    def __init__(self, runner, batch_sizes: Sequence[int], token_sizes: Sequence[int] = (),
                 verify_sizes: Sequence[int] = ()):
        self._check_device(runner)
        sizes, tokens, verify = sorted(set(batch_sizes)), sorted(set(token_sizes)), sorted(set(verify_sizes))
        for name, vals in (("graph_batch_sizes", sizes), ("graph_token_sizes", tokens),
                           ("graph_verify_sizes", verify)):
            if (name == "graph_batch_sizes" and not vals) or any(not isinstance(b, int) or b < 1 for b in vals):
                raise ValueError(f"{name}={vals} must be positive ints")
        for name, vals in (("graph_token_sizes", tokens), ("graph_verify_sizes", verify)):
            if vals and not runner.use_triton:
                raise ValueError(f"{name} need the runner's Triton kernels (kernels='triton'): the torch path's "
                                 "prefill attention reads the chunk lengths on the host")
        self.runner, self.batch_sizes, self.token_sizes, self.verify_sizes = runner, sizes, tokens, verify
        self.keys = [GraphKey("decode", b, b) for b in sizes] + \
            [GraphKey("mixed", min(t, runner.max_num_seqs), t) for t in tokens] + \
            [GraphKey("verify", min(t, runner.max_num_seqs), t) for t in verify]
        if runner.scratch_block is None:
            (runner.scratch_block,) = runner.cache.allocator.allocate(1)
        self.static_shape = (max(k.seqs for k in self.keys), max(k.tokens for k in self.keys))
        self.static = ModelInput.build(runner.cache, [], [], num_seqs=self.static_shape[0], width=runner.max_blocks,
                                       num_rows=self.static_shape[1], scratch_block=runner.scratch_block)
        # a verify step's logits rows: every token row, in order (a constant: nothing to pack per step)
        self.all_rows = torch.arange(self.static_shape[1], dtype=torch.int32, device=runner.device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        # every graph writes its logits into the head of one buffer (one replays at a time, and a replay's logits
        # are cloned out): one output per graph would keep sum(rows) x vocab float32 alive, ~2 GB for the decode
        # graphs alone at max_num_seqs 256 and a 128k vocabulary, five times that for verify graphs at k = 4
        self.out = torch.empty(max(self._rows(k) for k in self.keys), runner.model.config.vocab_size,
                               dtype=torch.float32, device=runner.device)
        self.logits: dict[GraphKey, torch.Tensor] = {}
        self.pool_bytes = self._pool_bytes(self._capture())  # device memory of the captures' one private pool

    @torch.inference_mode()
    def _capture(self):
        """Capture every key's step into one private memory pool; returns the pool's handle."""
        pool = None
        with _no_collection():
            for key in sorted(self.keys, key=lambda k: (k.tokens, k.kind), reverse=True):
                inp = self._static_input(key)
                self.runner.forward(inp)  # warm-up, eager: Triton autotuning and cuBLAS handles happen here
                self._synchronize()
                graph = self._new_graph()
                out = self.out[:self._rows(key)]
                self.logits[key] = self._capture_into(graph, pool, partial(self.runner.forward, inp, out=out))
                pool = self._pool(graph)
                self.graphs[key] = graph
            self._synchronize()
        return pool

    # --- the CUDA calls (the tests replace these with a host stand-in) ---------------------------------------
    @staticmethod
    def _check_device(runner) -> None:
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

    @staticmethod
    def _pool_bytes(pool) -> int:
        # the pool's own segments (as Inductor's cudagraph trees count them): a difference of memory_reserved
        # before and after the captures also counts whatever else the process allocated or freed meanwhile (bench
        # decode's second engine read -50 GB when the first one's memory went back during its captures)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] == pool)

    @staticmethod
    def _rows(key: GraphKey) -> int:
        """Logits rows of ``key``'s step: every token row of a verify step, one per sequence otherwise."""
        return key.tokens if key.kind == "verify" else key.seqs

    def _static_input(self, key: GraphKey) -> ModelInput:
        s, n, t = self.static, key.seqs, key.tokens
        decodes = n if key.kind == "decode" else 0
        rows = self.all_rows[:t] if key.kind == "verify" else s.logits_indices[:n]
        return ModelInput(s.input_ids[:t], s.positions[:t], s.slot_mapping[:t], s.block_tables[:n],
                          s.context_lens[:n], s.query_start_loc[:n + 1], rows, decodes)

    # --- lookup and replay ----------------------------------------------------------------------------------
    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured decode batch size that holds ``num_seqs`` rows, or ``None``."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def lookup(self, num_seqs: int, num_tokens: int, num_decode: int, all_logits: bool = False) -> GraphKey | None:
        """The captured step for a step of ``num_seqs`` sequences and ``num_tokens`` tokens of which
        ``num_decode`` are decodes: the decode graph of the smallest batch that holds an all-decode step, else
        the smallest token count that holds the step (and its sequences), else ``None`` (run eagerly).
        ``all_logits``: a step that wants every row's logits (a verify step): the smallest verify graph that holds
        it, else ``None``."""
        if all_logits:
            i = bisect.bisect_left(self.verify_sizes, num_tokens)
            if i < len(self.verify_sizes) and num_seqs <= min(self.verify_sizes[i], self.runner.max_num_seqs):
                t = self.verify_sizes[i]
                return GraphKey("verify", min(t, self.runner.max_num_seqs), t)
            return None
        if num_decode == num_seqs and (bs := self.bucket(num_seqs)) is not None:
            return GraphKey("decode", bs, bs)
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        if i < len(self.token_sizes) and num_seqs <= self.runner.max_num_seqs:
            t = self.token_sizes[i]
            return GraphKey("mixed", min(t, self.runner.max_num_seqs), t)
        return None

    def run_packed(self, longs: np.ndarray, ints: np.ndarray, key: GraphKey, num_rows: int,
                   sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a step packed on the host in the layout of the static buffers (``labkit.model.attention.pack_step`` at
        ``static_shape`` and ``max_blocks``: two host-to-device copies feed every field, from pinned memory on CUDA)
        and replay ``key``; returns a new tensor: the logits of the first ``num_rows`` rows ``[num_rows, vocab]`` (the
        step's sequences; for a verify key its token rows, in order), since the graph's own output buffer is
        overwritten by the next replay of any bucket. ``sampled``: the previous step's sampled tokens on the device
        (async scheduling): placeholder input ids are read from it, on the device, before the replay
        (``labkit.model.attention.fill_placeholders``)."""
        for name, dst, src in zip(("longs", "ints"), self.static.buffers, (longs, ints)):
            if tuple(dst.shape) != src.shape:
                raise ValueError(f"packed {name} {src.shape} do not match the static buffer {tuple(dst.shape)}; "
                                 f"pack at static_shape={self.static_shape}, width=max_blocks")
            host_to_device(src, dst.device, out=dst)
        if key not in self.keys:
            raise ValueError(f"{key} has no captured graph; captured decode batches {self.batch_sizes}, token "
                             f"counts {self.token_sizes}, verify token counts {self.verify_sizes}")
        if sampled is not None:
            fill_placeholders(self.static.input_ids, sampled)
        self.graphs[key].replay()
        return self.logits[key][:num_rows].clone()
