"""The serving engine: requests in, tokens out, over one model and one paged KV cache.

* ``LLMEngine`` (llm_engine.py; settings: ``EngineConfig``, config.py): ``generate`` offline, ``add_request`` +
  ``step`` online
* schedulers (scheduler.py, policies.py): FIFO, static batches, continuous batching with chunked prefill and
  preemption by recompute or swap
* ``ModelRunner`` (model_runner.py) with CUDA graphs (cuda_graph.py); ``ModelInput`` (``labkit.model.attention``)
* ``SamplingParams`` / ``Sampler`` (sampling.py); requests, sequences and outputs (sequence.py)
* async scheduling (async_step.py) and speculative decoding (speculative.py, proposers.py): ``EngineConfig``
  settings

    from labkit.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model, tokenizer, max_num_seqs=64)
    outs = engine.generate(["def fib(n):"], SamplingParams(max_tokens=32))
"""

from labkit.engine.cuda_graph import (
    StepGraphs,
    default_graph_batch_sizes,
    default_graph_token_sizes,
    default_graph_verify_sizes,
)
from labkit.engine.llm_engine import EngineConfig, EngineStats, LLMEngine
from labkit.engine.model_runner import KERNELS, ModelRunner
from labkit.engine.policies import (
                                     SCHEDULERS,
                                     ContinuousBatchingScheduler,
                                     FIFOScheduler,
                                     StaticBatchScheduler,
                                     make_scheduler,
)
from labkit.engine.proposers import DraftModelProposer, PromptLookupProposer, Proposer
from labkit.engine.sampling import Sampler, SamplingParams
from labkit.engine.scheduler import PREEMPTION_MODES, ScheduledBatch, Scheduler
from labkit.engine.sequence import (
                                     FinishReason,
                                     Request,
                                     RequestMetrics,
                                     RequestOutput,
                                     Sequence,
                                     SequenceStatus,
                                     TokenOutput,
)
from labkit.engine.speculative import SPEC_METHODS, SpeculativeConfig, Speculator, accept
from labkit.model.attention import ModelInput

__all__ = ["LLMEngine", "EngineConfig", "EngineStats", "SamplingParams", "Sampler", "Request", "RequestMetrics",
           "RequestOutput", "TokenOutput", "Sequence", "SequenceStatus", "FinishReason", "Scheduler",
           "FIFOScheduler", "StaticBatchScheduler", "ContinuousBatchingScheduler", "ScheduledBatch", "make_scheduler",
           "SCHEDULERS", "PREEMPTION_MODES", "ModelRunner", "ModelInput", "KERNELS", "StepGraphs",
           "default_graph_batch_sizes", "default_graph_token_sizes", "default_graph_verify_sizes",
           "SpeculativeConfig", "Speculator", "SPEC_METHODS",
           "accept",
           "Proposer", "PromptLookupProposer", "DraftModelProposer"]
