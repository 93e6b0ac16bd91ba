"""CUDA-graph decode steps: bucket sizes and lookup everywhere; on CUDA, replayed steps give the eager steps' logits
(fp32 on the embedded model, bf16 on 4 layers of the Llama-3-8B shape), with a padding row in the batch.

On the CPU, ``HostGraphs`` runs the real ``StepGraphs`` buffer logic with a stand-in for ``torch.cuda.CUDAGraph``
that behaves as a graph does where it matters: a replay re-runs the step on the *captured* static inputs and writes
into the *captured* output tensor (fixed addresses), a replay of one bucket may clobber the others' outputs (one
shared pool), and everything a capture freezes (each op's shapes and non-tensor arguments, each Triton launch's grid
and scalars) must be the same at every replay; reading a device value on the host or building a tensor from host
data inside the step fails at once. So a step input not copied into its static buffer, a buffer re-allocated after
capture, a host value baked into the step, or a caller keeping the graph's output buffer all fail here on the CPU.
"""

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.engine.cuda_graph import (
    GraphKey,
    StepGraphs,
    default_graph_batch_sizes,
    default_graph_token_sizes,
    default_graph_verify_sizes,
)
from labkit.engine.model_runner import ModelRunner
from labkit.evaluate import relative_error
from labkit.kvcache import PagedKVCache, SeqBlocks
from labkit.model.attention import pack_step


def nan_cache(model, **kw) -> PagedKVCache:
    cache = PagedKVCache.for_model(model, **kw)
    for t in cache.k_caches + cache.v_caches:
        t.fill_(float("nan"))  # a slot read before it is written poisons the output
    return cache


def test_bucket_sizes_and_lookup():
    assert default_graph_batch_sizes(1) == [1]
    assert default_graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_graph_batch_sizes(256)[-3:] == [192, 224, 256]
    graphs = SimpleNamespace(batch_sizes=[1, 2, 4, 8])
    assert [StepGraphs.bucket(graphs, n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert default_graph_token_sizes(100) == [16, 32, 64, 100]
    sizes = default_graph_token_sizes(2048)
    assert sizes[:6] == [16, 32, 64, 128, 192, 256] and sizes[-3:] == [1536, 1792, 2048] and len(sizes) == 18
    graphs = SimpleNamespace(batch_sizes=[1, 2, 4], token_sizes=[16, 64], runner=SimpleNamespace(max_num_seqs=4))
    graphs.bucket = partial(StepGraphs.bucket, graphs)
    lookup = partial(StepGraphs.lookup, graphs)
    assert lookup(3, 3, 3) == GraphKey("decode", 4, 4)  # all decode: the batch bucket
    assert lookup(3, 20, 2) == GraphKey("mixed", 4, 64)  # a prefill chunk: the token bucket, seqs up to 4
    assert lookup(1, 9, 0) == GraphKey("mixed", 4, 16)
    assert lookup(5, 5, 5) is None and lookup(2, 65, 1) is None  # too many sequences or tokens: eager
    assert default_graph_verify_sizes(40, 4) == [5, 10, 20, 40, 80, 160, 200]
    graphs.verify_sizes = [5, 10, 20]
    assert lookup(3, 9, 1, all_logits=True) == GraphKey("verify", 4, 10)  # every row's logits: the verify bucket
    assert lookup(1, 2, 0, all_logits=True) == GraphKey("verify", 4, 5)
    assert lookup(3, 21, 1, all_logits=True) is None and lookup(5, 10, 0, all_logits=True) is None


pytestmark = pytest.mark.usefixtures("one_thread")


# --- a host stand-in for CUDA graphs ----------------------------------------------------------------------------
class HostReadError(AssertionError):
    pass


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Recorder(TorchDispatchMode):
    """Records every torch op (and, through ``recorded``, every Triton launch) with what a captured launch freezes
    of its arguments; refuses host reads of device values and tensors built from host data."""

    def __init__(self):
        super().__init__()
        self.trace = []
        self.made: set[int] = set()  # storages the step allocated (a graph's pool: fixed, but new on each re-run)

    def frozen(self, x):
        """A tensor's layout, and its address unless the step made it (static inputs, KV pools and weights must
        stay where the capture saw them: a re-bound buffer is invisible to a graph); other values as they are."""
        if isinstance(x, torch.Tensor):
            where = "made in the step" if _storage(x) in self.made else _storage(x)
            return "tensor", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, where
        if isinstance(x, (list, tuple)):
            return type(x).__name__, tuple(self.frozen(y) for y in x)
        if isinstance(x, dict):
            return tuple((k, self.frozen(v)) for k, v in x.items())
        if isinstance(x, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
            return repr(x)
        return type(x).__name__  # storages and the like: the Triton interpreter's plumbing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            raise HostReadError("the captured step reads a device value on the host (.item(), int(), bool()): a "
                                "graph would replay the value seen at capture")
        if func is torch.ops.aten.lift_fresh.default:
            raise HostReadError("the captured step builds a tensor from host data (torch.tensor(list)): a graph "
                                "replays it as the constant seen at capture")
        self.trace.append((str(func), self.frozen(args), self.frozen(kwargs)))
        out = func(*args, **kwargs)
        if func is not torch.ops.aten.set_.source_Storage_storage_offset:  # set_ points at an existing storage
            seen = {_storage(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor) and _storage(t) not in seen and _storage(t):
                    self.made.add(_storage(t))  # a new allocation, not a view or an in-place result
        return out


def recorded(step, monkeypatch):
    """``step()`` under a ``Recorder``, with ``Tensor.tolist`` refused and Triton launches recorded."""
    import triton.runtime.interpreter as interp

    rec = Recorder()
    call = interp.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        grid = self.grid if not callable(self.grid) else "callable"
        rec.trace.append(("triton:" + self.fn.__name__, rec.frozen(grid), rec.frozen(args), rec.frozen(kwargs)))
        return call(self, *args, **kwargs)

    def tolist(self):
        raise HostReadError("the captured step copies a device tensor to the host (.tolist()): a graph would "
                            "replay the values seen at capture")

    with monkeypatch.context() as m, torch.inference_mode():  # as StepGraphs captures (ops differ outside it)
        m.setattr(interp.GridExecutor, "__call__", launch)
        m.setattr(torch.Tensor, "tolist", tolist)
        with rec:
            out = step()
    return out, rec.trace


class HostGraph:
    """``torch.cuda.CUDAGraph`` on the CPU (see the module docstring)."""

    def __init__(self, pool: list, monkeypatch):
        self.pool, self.mp, self.replays = pool, monkeypatch, 0

    def capture(self, step) -> torch.Tensor:
        self.step = step
        self.out, self.trace = recorded(step, self.mp)
        self.pool.append(self.out)
        return self.out

    @torch.inference_mode()
    def replay(self) -> None:
        out, trace = recorded(self.step, self.mp)
        out = out.clone()  # the step wrote into the output buffer every bucket shares, about to be NaN-filled
        for i, (a, b) in enumerate(zip(self.trace, trace)):
            assert a == b, f"op {i} of the step differs from its capture (a host value or a buffer's address baked " \
                           f"into the graph): captured {a}, now {b}"
        assert len(trace) == len(self.trace), "the step launches a different number of ops than at capture"
        for other in self.pool:  # one pool: a replay may reuse the memory of any other bucket's output
            if other is not self.out:
                other.fill_(float("nan"))
        self.out.copy_(out)
        self.replays += 1


class HostGraphs(StepGraphs):
    """``StepGraphs`` with ``HostGraph`` for the CUDA calls."""

    def __init__(self, runner, batch_sizes, monkeypatch, token_sizes=(), verify_sizes=()):
        self.mp, self.pool = monkeypatch, []
        super().__init__(runner, batch_sizes, token_sizes, verify_sizes)

    @staticmethod
    def _check_device(runner) -> None:
        pass

    def _new_graph(self):
        return HostGraph(self.pool, self.mp)

    def _capture_into(self, graph, pool, step):
        assert pool is None or pool is self.pool
        return graph.capture(step)

    def _pool(self, graph):
        return self.pool

    def _synchronize(self) -> None:
        pass

    @staticmethod
    def _pool_bytes(pool) -> int:
        return 0


def host_graph_runner(model, cache, monkeypatch, sizes=(1, 2, 4), token_sizes=(), runner=ModelRunner,
                      graphs=None, verify_sizes=(), **kw) -> ModelRunner:
    """A ``runner`` (``ModelRunner`` or a subclass) whose steps replay ``graphs`` (``HostGraphs`` or a subclass)."""
    runner = runner(model, cache, cuda_graphs=False, **kw)
    runner.graphs = (graphs or HostGraphs)(runner, list(sizes), monkeypatch, list(token_sizes), list(verify_sizes))
    return runner


def static_ptrs(graphs) -> list[int]:
    s = graphs.static
    return [t.data_ptr() for t in (s.input_ids, s.positions, s.slot_mapping, s.block_tables, s.context_lens,
                                   s.query_start_loc, s.logits_indices)]


def owned_by_graphs(graphs, outs) -> list[int]:
    """Indices of ``outs`` that share memory with a graph's output buffer (rewritten by later replays)."""
    buffers = {t.untyped_storage().data_ptr() for t in graphs.logits.values()}
    return [i for i, o in enumerate(outs) if o.untyped_storage().data_ptr() in buffers]


def run(runner, seqs, counts, num_decode):
    """A step as the engine runs it: the runner computes it, then the computed counts advance."""
    logits = runner.execute(seqs, counts, num_decode)
    for seq, n in zip(seqs, counts):
        runner.cache.mark_computed(seq, seq.num_computed + n)
    return logits


def feed(cache, seqs, tokens) -> None:
    for seq, t in zip(seqs, tokens):
        seq.token_ids.append(t)
        cache.append_slots(seq)


def decode_steps(runner, cache, prompts, steps) -> list[torch.Tensor]:
    """Prefill ``prompts`` (eager), then one decode step per row of ``steps`` (the same fed tokens for every
    runner) over all sequences, then sequence 0 alone and sequences 0, 1 (other buckets). Returns every step's
    logits as returned, kept until the end."""
    seqs = [SeqBlocks(p, i) for i, p in enumerate(prompts)]
    for seq in seqs:
        cache.allocate(seq)
    out = [run(runner, seqs, [len(p) for p in prompts], 0)]
    for t in steps:
        feed(cache, seqs, t)
        out.append(run(runner, seqs, [1] * len(seqs), len(seqs)))
    for n in (1, 2, len(seqs)):
        feed(cache, seqs[:n], steps[0])
        out.append(run(runner, seqs[:n], [1] * n, n))
    return out


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_host_graphs_replay_equals_eager(tiny_model, two_layers, monkeypatch, kernels):
    """The GPU test's sequence on the CPU: batch 3 replays the graph of 4 (a padding row), then buckets 1 and 2;
    logits kept across later replays must stay each step's own. Triton: through the interpreter, on two layers."""
    model = tiny_model[0] if kernels == "torch" else two_layers
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    n_steps = 5 if kernels == "torch" else 2
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 33, 17)]
    steps = torch.randint(3, vocab, (n_steps, 3), generator=g).tolist()
    eager_cache = nan_cache(model, num_blocks=64, block_size=16)
    eager = decode_steps(ModelRunner(model, eager_cache, kernels="torch", max_model_len=128), eager_cache, prompts,
                         steps)
    cache = nan_cache(model, num_blocks=64, block_size=16)
    runner = host_graph_runner(model, cache, monkeypatch, kernels=kernels, max_model_len=128)
    graphs, ptrs = runner.graphs, static_ptrs(runner.graphs)
    assert runner.graph_batch_sizes == [1, 2, 4] and runner.scratch_block is not None
    got = decode_steps(runner, cache, prompts, steps)
    replays = [graphs.graphs[GraphKey("decode", b, b)].replays for b in (1, 2, 4)]
    assert replays == [1, 1, n_steps + 1]  # every decode step replayed
    assert static_ptrs(graphs) == ptrs  # fed by copying into the buffers captured, never by re-binding them
    assert not owned_by_graphs(graphs, got)
    for i, (a, b) in enumerate(zip(got, eager)):
        assert a.shape == b.shape and torch.isfinite(a).all(), i
        assert relative_error(a, b) <= 1e-5, f"step {i}: relative error {relative_error(a, b):.3g}"


def mixed_steps(runner, cache, prompts, fed, replayed: list | None = None) -> list[torch.Tensor]:
    """Continuous batching's step shapes: two prompts prefilled in one step, then two steps that decode them while
    a third prompt arrives in two chunks (the second completes it), then a decode step of all three. Returns every
    step's logits as returned, kept until the end; appends whether each step replayed a graph to ``replayed``."""
    out = []
    seqs = [SeqBlocks(p, i) for i, p in enumerate(prompts)]

    def step(seqs, counts, num_decode):
        out.append(run(runner, seqs, counts, num_decode))
        if replayed is not None:
            replayed.append(runner.last_step_replayed)

    for seq in seqs[:2]:
        cache.allocate(seq)
    step(seqs[:2], [len(prompts[0]), len(prompts[1])], 0)
    cache.allocate(seqs[2])
    first = len(prompts[2]) // 2
    for t, chunk in zip(fed, (first, len(prompts[2]) - first)):
        feed(cache, seqs[:2], t)
        step(seqs, [1, 1, chunk], 2)
    feed(cache, seqs, fed[2])
    step(seqs, [1, 1, 1], 3)
    return out


def test_host_graphs_replay_mixed_steps(two_layers, monkeypatch):
    """Steps that carry prefill chunks replay the token-count graphs (Triton path, through the interpreter, on two
    layers): the same logits as the eager torch runner, the real rows only, every step replayed."""
    model = two_layers
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 33, 19)]
    fed = torch.randint(3, vocab, (3, 3), generator=g).tolist()
    eager_cache = nan_cache(model, num_blocks=64, block_size=16)
    eager = mixed_steps(ModelRunner(model, eager_cache, kernels="torch", max_model_len=128), eager_cache, prompts,
                        fed)
    cache = nan_cache(model, num_blocks=64, block_size=16)
    runner = host_graph_runner(model, cache, monkeypatch, sizes=(4,), token_sizes=(16, 64), kernels="triton",
                               max_num_seqs=4, max_model_len=128)
    graphs, ptrs = runner.graphs, static_ptrs(runner.graphs)
    got = mixed_steps(runner, cache, prompts, fed)
    replays = {k: graphs.graphs[k].replays for k in graphs.keys}
    assert replays == {GraphKey("decode", 4, 4): 1, GraphKey("mixed", 4, 16): 2, GraphKey("mixed", 4, 64): 1}
    assert static_ptrs(graphs) == ptrs and not owned_by_graphs(graphs, got)
    for i, (a, b) in enumerate(zip(got, eager)):
        assert a.shape == b.shape and torch.isfinite(a).all(), i
        assert relative_error(a, b) <= 1e-5, f"step {i}: relative error {relative_error(a, b):.3g}"


def test_engine_on_host_graphs_equals_hf_generate(two_layers, monkeypatch):
    """The continuous engine with both kinds of graphs (stand-ins, Triton through the interpreter, on two layers):
    prompts cut into chunks that share steps with decodes, every step replayed, greedy tokens equal to HF
    ``generate``'s."""
    from labkit.engine.llm_engine import LLMEngine
    from labkit.engine.sampling import SamplingParams
    from labkit.experiments.batching import hf_greedy

    model = two_layers
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 20, 4)]
    engine = LLMEngine(model, kernels="triton", cuda_graphs=False, max_num_seqs=2, max_num_batched_tokens=16,
                       num_blocks=16, max_model_len=32)
    engine.runner.graphs = HostGraphs(engine.runner, [1, 2], monkeypatch, [8, 16])
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), progress=False)
    assert [o.output_token_ids for o in outs] == [hf_greedy(model, p, 3) for p in prompts]
    st = engine.stats
    assert st.graph_steps == st.steps and st.prefill_tokens == 33  # each step replayed; nothing recomputed


def verify_steps(runner, cache, prompts, fed, replayed: list) -> list[torch.Tensor]:
    """Speculative decoding's verify steps as ``Speculator`` runs them (every row's logits asked for): the prompts
    prefilled in one step, then sequence 0 decoding plainly (one row) beside two sequences of 1 + n rows (pending
    token and n proposals; 9 rows, 3 sequences: a padding sequence and padding rows in the bucket of 10), two
    speculating alone (6 rows), one alone (5 rows: its own bucket), and last a verify step with a prefill chunk of a
    fourth prompt beside it (each chunk's last row only: eager). Every fed token is kept (as if accepted). Returns
    every step's logits as returned, kept until the end; appends whether each verify step replayed to ``replayed``."""
    seqs = [SeqBlocks(p, i) for i, p in enumerate(prompts)]
    for seq in seqs[:3]:
        cache.allocate(seq)
    out = [run(runner, seqs[:3], [len(p) for p in prompts[:3]], 0)]
    g = iter(fed)

    def step(idx, counts, num_decode, logits_per_seq=None):
        live = [seqs[i] for i in idx]
        for seq, c in zip(live, counts):
            if seq.num_tokens == seq.num_computed:  # a decoding sequence: its pending token and the proposals
                seq.token_ids.extend(next(g)[:c])
                cache.append_slots(seq)
        out.append(runner.execute(live, counts, num_decode, logits_per_seq=logits_per_seq or counts))
        replayed.append(runner.last_step_replayed)
        for seq, c in zip(live, counts):
            cache.mark_computed(seq, seq.num_computed + c)

    step([0, 1, 2], [1, 3, 5], 1)
    step([1, 2], [2, 4], 0)
    step([2], [5], 0)
    cache.allocate(seqs[3])
    step([0, 3], [3, len(prompts[3])], 0, logits_per_seq=[3, 1])
    return out


def test_host_graphs_replay_verify_steps(two_layers, monkeypatch):
    """Verify steps (every row's logits, no prefill chunk) replay the verify graphs (Triton path, through the
    interpreter, on two layers): row for row the eager torch runner's logits, the real rows only; a verify step with a
    prefill chunk beside it runs eagerly."""
    model = two_layers
    g = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 33, 19, 7)]
    fed = torch.randint(3, vocab, (12, 5), generator=g).tolist()
    eager_cache = nan_cache(model, num_blocks=64, block_size=16)
    eager = verify_steps(ModelRunner(model, eager_cache, kernels="torch", max_model_len=128), eager_cache, prompts,
                         fed, [])
    cache = nan_cache(model, num_blocks=64, block_size=16)
    runner = host_graph_runner(model, cache, monkeypatch, sizes=(4,), verify_sizes=(5, 10), kernels="triton",
                               max_num_seqs=4, max_model_len=128)
    graphs, ptrs, replayed = runner.graphs, static_ptrs(runner.graphs), []
    got = verify_steps(runner, cache, prompts, fed, replayed)
    assert replayed == [True, True, True, False]
    replays = {k: graphs.graphs[k].replays for k in graphs.keys}
    assert replays == {GraphKey("decode", 4, 4): 0, GraphKey("verify", 4, 5): 1, GraphKey("verify", 4, 10): 2}
    # one output buffer for every graph, as many rows as the largest step's logits (10 verify rows), not one each
    assert {graphs.logits[k].data_ptr() for k in graphs.keys} == {graphs.out.data_ptr()}
    assert tuple(graphs.out.shape) == (10, vocab)
    assert static_ptrs(graphs) == ptrs and not owned_by_graphs(graphs, got)
    assert [a.shape[0] for a in got] == [3, 9, 6, 5, 4]
    for i, (a, b) in enumerate(zip(got, eager)):
        assert a.shape == b.shape and torch.isfinite(a).all(), i
        assert relative_error(a, b) <= 1e-5, f"step {i}: relative error {relative_error(a, b):.3g}"


def test_speculating_engine_on_host_graphs_equals_plain(two_layers, monkeypatch):
    """An engine speculating with a draft (the target itself: every proposal is accepted, so every decode step
    speculates) on the stand-in graphs: the target's verify steps replay verify graphs and the draft's runner
    replays its decode and token-count graphs, every target step replays, and the greedy tokens equal plain
    decoding's (an eager engine without speculation)."""
    from labkit.engine import LLMEngine, SamplingParams, SpeculativeConfig

    model = two_layers
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = LLMEngine(model, kernels="torch", cuda_graphs=False, num_blocks=16, max_model_len=32)
    want = [o.output_token_ids for o in plain.generate(prompts, params, progress=False)]
    engine = LLMEngine(model, kernels="triton", cuda_graphs=False, max_num_seqs=2, num_blocks=16, max_model_len=32,
                       speculative=SpeculativeConfig("draft", 2, draft_model=model))
    assert engine.runner.graphs is None  # the CPU: no graphs unless given stand-ins
    engine.runner.graphs = HostGraphs(engine.runner, [1, 2], monkeypatch, [16], [3, 6])
    draft = engine.speculator.proposer.runner
    assert draft.graphs is None and draft.max_model_len == 32 and draft.max_num_seqs == 2
    draft.graphs = HostGraphs(draft, [1, 2], monkeypatch, [16])  # the catch-up steps: up to 2 x (k + 1) tokens
    outs = engine.generate(prompts, params, progress=False)
    assert [o.output_token_ids for o in outs] == want
    st = engine.stats
    assert st.draft_tokens > 0 and st.accepted_tokens == st.draft_tokens
    assert st.graph_steps == st.steps  # the prefill step too (the graph of 16 tokens): every step replayed
    assert sum(v.replays for k, v in engine.runner.graphs.graphs.items() if k.kind == "verify") > 0
    for kind in ("decode", "mixed"):  # the draft's one-token steps and each round's catch-up step
        assert sum(v.replays for k, v in draft.graphs.graphs.items() if k.kind == kind) > 0, kind


def test_token_graphs_need_the_triton_path(tiny_model, monkeypatch):
    model = tiny_model[0]
    with pytest.raises(ValueError, match="graph_token_sizes need the runner's Triton kernels"):
        host_graph_runner(model, nan_cache(model, num_blocks=8, block_size=16), monkeypatch, token_sizes=(16,),
                          kernels="torch")


def test_host_graphs_catch_host_values(tiny_model, monkeypatch):
    """The stand-in fails a step that reads device values on the host, bakes a per-step host value in, or reads a
    buffer re-allocated after capture."""
    model = tiny_model[0]

    class ReadsItem(ModelRunner):
        def forward(self, inp, out=None):
            _ = int(inp.context_lens.max())  # e.g. a split count picked from the longest context
            return super().forward(inp, out)

    class ReadsToList(ModelRunner):
        def forward(self, inp, out=None):
            _ = inp.positions.tolist()
            return super().forward(inp, out)

    class HostCounter(ModelRunner):  # a host value that changes per step, used in the step
        calls = 0

        def forward(self, inp, out=None):
            self.calls += 1
            return super().forward(inp, out).mul_(1 + self.calls % 2)

    for bad, match in ((ReadsItem, "reads a device value"), (ReadsToList, r"\.tolist\(\)")):
        with pytest.raises(HostReadError, match=match):
            host_graph_runner(model, nan_cache(model, num_blocks=8, block_size=16), monkeypatch, sizes=(1,),
                              runner=bad)
    runner = host_graph_runner(model, nan_cache(model, num_blocks=8, block_size=16), monkeypatch, sizes=(1,),
                               runner=HostCounter)
    with pytest.raises(AssertionError, match="differs from its capture"):
        runner.graphs.graphs[GraphKey("decode", 1, 1)].replay()
    cache = nan_cache(model, num_blocks=8, block_size=16)
    runner = host_graph_runner(model, cache, monkeypatch, sizes=(1,))
    runner.graphs.graphs[GraphKey("decode", 1, 1)].replay()
    cache.v_caches[3] = cache.v_caches[3].clone()  # a pool re-allocated after capture: the graph keeps the old one
    with pytest.raises(AssertionError, match=r"differs from its capture \(a host value or a buffer's address"):
        runner.graphs.graphs[GraphKey("decode", 1, 1)].replay()


def test_check_graph_replays_passes_and_catches_a_kept_output_buffer(tiny_model, monkeypatch):
    """Notebook 05's gate before timing graphs, on the stand-in: all rows ok; with ``run`` handing back the graph's
    output buffer (the bug the H200 found), kept logits of earlier steps fail; the very last step's still pass."""
    from labkit.experiments.batching import check_graph_replays

    model = tiny_model[0]
    runner = host_graph_runner(model, nan_cache(model, num_blocks=20, block_size=16), monkeypatch, max_model_len=64)
    rows = check_graph_replays(model, rounds=2, runner=runner)
    assert len(rows) == 8 and all(r["ok"] for r in rows) and {r["graph"] for r in rows} == {1, 2, 4}
    assert runner.cache.allocator.num_used == 1 and max(r["relative_error"] for r in rows) <= 1e-5  # the scratch

    class HandsBackTheBuffer(HostGraphs):
        def run_packed(self, longs, ints, key, num_seqs, sampled=None):
            super().run_packed(longs, ints, key, num_seqs, sampled)
            return self.logits[key][:num_seqs]

    runner = host_graph_runner(model, nan_cache(model, num_blocks=20, block_size=16), monkeypatch, max_model_len=64,
                               graphs=HandsBackTheBuffer)
    bad = [(r["round"], r["batch"]) for r in check_graph_replays(model, rounds=2, runner=runner) if not r["ok"]]
    assert bad and (1, 4) not in bad and (0, 3) in bad


def test_run_refuses_inputs_that_do_not_fit(tiny_model, monkeypatch):
    model = tiny_model[0]
    cache = nan_cache(model, num_blocks=16, block_size=16)
    runner = host_graph_runner(model, cache, monkeypatch, sizes=(1, 2), max_model_len=64)
    seq = SeqBlocks([5, 6, 7], 0)
    cache.allocate(seq)
    run(runner, [seq], [2], 0)
    feed(cache, [seq], [8])
    longs, ints = runner.pack_for_graphs([seq], [1])
    n_seqs, n_rows = runner.graphs.static_shape
    _, narrow = pack_step([seq], [1], 16, num_seqs=n_seqs, num_rows=n_rows, width=1)  # tables 1 wide
    with pytest.raises(ValueError, match=r"packed ints \(9,\) do not match the static buffer \(15,\)"):
        runner.graphs.run_packed(longs, narrow, GraphKey("decode", 2, 2), 1)
    with pytest.raises(ValueError, match=r"GraphKey\(kind='decode', seqs=3, tokens=3\) has no captured graph"):
        runner.graphs.run_packed(longs, ints, GraphKey("decode", 3, 3), 1)
    assert runner.graphs.run_packed(longs, ints, GraphKey("decode", 2, 2), 1).shape == \
        (1, model.config.vocab_size)  # the real row only
    with pytest.raises(ValueError, match=r"packed longs \(3, 1\) do not match the static buffer \(3, 2\)"):
        runner.graphs.run_packed(np.zeros((3, 1), np.int64), np.zeros(5, np.int32), GraphKey("decode", 2, 2), 1)


def test_no_garbage_collection_inside_a_capture(tiny_model, monkeypatch):
    """A collection in the middle of a capture may free an earlier engine's graphs (a CUDA call the capture does
    not permit): the collector runs before the captures and is off while they run, then on again as it was."""
    import gc

    seen = []

    class Watching(HostGraphs):
        def _capture_into(self, graph, pool, step):
            seen.append(gc.isenabled())
            return super()._capture_into(graph, pool, step)

    model = tiny_model[0]
    assert gc.isenabled()
    host_graph_runner(model, nan_cache(model, num_blocks=16, block_size=4), monkeypatch, sizes=(1, 2),
                      graphs=Watching)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:  # a caller that turned the collector off keeps it off
        host_graph_runner(model, nan_cache(model, num_blocks=16, block_size=4), monkeypatch, sizes=(1,),
                          graphs=Watching)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_refused_on_the_cpu(tiny_model):
    runner = ModelRunner(tiny_model[0], PagedKVCache.for_model(tiny_model[0], 4, 4), kernels="torch")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="need a CUDA device"):
            StepGraphs(runner, [1, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(dtype):
    """Replayed steps against eager steps of a runner without graphs. In float32 they must agree to 1e-5. In
    bf16 the two runners legitimately round differently (batch 3 runs eager but replays padded to 4, so cuBLAS
    may pick another kernel), so both are measured against a float32 runner on the same weights and fed tokens,
    and the replay may be no further from it than the eager bf16 runner is, with DESIGN.md's bf16 tolerance (1e-2)
    as slack; a wrong replay (stale or aliased buffers) is off by O(1). (Whole-model bf16 logits are not one op:
    on the H200 the eager bf16 runner's prefill step, where no graph is involved, was 0.0177 from float32.)"""
    from labkit.model import load_model, random_model

    if dtype == torch.float32:
        model = load_model(device="cuda")[0]
    else:  # a real GQA shape with random weights: 4 layers of Llama-3-8B
        model = random_model("llama-3-8b", device="cuda", dtype="bf16", num_layers=4)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 33, 17)]
    steps = torch.randint(3, vocab, (6, 3), generator=g).tolist()  # the same fed tokens for every runner
    got = []
    for graphs in (False, True):
        cache = nan_cache(model, num_blocks=64, block_size=16)
        runner = ModelRunner(model, cache, cuda_graphs=graphs, max_num_seqs=4, max_model_len=128)
        assert runner.graph_batch_sizes == ([1, 2, 4] if graphs else [])
        got.append(decode_steps(runner, cache, prompts, steps))  # batch 3 replays the graph of 4, then 1 and 2
        if graphs:
            assert not owned_by_graphs(runner.graphs, got[-1])
    if dtype == torch.float32:
        refs, tol = got[0], 1e-5
    else:
        model.float()
        cache = nan_cache(model, num_blocks=64, block_size=16)
        refs, tol = decode_steps(ModelRunner(model, cache, cuda_graphs=False, max_model_len=128), cache, prompts,
                                 steps), 1e-2
    for i, (eager, graph, ref) in enumerate(zip(*got, refs)):  # logits kept across later replays stay their own
        assert graph.shape == eager.shape and torch.isfinite(graph).all(), f"step {i}"
        errs = relative_error(graph, ref), relative_error(eager, ref)
        assert errs[0] <= errs[1] + tol, f"step {i}: graph {errs[0]:.3g}, eager {errs[1]:.3g} from the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("max_num_seqs", [4, 64])
def test_cuda_mixed_graph_replay_equals_eager(max_num_seqs):
    """Steps with prefill chunks replayed from token-count graphs against a runner without graphs (fp32, the
    embedded model): equal to 1e-5, logits kept across later replays their own. With ``max_num_seqs`` 64 the graph
    of 16 tokens holds 16 sequences and the one of 64 tokens 64: as many token rows as sequences, where the runner
    once returned the first token rows' logits instead of each sequence's last (notebook 02 on an H100)."""
    from labkit.model import load_model

    model = load_model(device="cuda")[0]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 33, 19)]
    fed = torch.randint(3, model.config.vocab_size, (3, 3), generator=g).tolist()
    got, replayed = [], []
    for tokens in ((), (16, 64)):
        cache = nan_cache(model, num_blocks=64, block_size=16)
        runner = ModelRunner(model, cache, cuda_graphs=bool(tokens), max_num_seqs=max_num_seqs, max_model_len=128,
                             graph_batch_sizes=[4], graph_token_sizes=tokens)
        got.append(mixed_steps(runner, cache, prompts, fed, replayed))
    assert replayed == [False] * 4 + [True] * 4
    for i, (eager, graph) in enumerate(zip(*got)):
        assert graph.shape == eager.shape and torch.isfinite(graph).all(), f"step {i}"
        assert relative_error(graph, eager) <= 1e-5, f"step {i}: {relative_error(graph, eager):.3g}"


@pytest.mark.gpu
def test_check_graph_replays_on_cuda():
    """Notebook 05's gate on a real CUDA graph: every replayed step equals the eager forward of its input."""
    from labkit.experiments.batching import check_graph_replays
    from labkit.model import load_model

    rows = check_graph_replays(load_model(device="cuda")[0], label="embedded fp32")
    assert len(rows) == 12 and {r["graph"] for r in rows} == {1, 2, 4}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.gpu
def test_check_graph_replays_bf16_padded_batch():
    """Notebook 05's gate on the gpu profile's kind of model (random weights, bf16): batch 3 replayed in the graph
    of 4 equals the eager step of the same padded input. Before the padded eager step stayed all-decode, its
    reference ran the prefill attention kernel while the graph ran the decode kernel, and random bf16 weights
    turned that kernel difference into a relative error of 0.044-0.047 on the logits (the H100 failure of
    notebook 05): the check compared unlike steps, not a wrong replay."""
    from labkit.experiments.batching import check_graph_replays
    from labkit.model import random_model

    model = random_model("llama-3-8b", device="cuda", dtype="bf16", num_layers=4)
    rows = check_graph_replays(model, label="llama-3-8b x4 random bf16")
    assert {r["graph"] for r in rows if r["batch"] == 3} == {4}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.gpu
def test_padding_leaves_real_rows_within_bf16_tolerance():
    """On trained weights in bf16 (the embedded model), a decode step of 3 sequences padded to 4 gives the real rows
    the logits of the unpadded step within bf16's tolerance: padding costs rounding at most."""
    from labkit.model import load_model

    model = load_model(device="cuda", dtype=torch.bfloat16)[0]
    cache = nan_cache(model, num_blocks=32, block_size=16)
    runner = ModelRunner(model, cache, cuda_graphs=False, max_model_len=128)
    (runner.scratch_block,) = cache.allocator.allocate(1)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    seqs = [SeqBlocks(torch.randint(3, vocab, (n,), generator=g).tolist(), i) for i, n in enumerate((40, 33, 26))]
    for seq in seqs:
        cache.allocate(seq)
    run(runner, seqs, [40, 33, 26], 0)
    for _ in range(4):
        feed(cache, seqs, torch.randint(3, vocab, (3,), generator=g).tolist())
        padded = runner.forward(runner.prepare(seqs, [1] * 3, 3, pad_to=4, width=runner.max_blocks))[:3]
        plain = run(runner, seqs, [1] * 3, 3)
        assert relative_error(padded.float(), plain.float()) <= 1e-2


@pytest.mark.gpu
def test_prefix_caching_is_token_equal_with_graphs_on_cuda():
    """Notebook 02's prefix-caching cell on CUDA with the engine's defaults (embedded model, fp32, Triton kernels,
    decode and mixed-step CUDA graphs): a served system prompt, then four requests that extend it, give the same
    tokens with and without prefix caching (they differed on an H100 from the first token on)."""
    from labkit.data import sample_prompts, split_tokens
    from labkit.engine import LLMEngine, SamplingParams
    from labkit.model import load_model

    model, tok = load_model(device="cuda")
    sys_prompt = split_tokens("heldout", tok, max_tokens=69)[:69].tolist()
    users = sample_prompts(tok, 4, 8, seed=3)
    outs = {}
    for on in (False, True):
        engine = LLMEngine(model, num_blocks=48, block_size=16, enable_prefix_caching=on)
        assert engine.runner.graphs is not None and engine.runner.graphs.token_sizes
        engine.generate([sys_prompt], SamplingParams(max_tokens=1), progress=False)
        res = engine.generate([sys_prompt + u for u in users], SamplingParams(max_tokens=12, ignore_eos=True),
                              progress=False)
        outs[on] = [o.output_token_ids for o in res]
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_graph_pool_bytes_count_the_pool_alone():
    """``StepGraphs.pool_bytes`` is the captures' own pool, whatever else the process frees meanwhile: captures
    during which 1 GiB of other memory goes back read the size of captures without (within 10%) (a
    ``memory_reserved`` difference read -50 GB for the second engine of ``bench decode`` on an H100, whose first
    engine's memory went back while it captured)."""
    from labkit.model import load_model

    class FreeingGraphs(StepGraphs):  # other memory goes back as the captures start
        def _capture(self):
            ballast.clear()
            torch.cuda.empty_cache()
            return super()._capture()

    model = load_model(device="cuda")[0]
    sizes = []
    for graphs in (StepGraphs, FreeingGraphs):
        ballast = [torch.empty(2**30, dtype=torch.uint8, device="cuda")]
        runner = ModelRunner(model, nan_cache(model, num_blocks=64, block_size=16), cuda_graphs=False,
                             max_num_seqs=4, max_model_len=128)
        sizes.append(graphs(runner, [1, 2, 4]).pool_bytes)
        ballast.clear()
    assert 0 < sizes[0] < 2**30 and abs(sizes[1] - sizes[0]) <= 0.1 * sizes[0], sizes
