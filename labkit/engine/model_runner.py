"""The engine's ModelRunner: a ``labkit.model.CausalLM`` over a flat token batch on the paged KV cache, each op by the
kernel its ``FusionPlan`` names, and steps replayed from CUDA graphs (``labkit.engine.cuda_graph``).

A step is a ``ModelInput`` (``labkit.model.attention``, vLLM's names): ``num_tokens`` tokens of ``num_seqs`` sequences
back to back, single-token rows (decodes) first, with each token's cache slot (``slot_mapping``) and each sequence's
``block_table`` and ``context_len``. The runner packs it on the host (``pack_step``: two copies to the device) and
hands it to ``CausalLM.forward_paged`` (the ops of a layer: ``labkit.model.layers``); logits come for each sequence's
last token only. The runner reads the sequences and changes nothing of them: the scheduler's postprocess advances
their computed counts once the step is done.

All-decode steps of up to the largest captured batch replay a CUDA graph, and so do steps with prefill chunks of up
to the largest captured token count when ``graph_token_sizes`` are given, and speculative decoding's verify steps
(every row's logits, no prefill chunk) when ``graph_verify_sizes`` are given (``labkit.engine.cuda_graph``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from labkit.engine.cuda_graph import StepGraphs, default_graph_batch_sizes
from labkit.kvcache import KVSequence, PagedKVCache
from labkit.model import FusionPlan, KernelLog, adopt_hf_model
from labkit.model.attention import ModelInput, fill_placeholders, pack_step
from labkit.model.fusion import KERNEL_NAMES, check_kernels

KERNELS = KERNEL_NAMES
"""Kernel choices of the ModelRunner by name ('auto': Triton on CUDA, torch on the CPU); a FusionPlan also works."""


class ModelRunner:
    """Runs a ``labkit.model.CausalLM`` (or an HF Llama-family causal LM, adopted: ``labkit.model.adopt_hf_model``,
    weights shared) on a ``PagedKVCache``.

    * ``kernels``: a ``FusionPlan`` or its name: 'torch' (the references: greedy output equals HF ``generate`` token
      for token in float32), 'triton' (every op by labkit's kernels; on the CPU through Triton's interpreter, for
      tests) or 'auto' (``FusionPlan.for_device``: Triton on CUDA, torch on the CPU), resolved once for the model and
      ``cache`` by ``CausalLM.use`` (a sliding window keeps attention on torch, ...); None: the model's own plan
      (``LLMEngine`` resolves before it builds the runner). ``runner.plan`` is the plan in force.
    * ``cuda_graphs``: 'auto' (on with CUDA and an unquantised cache), True, False; decode steps are captured
      for ``graph_batch_sizes`` (default ``cuda_graph.default_graph_batch_sizes(max_num_seqs)``), steps with
      prefill chunks for ``graph_token_sizes`` (total tokens of the step; default none, see
      ``cuda_graph.default_graph_token_sizes``), verify steps (every row's logits: ``execute``'s ``logits_per_seq``
      asking for all of them) for ``graph_verify_sizes`` (default none; the engine's, when it speculates,
      ``cuda_graph.default_graph_verify_sizes(max_num_seqs, k)``)
    * ``max_model_len``: longest sequence (sets the graphs' block-table width); default the model's maximum
    * ``kernel_log``: a ``labkit.model.KernelLog`` every eager step records its ops' kernels in (tests, notebooks:
      which kernel ran); replayed steps record nothing
    """

    def __init__(self, model, cache: PagedKVCache, kernels: str | FusionPlan | None = "auto",
                 cuda_graphs: bool | str = "auto", max_num_seqs: int = 256, max_model_len: int | None = None,
                 graph_batch_sizes: Sequence[int] | None = None, graph_token_sizes: Sequence[int] = (),
                 kernel_log: KernelLog | None = None, graph_verify_sizes: Sequence[int] = ()):
        if kernels is not None:
            check_kernels(kernels)  # a bad name fails before the model is touched
        m = adopt_hf_model(model)
        m.check_cache(cache)
        self.model = m if kernels is None else m.use(kernels, cache)
        self.cache, self.device, self.dtype = cache, cache.device, m.dtype
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        self.max_num_seqs = max_num_seqs
        self.max_blocks = cache.blocks_for(self.max_model_len)
        self._dequantise = cache.fmt.quantised or cache.fmt.storage_dtype != self.dtype
        self.scratch_block: int | None = None  # padding rows of captured steps write here (cuda_graph.py)
        self.graphs = None
        self.last_step_replayed = False  # whether the last ``execute`` replayed a graph
        self.kernel_log = kernel_log
        if self._want_graphs(cuda_graphs):
            self.graphs = StepGraphs(self, graph_batch_sizes or default_graph_batch_sizes(max_num_seqs),
                                     graph_token_sizes, graph_verify_sizes)

    @property
    def plan(self) -> FusionPlan:
        """The plan in force: the model's, resolved once (``CausalLM.use``)."""
        return self.model.plan

    @property
    def use_triton(self) -> bool:
        """Whether attention runs the Triton kernels (whose launches depend on shapes only: steps with prefill
        chunks are capturable)."""
        return self.plan.attention == "triton"

    @property
    def graph_batch_sizes(self) -> list[int]:
        """Batch sizes with a captured decode graph (empty without CUDA graphs)."""
        return self.graphs.batch_sizes if self.graphs is not None else []

    # --- setup ---------------------------------------------------------------------------------------------
    def _want_graphs(self, cuda_graphs: bool | str) -> bool:
        if cuda_graphs not in ("auto", True, False):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}; allowed: 'auto', True, False")
        if cuda_graphs == "auto":
            return self.device.type == "cuda" and not self._dequantise
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device: CUDA graphs do not exist on the CPU "
                             "(use cuda_graphs='auto' or False)")
        if cuda_graphs and self._dequantise:
            raise ValueError(f"cuda_graphs=True needs a cache stored in the model's dtype; this one is "
                             f"{self.cache.fmt.name} (dequantised per step, not capturable)")
        return bool(cuda_graphs)

    # --- inputs ---------------------------------------------------------------------------------------------
    def prepare(self, seqs: Sequence[KVSequence], num_tokens: Sequence[int], num_decode: int,
                pad_to: int | None = None, width: int | None = None, pad_tokens: int | None = None,
                logits_per_seq: Sequence[int] | None = None) -> ModelInput:
        """A ``ModelInput`` computing the next ``num_tokens[i]`` uncomputed tokens of each sequence of ``seqs``
        (slots reserved already). ``pad_to`` adds padding sequences (context 1, scratch-block tables) and as many token
        rows (scratch slot, position 0); ``pad_tokens`` pads the token rows to that count instead; ``width`` fixes
        the block-table width. A padded all-decode step stays all-decode (each padding sequence decodes its one
        padding row), exactly as the captured decode graph of ``pad_to`` rows runs it: the same attention kernel,
        so an eager step and its replay are comparable row for row. ``logits_per_seq``: logits of each sequence's last
        that many rows (``pack_step``)."""
        if width is not None:
            self._check_width(seqs, width)
        if pad_to is not None and pad_tokens is None and num_decode == len(seqs):
            num_decode = pad_to
        return ModelInput.build(self.cache, seqs, num_tokens, num_decode, num_seqs=pad_to, width=width,
                                num_rows=pad_tokens, scratch_block=self.scratch_block or 0, kernel_log=self.kernel_log,
                                logits_per_seq=logits_per_seq)

    def _check_width(self, seqs, width: int) -> None:
        if any(len(s.block_table) > width for s in seqs):
            raise ValueError(f"a sequence holds {max(len(s.block_table) for s in seqs)} blocks, more than "
                             f"max_model_len={self.max_model_len} allows ({width} blocks of {self.cache.block_size})")

    def pack_for_graphs(self, seqs: Sequence[KVSequence], num_tokens: Sequence[int]) -> tuple[np.ndarray, ...]:
        """The step packed for ``StepGraphs.run_packed`` (``pack_step`` in the static buffers' shape, tables
        ``max_blocks`` wide): ``(longs, ints)``."""
        self._check_width(seqs, self.max_blocks)
        n_seqs, n_rows = self.graphs.static_shape
        return pack_step(seqs, num_tokens, self.cache.block_size, num_seqs=n_seqs, num_rows=n_rows,
                         width=self.max_blocks, scratch_block=self.scratch_block or 0)

    # --- the step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seqs: Sequence[KVSequence], num_tokens: Sequence[int], num_decode: int,
                sampled: torch.Tensor | None = None, logits_per_seq: Sequence[int] | None = None) -> torch.Tensor:
        """Compute the next ``num_tokens[i]`` tokens of each sequence (their K/V written to the cache); returns
        float32 logits of each sequence's last computed token ``[num_seqs, vocab]`` (a tensor of the caller's own,
        also after a graph replay). Advancing the sequences' computed counts is the caller's (the scheduler's
        postprocess: ``cache.mark_computed``). A step replays a CUDA graph when one is captured for its shape
        (``StepGraphs.lookup``).

        ``sampled`` (async scheduling): the previous step's sampled tokens, int64 ``[k]`` on the device. A sequence
        whose last token the host has not read yet holds ``labkit.model.attention.placeholder(j)`` there; its input
        row is read from ``sampled[j]`` on the device (``fill_placeholders``) after the inputs are copied. Nothing is
        read back to the host.

        ``logits_per_seq``: the logits of each sequence's last that many rows instead (``[sum, vocab]``; speculative
        decoding's verify step). Where it asks for every row (no prefill chunk beside the verify rows) the step replays
        a verify graph (``graph_verify_sizes``), whose rows are the step's token rows in order; else it runs eagerly."""
        all_logits = logits_per_seq is not None and list(logits_per_seq) == list(num_tokens)
        key = None
        if self.graphs is not None and (logits_per_seq is None or all_logits):
            key = self.graphs.lookup(len(seqs), sum(num_tokens), num_decode, all_logits=all_logits)
        self.last_step_replayed = key is not None
        if key is not None:  # packed on the host in the static buffers' layout: two copies feed the graph
            longs, ints = self.pack_for_graphs(seqs, num_tokens)
            rows = sum(num_tokens) if all_logits else len(seqs)
            return self.graphs.run_packed(longs, ints, key, rows, sampled=sampled)  # a copy of the real rows
        if logits_per_seq is not None:
            return self.forward(self.prepare(seqs, num_tokens, num_decode, logits_per_seq=logits_per_seq))
        inp = self.prepare(seqs, num_tokens, num_decode)
        if sampled is not None:
            fill_placeholders(inp.input_ids, sampled)
        return self.forward(inp)

    def forward(self, inp: ModelInput, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model over ``inp`` (no bookkeeping): float32 logits ``[num_seqs (+ padding), vocab]`` (into ``out``
        when given)."""
        return self.model.forward_paged(inp, self.cache, out=out)
