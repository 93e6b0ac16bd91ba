"""Bad input at every public entry of ``labkit.model``, ``kvcache``, ``engine`` and ``plan``, tried as a new user
would: wrong types, negative or zero sizes, bools where ints are expected, strings where lists are, a device that
is not there. Each call must raise ``ValueError`` or ``TypeError`` (``labkit.checks.ArgumentTypeError`` is both)
whose message names the argument; nothing is accepted, wrapped or truncated.

An entry is a call that succeeds (``valid``) and the kind of each argument (``kinds``); ``BAD`` lists what a new
user would pass for each kind. Every bad value of every argument is tried alone, the others valid. ``EXTRA`` holds
the calls that are not one argument of a kind (the issue's list among them).
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from labkit.engine import (
    ContinuousBatchingScheduler,
    EngineConfig,
    FIFOScheduler,
    LLMEngine,
    PromptLookupProposer,
    Request,
    SamplingParams,
    StaticBatchScheduler,
    make_scheduler,
)
from labkit.hardware import get_hardware
from labkit.kvcache import (
    BlockAllocator,
    BlockManager,
    ContiguousKVCache,
    PagedKVCache,
    SeqBlocks,
    SwapSpace,
    block_hashes,
    hash_block,
    kv_format,
)
from labkit.model import ModelConfig, from_config, get_config, load_checkpoint, load_model, random_model
from labkit.model.shapes import dtype_bytes, dtype_name, human_bytes
from labkit.plan import NOMINAL, Cluster, decode_step_time, kv_read_time, min_tp, prefill_time, weight_paths
from labkit.workbook import list_notebooks

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(name="micro", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, max_position_embeddings=64)
BIG = get_config("llama-3-8b")
CUDA = torch.cuda.is_available()

BAD = {
    "count": [0, -5, 2.5, True, "4", None],  # an int >= 1
    "count_or_none": [0, -5, 2.5, True, "4"],
    "index": [-1, 2.5, True, "4", None],  # an int >= 0
    "size": [-3, "x", True, math.nan, None],  # a number >= 0
    "bool": ["yes", 1, None],
    "token_ids": [5, "abc", [1.5], [True], [-1], None],
    "device": ([] if CUDA else ["cuda"]) + [5, "tpu", [0]],
    "dtype": [[1], "fp7", 5],
    "choice": [5, "nope", ["bf16"]],
    "seq": [5, "abc", [1, 2], None],
    "model": ["not a model", 42, None],
}


class Fresh:
    """A valid argument made anew for each call (a sequence the call changes)."""

    def __init__(self, make):
        self.make = make


def fresh_seq():
    return Fresh(lambda: SeqBlocks([1, 2, 3]))


@dataclass
class Entry:
    name: str
    call: object  # called with the keyword arguments
    valid: dict
    kinds: dict  # argument -> key of BAD
    skip: tuple = ()  # (argument, bad value) pairs the entry accepts by design, each with its reason in a comment
    says: dict | None = None  # argument -> the word its message uses for it, where that is not its name


def paged(**kw):
    return PagedKVCache(**{**dict(num_layers=2, num_kv_heads=1, head_dim=16, num_blocks=8, block_size=4), **kw})


def held(cache, n=5):
    seq = SeqBlocks(list(range(n)), seq_id="s")
    cache.allocate(seq)
    return seq


def cluster(**kw):
    return Cluster(**{**dict(gpu=get_hardware("h200"), gpus_per_node=8, nodes=1), **kw})


def step_args(**kw):
    return {**dict(spec=BIG, cluster=cluster(), cal=NOMINAL, tp=1, pp=1, batch=8, context=512, weights="bf16",
                   kv="bf16"), **kw}


def _model():
    return from_config(CFG, dtype=torch.float32)


MODEL = _model()
CONFIG_FIELDS = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)

ENTRIES = [
    # --- model ------------------------------------------------------------------------------------------------
    Entry("ModelConfig", lambda **kw: ModelConfig(**kw), CONFIG_FIELDS | dict(num_kv_heads=1, sliding_window=None,
                                                                             max_position_embeddings=64,
                                                                             tie_word_embeddings=False,
                                                                             qkv_bias=False, model_type="llama"),
          dict(vocab_size="count", hidden_size="count", intermediate_size="count", num_layers="count",
               num_heads="count", num_kv_heads="count_or_none", max_position_embeddings="count",
               sliding_window="count_or_none", tie_word_embeddings="bool", qkv_bias="bool", model_type="choice"),
          skip=(("num_kv_heads", None),)),  # None: as many KV heads as heads
    Entry("ModelConfig.kv_bytes", lambda **kw: CFG.kv_bytes(**kw), dict(tokens=10, dtype="bf16"),
          dict(tokens="size", dtype="dtype")),
    Entry("ModelConfig.prefill_flops", lambda **kw: CFG.prefill_flops(**kw), dict(prompt_len=10),
          dict(prompt_len="size")),
    Entry("ModelConfig.decode_flops_per_token", lambda **kw: CFG.decode_flops_per_token(**kw), dict(context=10),
          dict(context="size")),
    Entry("ModelConfig.weight_bytes", lambda **kw: CFG.weight_bytes(**kw), dict(dtype="bf16"),
          dict(dtype="dtype")),
    Entry("dtype_bytes", lambda **kw: dtype_bytes(**kw), dict(dtype="int8"), dict(dtype="dtype")),
    Entry("dtype_name", lambda **kw: dtype_name(**kw), dict(dtype="fp16"), dict(dtype="dtype")),
    Entry("human_bytes", lambda **kw: human_bytes(**kw), dict(n=1024), dict(n="size")),
    Entry("get_config", lambda **kw: get_config(**kw), dict(preset_or_model="tiny"),
          dict(preset_or_model="choice")),
    Entry("from_config", lambda **kw: from_config(**kw), dict(cfg=CFG, device="cpu", dtype="fp32", seed=0,
                                                              merge_qkv=True),
          dict(device="device", dtype="dtype", seed="index", merge_qkv="bool")),
    Entry("load_checkpoint", lambda **kw: load_checkpoint(**kw), dict(path=None, device="cpu", dtype="fp32",
                                                                      merge_gate_up=True),
          dict(device="device", dtype="dtype", merge_gate_up="bool")),
    Entry("load_model", lambda **kw: load_model(**kw), dict(name_or_path=None, device="cpu", dtype="fp32"),
          dict(name_or_path="model", device="device", dtype="dtype"),
          skip=(("name_or_path", None),)),  # None: the embedded model
    Entry("random_model", lambda **kw: random_model(**kw), dict(preset=CFG, device="meta", dtype="fp32",
                                                                num_layers=1, seed=0),
          dict(preset="choice", dtype="dtype", num_layers="count_or_none", seed="index")),
    Entry("CausalLM.make_cache", lambda **kw: MODEL.make_cache(**kw), dict(num_blocks=4, block_size=4),
          dict(num_blocks="count", block_size="count")),
    # --- kvcache ----------------------------------------------------------------------------------------------
    Entry("PagedKVCache", lambda **kw: paged(**kw),
          dict(num_layers=2, num_kv_heads=1, head_dim=16, num_blocks=8, block_size=4, kv_dtype="fp32", device="cpu",
               enable_prefix_caching=False, allocate_pools=True),
          dict(num_layers="count", num_kv_heads="count", head_dim="count", num_blocks="count", block_size="count",
               kv_dtype="dtype", device="device", enable_prefix_caching="bool", allocate_pools="bool")),
    Entry("BlockManager", lambda **kw: BlockManager(**kw), dict(num_blocks=8, block_size=4,
                                                                enable_prefix_caching=True),
          dict(num_blocks="count", block_size="count", enable_prefix_caching="bool")),
    Entry("BlockAllocator", lambda **kw: BlockAllocator(**kw), dict(num_blocks=4), dict(num_blocks="count")),
    Entry("BlockAllocator.allocate", lambda **kw: BlockAllocator(4).allocate(**kw), dict(n=2), dict(n="index")),
    Entry("SeqBlocks", lambda **kw: SeqBlocks(**kw), dict(token_ids=[1, 2, 3]), dict(token_ids="token_ids")),
    Entry("PagedKVCache.allocate", lambda **kw: paged().allocate(**kw), dict(seq=fresh_seq()),
          dict(seq="seq")),
    Entry("PagedKVCache.append_slots", lambda **kw: paged().append_slots(**kw), dict(seq=fresh_seq()),
          dict(seq="seq")),
    Entry("PagedKVCache.blocks_needed", lambda **kw: paged().blocks_needed(**kw), dict(seq=fresh_seq()),
          dict(seq="seq")),
    Entry("PagedKVCache.free", lambda **kw: (lambda c: c.free(kw["seq"] if "seq" in kw else held(c)))(paged()),
          {}, dict(seq="seq")),
    Entry("PagedKVCache.blocks_for", lambda **kw: paged().blocks_for(**kw), dict(num_tokens=5),
          dict(num_tokens="index")),
    Entry("PagedKVCache.slots", lambda **kw: (lambda c: c.slots(held(c), **kw))(paged()), dict(start=0, end=2),
          dict(start="index", end="index")),
    Entry("PagedKVCache.mark_computed", lambda **kw: (lambda c: c.mark_computed(held(c), **kw))(paged()),
          dict(num_computed=2), dict(num_computed="index")),
    Entry("PagedKVCache.rollback", lambda **kw: (lambda c: c.rollback(held(c), **kw))(paged()),
          dict(num_tokens=2), dict(num_tokens="index")),
    Entry("ContiguousKVCache", lambda **kw: ContiguousKVCache(**kw),
          dict(num_layers=2, num_kv_heads=1, head_dim=16, max_seqs=2, max_len=8, dtype=torch.float32, device="cpu"),
          dict(num_layers="count", num_kv_heads="count", head_dim="count", max_seqs="count", max_len="count",
               dtype="dtype", device="device")),
    Entry("SwapSpace", lambda **kw: SwapSpace(paged(), **kw), dict(num_blocks=4), dict(num_blocks="count")),
    Entry("kv_format", lambda **kw: kv_format(**kw), dict(kv_dtype="int8"), dict(kv_dtype="dtype")),
    Entry("block_hashes", lambda **kw: block_hashes(**kw), dict(token_ids=[1, 2, 3, 4], block_size=2),
          dict(token_ids="token_ids", block_size="count")),
    Entry("hash_block", lambda **kw: hash_block(**kw), dict(token_ids=[1, 2]), dict(token_ids="token_ids")),
    # --- engine -----------------------------------------------------------------------------------------------
    Entry("SamplingParams", lambda **kw: SamplingParams(**kw),
          dict(temperature=0.5, top_k=0, max_tokens=4, stop_token_ids=[3], ignore_eos=False, seed=None,
               eos_token_ids=None),
          dict(temperature="size", top_k="index", max_tokens="count", stop_token_ids="token_ids",
               ignore_eos="bool", seed="index", eos_token_ids="token_ids"),
          skip=(("seed", None), ("eos_token_ids", None))),  # None: the engine's seed / EOS ids
    Entry("EngineConfig", lambda **kw: EngineConfig(**kw),
          dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=None, max_model_len=None,
               chunked_prefill=True, enable_prefix_caching=False, seed=0, eos_token_ids=None, scheduler="fifo",
               preemption_mode="swap", swap_space=1.0, kv_dtype=None, min_admit=1),
          dict(max_num_seqs="count", max_num_batched_tokens="count", block_size="count", num_blocks="count_or_none",
               max_model_len="count_or_none", chunked_prefill="bool", enable_prefix_caching="bool", seed="index",
               eos_token_ids="token_ids", scheduler="choice", preemption_mode="choice", swap_space="size",
               kv_dtype="dtype", min_admit="count"),
          skip=(("eos_token_ids", None),)),  # None: the model's EOS ids
    Entry("Request", lambda **kw: Request(**kw), dict(request_id=0, prompt_token_ids=[1, 2]),
          dict(request_id="index", prompt_token_ids="token_ids")),
    Entry("LLMEngine", lambda **kw: LLMEngine(**kw), dict(model=MODEL, num_blocks=16, block_size=4, max_num_seqs=2,
                                                          max_num_batched_tokens=32),
          dict(model="model", num_blocks="count_or_none", block_size="count", max_num_seqs="count")),
    Entry("make_scheduler", lambda **kw: make_scheduler(cache=paged(), **kw),
          dict(name="continuous", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=None, min_admit=1,
               chunked_prefill=True),
          dict(name="choice", max_num_seqs="count", max_num_batched_tokens="count", max_model_len="count_or_none",
               min_admit="count", chunked_prefill="bool"), says=dict(name="scheduler")),
    Entry("FIFOScheduler", lambda **kw: FIFOScheduler(**kw), dict(cache=paged(), max_num_seqs=2),
          dict(cache="seq", max_num_seqs="count")),
    Entry("StaticBatchScheduler", lambda **kw: StaticBatchScheduler(paged(), **kw), dict(batch_size=2),
          dict(batch_size="count")),
    Entry("ContinuousBatchingScheduler", lambda **kw: ContinuousBatchingScheduler(paged(), **kw),
          dict(max_num_seqs=2, max_num_batched_tokens=16, watermark=0.0, num_cpu_blocks=None,
               preemption_mode="recompute"),
          dict(max_num_seqs="count", max_num_batched_tokens="count", watermark="size",
               num_cpu_blocks="count_or_none", preemption_mode="choice")),
    Entry("PromptLookupProposer", lambda **kw: PromptLookupProposer(**kw), dict(max_ngram=3, min_ngram=1),
          dict(max_ngram="count", min_ngram="count")),
    # --- plan -------------------------------------------------------------------------------------------------
    Entry("Cluster", lambda **kw: cluster(**kw), dict(gpus_per_node=8, nodes=1, intra="nvlink4"),
          dict(gpus_per_node="count", nodes="count", intra="choice")),
    Entry("decode_step_time", lambda **kw: decode_step_time(**step_args(**kw)),
          dict(tp=1, pp=1, batch=8, context=512, weights="bf16", kv="bf16", microbatches=None),
          dict(tp="count", pp="count", batch="count", context="count", weights="choice", kv="choice",
               microbatches="count_or_none")),
    Entry("kv_read_time", lambda **kw: kv_read_time(**{k: v for k, v in step_args(**kw).items() if k != "weights"}),
          dict(batch=8, context=512, kv="bf16"), dict(batch="count", context="count", kv="choice")),
    Entry("weight_paths", lambda **kw: weight_paths(**{k: v for k, v in step_args(**kw).items() if k != "kv"}),
          dict(batch=8, context=512), dict(batch="count", context="count")),
    Entry("prefill_time", lambda **kw: prefill_time(BIG, cluster(), NOMINAL, **kw),
          dict(tp=1, pp=1, prompt_len=512, weights="bf16"),
          dict(tp="count", pp="count", prompt_len="count", weights="choice")),
    Entry("min_tp", lambda **kw: min_tp(**kw), dict(spec="llama-3-8b", gpu="h200", dtype="bf16"),
          dict(spec="choice", gpu="choice", dtype="dtype")),
]


def _expand():
    for e in ENTRIES:
        for arg, kind in e.kinds.items():
            for bad in BAD[kind]:
                if (arg, bad) in e.skip:
                    continue
                yield pytest.param(e, arg, bad, id=f"{e.name}-{arg}={bad!r}")


def _args(kw: dict) -> dict:
    return {k: v.make() if isinstance(v, Fresh) else v for k, v in kw.items()}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_valid_call_passes(entry):
    entry.call(**_args(entry.valid))


@pytest.mark.parametrize("entry,arg,bad", list(_expand()))
def test_bad_argument_is_refused_by_name(entry, arg, bad):
    with pytest.raises((ValueError, TypeError)) as err:
        entry.call(**_args({**entry.valid, arg: bad}))
    assert (entry.says or {}).get(arg, arg) in str(err.value), f"{type(err.value).__name__}: {err.value}"


EXTRA = [
    # the list, where the kind of argument alone does not say it
    ("PagedKVCache.allocate(SeqBlocks('abc'))", lambda: paged().allocate(SeqBlocks("abc")), "token_ids"),
    ("PagedKVCache.allocate(seq holding blocks)", lambda: (lambda c: c.allocate(held(c)))(paged()), "seq"),
    ("ModelConfig(num_heads=3, num_kv_heads=2)", lambda: ModelConfig(**{**CONFIG_FIELDS, "num_heads": 3},
                                                                     num_kv_heads=2, head_dim=8), "num_kv_heads"),
    ("SamplingParams(top_p=0)", lambda: SamplingParams(top_p=0), "top_p"),
    ("SamplingParams(top_p=1.5)", lambda: SamplingParams(top_p=1.5), "top_p"),
    ("EngineConfig(gpu_memory_utilization=0)", lambda: EngineConfig(gpu_memory_utilization=0),
     "gpu_memory_utilization"),
    ("EngineConfig(cuda_graphs='yes')", lambda: EngineConfig(cuda_graphs="yes"), "cuda_graphs"),
    ("EngineConfig(graph_batch_sizes=(1, 0))", lambda: EngineConfig(graph_batch_sizes=(1, 0)), "graph_batch_sizes"),
    ("EngineConfig(kernels='cuda')", lambda: EngineConfig(kernels="cuda"), "kernels"),
    ("LLMEngine.add_request('abc') without tokenizer",
     lambda: LLMEngine(MODEL, num_blocks=16, block_size=4, max_num_seqs=2).add_request("abc"), "prompt"),
    ("LLMEngine.add_request(5)", lambda: LLMEngine(MODEL, num_blocks=16, block_size=4).add_request(5), "prompt"),
    ("LLMEngine.add_request(params=greedy)",
     lambda: LLMEngine(MODEL, num_blocks=16, block_size=4).add_request([1], "greedy"), "params"),
    ("LLMEngine.generate('one string')", lambda: LLMEngine(MODEL, num_blocks=16, block_size=4).generate("abc"),
     "prompts"),
    ("LLMEngine(config='fast')", lambda: LLMEngine(MODEL, config="fast"), "config"),
    ("LLMEngine(unknown=1)", lambda: LLMEngine(MODEL, unknown=1), "unknown"),
    ("decode_step_time(context=-100)", lambda: decode_step_time(**step_args(context=-100)), "context"),
    ("Cluster(gpu='h200')", lambda: Cluster(gpu="h200"), "gpu"),
]


@pytest.mark.parametrize("call,name", [pytest.param(c, n, id=i) for i, c, n in EXTRA])
def test_bad_call_is_refused_by_name(call, name):
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert name in str(err.value), f"{type(err.value).__name__}: {err.value}"


def test_only_needs_a_value():
    for only in ([], "01"):  # an empty selection is not every notebook; a string is not a list
        with pytest.raises(ValueError, match="only="):
            list_notebooks(only)


def test_run_only_needs_a_value_on_the_command_line():
    """``python -m labkit run --only`` with no value is a usage error (exit 2), not a run of every notebook."""
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "--only"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--only" in r.stderr


def test_check_int_takes_every_integral_but_bool():
    """The exact-type fast path of ``labkit.checks`` (``type(v) is int``) must not change what passes: numpy and
    other ``numbers.Integral`` values still do, bools, floats, strings and tensors still do not."""
    import numpy as np

    from labkit.checks import ArgumentTypeError, check_int

    for ok in (0, 7, np.int64(3), np.int32(5)):
        assert check_int("n", ok) == int(ok) and type(check_int("n", ok)) is int
    for bad in (True, False, 2.0, "3", torch.tensor(3), None):
        with pytest.raises(ArgumentTypeError, match="n="):
            check_int("n", bad)
