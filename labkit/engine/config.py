"""The engine's settings (``EngineConfig``, vLLM's names, each checked when built), its run statistics
(``EngineStats``: counts, no times) and what the engine reads off the model: its vocabulary and EOS ids."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace

import torch

from labkit.checks import ArgumentTypeError, check_bool, check_choice, check_int, check_number, check_type
from labkit.engine.policies import SCHEDULERS
from labkit.engine.sampling import token_id_tuple
from labkit.engine.scheduler import PREEMPTION_MODES
from labkit.engine.speculative import SpeculativeConfig
from labkit.kvcache import kv_format
from labkit.model import FusionPlan
from labkit.model.build import eos_ids
from labkit.model.fusion import check_kernels


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (vLLM's names).

    * ``scheduler``: 'fifo', 'static' or 'continuous'; ``static_batch_size`` (default ``max_num_seqs``)
    * ``max_num_seqs``: running sequences at most; ``max_num_batched_tokens``: tokens per step (continuous)
    * ``chunked_prefill``: split long prompts over steps (continuous); ``min_admit``: admit waiting requests in
      groups of at least this many while others decode (continuous; see ``ContinuousBatchingScheduler``)
    * ``max_model_len``: prompt + output tokens at most (default: the model's maximum position)
    * ``block_size``, ``num_blocks``: the paged cache; ``num_blocks=None`` sizes it from
      ``gpu_memory_utilization`` of free device memory on CUDA, and for ``max_num_seqs`` full-length sequences
      (capped at 1 GiB) on the CPU
    * ``kernels``: a ``labkit.model.FusionPlan`` or 'auto' | 'torch' | 'triton' (resolved by ``CausalLM.use``);
      ``cuda_graphs``: 'auto' | True | False; ``graph_batch_sizes``:
      the captured all-decode batches (default ``default_graph_batch_sizes``); ``graph_token_sizes``: the
      captured steps with prefill chunks, by token count (default: ``default_graph_token_sizes`` of the token
      budget for the continuous scheduler on the Triton path, none otherwise); with ``speculative`` on the Triton
      path, verify steps are captured too (``default_graph_verify_sizes`` of ``max_num_seqs`` and ``k``, up to the
      token budget)
    * ``preemption_mode``: 'recompute' or 'swap' (continuous: what happens to the youngest sequence when blocks run
      out; see ``labkit.engine.scheduler``); ``swap_space``: GiB of CPU memory for swapped blocks (vLLM's name and
      default), at most the device cache's size, allocated only with ``preemption_mode='swap'``
    * ``seed``: seeds requests that bring none (``SamplingParams.seed``)
    * ``eos_token_ids``: ids that end a request (default: every EOS id of the model's config and generation
      config, else the tokenizer's; ``SamplingParams.eos_token_ids`` overrides per request)
    * ``async_scheduling``: overlap the host's work for the next step (scheduling, slots, inputs, reading the
      sampled tokens, stop checks) with the device's current step, as vLLM's async scheduling and SGLang's overlap
      scheduler do (``labkit.engine.async_step``); the tokens are the same, each reaches the host one step later
    * ``speculative``: a ``SpeculativeConfig`` to decode speculatively (``labkit.engine.speculative``: a proposer,
      ``num_speculative_tokens`` per step, per request through ``SamplingParams``; a draft model runs on a
      ``ModelRunner`` of its own, with CUDA graphs unless ``cuda_graphs`` is False), ``None`` not to
    """

    scheduler: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    min_admit: int = 1
    static_batch_size: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.85
    kv_dtype: str | None = None
    enable_prefix_caching: bool = False
    kernels: str | FusionPlan = "auto"
    cuda_graphs: bool | str = "auto"
    graph_batch_sizes: tuple[int, ...] | None = None
    graph_token_sizes: tuple[int, ...] | None = None
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    seed: int = 0
    eos_token_ids: tuple[int, ...] | None = None
    async_scheduling: bool = False
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        """Refuse any field of the wrong type or out of range, naming it, its value and what is allowed (nothing is
        coerced: ``max_model_len=0`` is an error, not the model's maximum)."""
        check_choice("scheduler", self.scheduler, SCHEDULERS)
        check_kernels(self.kernels)  # a plan, or one of its names (resolved once, when the engine is built)
        for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("min_admit", 1), ("block_size", 1),
                          ("seed", 0)):
            check_int(name, getattr(self, name), low)
        for name, low in (("static_batch_size", 1), ("max_model_len", 1), ("num_blocks", 2)):
            check_int(name, getattr(self, name), low, none_ok=True)  # None: the default
        for name in ("chunked_prefill", "enable_prefix_caching", "async_scheduling"):
            check_bool(name, getattr(self, name))
        if self.cuda_graphs != "auto" and not isinstance(self.cuda_graphs, bool):
            raise ArgumentTypeError(f"cuda_graphs={self.cuda_graphs!r}; allowed: 'auto', True, False")
        for name in ("graph_batch_sizes", "graph_token_sizes"):
            sizes = getattr(self, name)
            if sizes is not None:
                if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
                    raise ArgumentTypeError(f"{name}={sizes!r} must be a sequence of ints >= 1 (or None for the "
                                            f"default)")
                object.__setattr__(self, name, tuple(check_int(f"{name}[{i}]", v, 1) for i, v in enumerate(sizes)))
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_number("swap_space", self.swap_space, 0, low_open=True)  # GiB
        if self.kv_dtype is not None:
            kv_format(self.kv_dtype)
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", token_id_tuple("eos_token_ids", self.eos_token_ids))
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative={self.speculative!r:.80} must be a SpeculativeConfig or None")
        if self.speculative is not None and self.async_scheduling:
            # a verify step's accepted count decides the next step's inputs on the host: not overlapped yet
            raise ValueError("async_scheduling=True with speculative set: speculative decoding runs with "
                             "async_scheduling=False only")

    @property
    def seqs_per_step(self) -> int:
        """Sequences a step can hold under this scheduler."""
        static = self.max_num_seqs if self.static_batch_size is None else self.static_batch_size
        return {"fifo": 1, "static": static}.get(self.scheduler, self.max_num_seqs)


@dataclass
class EngineStats:
    """What the engine did since the last reset, counted (the times are a benchmark's: ``labkit.bench.serving``)."""

    steps: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    decode_tokens: int = 0
    output_tokens: int = 0
    scheduled_seqs: int = 0  # sequences summed over steps (over ``steps``: the mean batch)
    graph_steps: int = 0  # steps replayed from a CUDA graph
    discarded_tokens: int = 0  # async scheduling: tokens sampled for a request that had stopped one step earlier
    spec_decodes: int = 0  # decode rows that could speculate (given lookahead slots), summed over steps
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, accepted by the target

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 without proposals)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_spec_decode(self) -> float:
        """Tokens a speculating decode row emitted on average: 1 + accepted (E of the speedup model, where every
        row proposed its full k)."""
        return 1 + self.accepted_tokens / self.spec_decodes if self.spec_decodes else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def engine_config(model, config: EngineConfig | None, overrides: dict) -> EngineConfig:
    """An engine's arguments checked: ``model`` a torch module (``labkit.model.CausalLM`` or an HF causal LM),
    ``config`` (default ``EngineConfig()``) with the fields in ``overrides`` replaced; an error names the argument."""
    check_type("model", model, torch.nn.Module, "a labkit.model.CausalLM or a Hugging Face causal LM")
    config = EngineConfig() if config is None else check_type("config", config, EngineConfig)
    names = [f.name for f in fields(EngineConfig)]
    for k, v in overrides.items():
        if k not in names:
            raise ArgumentTypeError(f"{k}={v!r:.60} is not an engine setting; allowed: {names}")
    return replace(config, **overrides)


def vocab_size(model) -> int:
    """Token ids the model embeds: its input embedding's rows (``config.vocab_size`` without one)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.num_embeddings) if emb is not None else int(model.config.vocab_size)


def default_eos_token_ids(model, tokenizer=None) -> tuple[int, ...]:
    """Every EOS id the checkpoint declares (``labkit.model.build.eos_ids``); the tokenizer's without any."""
    ids = eos_ids(model)
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = (int(tokenizer.eos_token_id),)
    return ids

