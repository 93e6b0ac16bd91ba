"""What notebook 02 measures: a request mix served against a fixed KV budget (contiguous vs paged, without running
a model), and the int8 / fp8 KV trade-off (accuracy on the embedded model, memory per token, attention latency).

The paged simulation drives the engine's own ``ContinuousBatchingScheduler`` over a ``PagedKVCache`` built without
tensors, so admission, preemption and prefix hits follow exactly the code the engine runs with; the contiguous
side gives each admitted request a slab of ``max_len`` slots (``ContiguousKVCache``). Both cap the running requests
at ``max_num_seqs``, as a real engine does. The simulation advances in steps: each step every running request adds
one token, and newly admitted ones add their prompt (the token budget is unbounded, so a prompt is prefilled in one
step). A step of many sequences reads more KV than a step of few, so steps are no clock: ``SimResult.time_s``
turns a run into seconds from the bytes and FLOPs it moves (every step reads the weights once and every running
sequence's cached tokens, every prefilled token costs its matmul FLOPs).

KV formats: ``kv_format_accuracy`` runs the real model on the paged cache with every query attending to K/V read
back from the cache (the engine's ``ModelRunner``, torch path), so a quantised format affects every scored token
the way it would during decoding; the unquantised run (the model's own dtype) is the reference for perplexity
and the logit error. ``attention_latency`` times one layer's decode attention per format.

Request lengths come from ``lognormal_mix``: prompt and output lengths drawn independently from log-normal
distributions (heavy right tail: a few requests are ten times the median), with means matching those the vLLM
paper reports for ShareGPT (161 prompt and 338 output tokens on average); pairs longer than the model's context
are redrawn (and counted), never cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from labkit.engine import ContinuousBatchingScheduler, ModelRunner, Request, SamplingParams
from labkit.engine import Sequence as Seq
from labkit.kvcache import ContiguousKVCache, KVSequence, PagedKVCache, SeqBlocks, decode_attention, dequantised_blocks
from labkit.model import ModelInput


@dataclass(frozen=True)
class RequestMix:
    """Prompt and output lengths of ``n`` requests, and how they were drawn."""

    prompt_lens: list[int]
    output_lens: list[int]
    distribution: str
    redrawn: int = 0  # pairs drawn again because prompt + output exceeded max_len

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def total_tokens(self) -> list[int]:
        return [p + o for p, o in zip(self.prompt_lens, self.output_lens, strict=True)]


def lognormal_mix(n: int, max_len: int, prompt_mean: float = 161.0, output_mean: float = 338.0,
                  sigma: float = 1.0, seed: int = 0) -> RequestMix:
    """``n`` requests with log-normal prompt and output lengths of the given means and log-space ``sigma``.

    A log-normal with log-space mean ``mu`` has mean ``exp(mu + sigma^2 / 2)``, so ``mu = ln(mean) - sigma^2/2``.
    Lengths are rounded and at least 1; a pair whose total exceeds ``max_len`` is redrawn.
    """
    if n < 1 or max_len < 2:
        raise ValueError(f"n={n} must be >= 1 and max_len={max_len} >= 2")
    if min(prompt_mean, output_mean, sigma) <= 0:
        raise ValueError("prompt_mean, output_mean and sigma must be positive")
    g = torch.Generator().manual_seed(seed)
    mus = (math.log(prompt_mean) - sigma**2 / 2, math.log(output_mean) - sigma**2 / 2)
    prompts, outputs, redrawn = [], [], 0
    while len(prompts) < n:
        z = torch.randn(2, 4 * n, generator=g, dtype=torch.float64)
        p = (mus[0] + sigma * z[0]).exp().round().clamp(min=1).long().tolist()
        o = (mus[1] + sigma * z[1]).exp().round().clamp(min=1).long().tolist()
        for a, b in zip(p, o, strict=True):
            if len(prompts) == n:
                break
            if a + b > max_len:
                redrawn += 1
                continue
            prompts.append(a)
            outputs.append(b)
    desc = (f"log-normal, sigma={sigma} in log space; mean prompt {prompt_mean:g}, mean output {output_mean:g} "
            f"tokens (ShareGPT means per the vLLM paper); pairs over max_len={max_len} redrawn")
    return RequestMix(prompts, outputs, desc, redrawn)


@dataclass
class SimResult:
    """One simulated run. Time averages are over sampled steps; *saturated* means some request was waiting."""

    name: str
    requests: int
    steps: int
    slots_total: int
    preemptions: int = 0
    mean_running: float = 0.0
    mean_running_saturated: float = 0.0
    peak_running: int = 0
    waste_frac: float = 0.0  # 1 - sum(tokens held) / sum(slots reserved)
    utilisation: float = 0.0  # mean tokens held / slots_total
    sharing_saving_frac: float = 0.0  # 1 - sum(tokens held) / sum(sequence lengths)
    prefill_tokens: int = 0
    prefix_cached_tokens: int = 0
    table_entries_per_seq: float = 0.0  # block-table entries (int32) per running sequence, mean
    kv_tokens_read: int = 0  # cached tokens attended over, summed over every step and running sequence
    output_tokens: int = 0
    trace: dict = field(default_factory=lambda: {"step": [], "running": [], "held": [], "reserved": []})

    def to_dict(self, with_trace: bool = False) -> dict:
        d = asdict(self)
        if not with_trace:
            d.pop("trace")
        return d

    def time_s(self, spec, hw, dtype: str = "bf16") -> float:
        """Seconds this run takes on ``hw`` serving ``spec`` in ``dtype``, from bytes and FLOPs (a floor, the same
        for both caches): each step reads the weights once and the KV of every cached token it attends over, at the
        memory bandwidth; each prefilled token (recomputed ones included) costs ``2 x parameters`` FLOPs at the
        bf16 matmul rate."""
        read = self.steps * spec.weight_bytes(dtype) + self.kv_tokens_read * spec.kv_bytes_per_token(dtype)
        return read / hw.mem_bandwidth + self.prefill_tokens * 2 * spec.num_params / hw.bf16_flops


class _Sampler:
    """Accumulates occupancy samples into a ``SimResult``."""

    def __init__(self, result: SimResult):
        self.r = result
        self.held = self.reserved = self.logical = self.entries = 0
        self.n = self.n_sat = self.running_sum = self.running_sat_sum = 0

    def add(self, step: int, running: int, held: int, reserved: int, logical: int, saturated: bool,
            entries: int = 0) -> None:
        self.held, self.reserved, self.logical = self.held + held, self.reserved + reserved, self.logical + logical
        self.entries += entries
        self.n += 1
        self.running_sum += running
        if saturated:
            self.n_sat += 1
            self.running_sat_sum += running
        self.r.peak_running = max(self.r.peak_running, running)
        for k, v in (("step", step), ("running", running), ("held", held), ("reserved", reserved)):
            self.r.trace[k].append(v)

    def finish(self) -> SimResult:
        r = self.r
        r.waste_frac = 1 - self.held / self.reserved if self.reserved else 0.0
        r.utilisation = self.held / (self.n * r.slots_total) if self.n else 0.0
        r.sharing_saving_frac = 1 - self.held / self.logical if self.logical else 0.0
        r.mean_running = self.running_sum / self.n if self.n else 0.0
        r.mean_running_saturated = self.running_sat_sum / self.n_sat if self.n_sat else r.mean_running
        r.table_entries_per_seq = self.entries / self.running_sum if self.running_sum else 0.0
        return r


def simulate_contiguous(mix: RequestMix, budget_tokens: int, max_len: int, sample_every: int = 1,
                        max_num_seqs: int = 1 << 30) -> SimResult:
    """Serve ``mix`` first come, first served with one ``max_len`` slab per running request, at most
    ``max_num_seqs`` of them."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be an integer >= 1")
    max_seqs = min(budget_tokens // max_len, max_num_seqs)
    if max_seqs < 1:
        raise ValueError(f"budget_tokens={budget_tokens} holds no slab of max_len={max_len}")
    cache = ContiguousKVCache(1, 1, 1, max_seqs=max_seqs, max_len=max_len, allocate_pools=False)
    res = SimResult("contiguous", len(mix), 0, max_seqs * max_len)
    sampler = _Sampler(res)
    waiting = list(range(len(mix)))[::-1]  # a stack: pop() is the oldest
    generated: dict[int, int] = {}
    while waiting or generated:
        for rid in list(generated):  # decode: one token each (its slot holds the previous output token)
            cache.append_slots(rid, 1)
        while waiting and cache.num_free_slabs:
            rid = waiting.pop()
            cache.allocate(rid, mix.prompt_lens[rid])
            res.prefill_tokens += mix.prompt_lens[rid]
            generated[rid] = 0
        held = sum(cache.lens.values())
        res.kv_tokens_read += held
        if res.steps % sample_every == 0:
            sampler.add(res.steps, len(generated), held, len(generated) * max_len, held, bool(waiting))
        res.steps += 1
        res.output_tokens += len(generated)
        for rid in list(generated):
            generated[rid] += 1
            if generated[rid] == mix.output_lens[rid]:
                cache.free(rid)
                del generated[rid]
    return sampler.finish()


def simulate_paged(mix: RequestMix, budget_tokens: int, block_size: int = 16, system_prompt_len: int = 0,
                   enable_prefix_caching: bool = False, max_num_seqs: int = 1 << 30, watermark: float = 0.01,
                   preemption_mode: str = "recompute", sample_every: int = 1, seed: int = 0) -> SimResult:
    """Serve ``mix`` with the engine's continuous-batching scheduler on a paged cache of ``budget_tokens //
    block_size`` blocks, keeping ``watermark`` of them free at admission (vLLM's 1%).

    With ``system_prompt_len`` every prompt starts with the same ``system_prompt_len`` tokens (counted on top of
    the mix's prompt length), which prefix caching can share. ``preemption_mode`` 'swap' moves the bookkeeping of
    swapped blocks only (there are no tensors).
    """
    num_blocks = budget_tokens // block_size
    cache = PagedKVCache(1, 1, 1, num_blocks=num_blocks, block_size=block_size,
                         enable_prefix_caching=enable_prefix_caching, allocate_pools=False)
    sched = ContinuousBatchingScheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=1 << 30,
                                        preemption_mode=preemption_mode, watermark=watermark)
    g = torch.Generator().manual_seed(seed)
    vocab = 1 << 20  # distinct random ids: requests share nothing but the system prompt
    system = torch.randint(0, vocab, (system_prompt_len,), generator=g).tolist()
    for rid in range(len(mix)):
        user = torch.randint(0, vocab, (mix.prompt_lens[rid],), generator=g).tolist()
        params = SamplingParams(max_tokens=mix.output_lens[rid], ignore_eos=True)
        sched.add(Seq(Request(rid, system + user, params), seed=rid))
    name = f"paged (block {block_size}" + (", prefix caching)" if enable_prefix_caching else ")")
    res = SimResult(name, len(mix), 0, num_blocks * block_size)
    sampler = _Sampler(res)
    while sched.has_unfinished():
        batch = sched.schedule()
        if batch.is_empty:
            raise RuntimeError("the scheduler found nothing to run with requests unfinished")
        for seq, n in zip(batch.seqs, batch.num_tokens):  # a model step would write these tokens' K/V now,
            res.kv_tokens_read += seq.num_computed + n  # its attention reading every cached token of the sequence
        if res.steps % sample_every == 0:
            s = cache.stats(sched.running)
            entries = sum(len(seq.block_table) for seq in sched.running)
            sampler.add(res.steps, len(sched.running), s.tokens_held, s.slots_reserved, s.logical_tokens,
                        bool(sched.waiting or sched.swapped), entries)
        res.steps += 1
        # output ids above the prompts' range: no accidental prefix sharing through generated tokens
        tokens = [(seq.seq_id * 7919 + seq.num_output_tokens) % vocab + vocab
                  for seq, smp in zip(batch.seqs, batch.sample) if smp]
        res.output_tokens += len(tokens)
        sched.postprocess(batch, tokens, float(res.steps))  # the batch's tokens computed, the sampled ones appended
    st = sched.stats()
    res.preemptions, res.prefill_tokens, res.prefix_cached_tokens = (st["preemptions"], st["admitted_tokens"],
                                                                     st["prefix_hit_tokens"])
    return sampler.finish()


# --- int8 / fp8 KV: accuracy and latency ----------------------------------------------------------------------
@torch.no_grad()
def kv_format_accuracy(model, token_ids: torch.Tensor, kv_dtypes: Sequence[str] = ("int8", "fp8"),
                       seq_len: int = 256, max_windows: int | None = None, batch_size: int = 4,
                       block_size: int = 16, spread: bool = False, progress: bool = False) -> dict[str, dict]:
    """Perplexity and logit error of ``model`` with its KV cache stored in each of ``kv_dtypes``.

    ``token_ids`` (1-D) is cut into windows of ``seq_len + 1`` tokens exactly as ``labkit.evaluate.perplexity``
    does (each window predicts its last ``seq_len`` tokens); ``max_windows`` keeps the first windows, or with
    ``spread`` that many evenly spaced over the whole stream (text difficulty varies along it).

    Returns, per format and for ``"reference"`` (the model's dtype): ``ppl``, ``logit_rel_err``
    (``||logits - ref|| / ||ref||`` over every scored position), ``top1_agree`` (fraction of positions whose
    argmax equals the reference's), ``bytes_per_token`` and ``scored_tokens``.
    """
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    total = (len(token_ids) - 1) // seq_len
    if total < 1:
        raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than one window of seq_len+1={seq_len + 1}")
    n_windows = total if max_windows is None else min(total, max_windows)
    picks = [j * total // n_windows for j in range(n_windows)] if spread else list(range(n_windows))
    ref_dtype = next(model.parameters()).dtype
    names = ["reference", *kv_dtypes]
    runners = {name: ModelRunner(model, PagedKVCache.for_model(
        model, num_blocks=batch_size * -(-seq_len // block_size), block_size=block_size,
        kv_dtype=ref_dtype if name == "reference" else name), kernels="torch", cuda_graphs=False) for name in names}
    acc = {name: {"nll": 0.0, "diff2": 0.0, "agree": 0} for name in names}
    ref2, count = 0.0, 0
    for i in tqdm(range(0, n_windows, batch_size), desc="kv formats", disable=not progress):
        rows = [token_ids[j * seq_len:(j + 1) * seq_len + 1] for j in picks[i:i + batch_size]]
        targets = torch.cat([r[1:] for r in rows]).to(next(model.parameters()).device)
        ref = None
        for name in names:
            logits = window_logits(runners[name], [r[:-1].tolist() for r in rows])
            acc[name]["nll"] += F.cross_entropy(logits, targets, reduction="sum").item()
            if ref is None:
                ref = logits
            acc[name]["diff2"] += (logits.double() - ref.double()).pow(2).sum().item()
            acc[name]["agree"] += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        ref2 += ref.double().pow(2).sum().item()
        count += targets.numel()
    return {name: {"ppl": math.exp(a["nll"] / count), "logit_rel_err": math.sqrt(a["diff2"] / ref2),
                   "top1_agree": a["agree"] / count, "bytes_per_token": runners[name].cache.bytes_per_token,
                   "scored_tokens": count}
            for name, a in acc.items()}


def window_logits(runner: ModelRunner, windows: list[list[int]]) -> torch.Tensor:
    """Prefill every window as its own sequence in one flat batch on the engine's runner; float32 logits of every
    position ``[sum(len), vocab]`` (the step's ``logits_indices`` name every row, not only each window's last)."""
    cache = runner.cache
    seqs = [SeqBlocks(w, sid) for sid, w in enumerate(windows)]
    try:
        for seq in seqs:
            cache.allocate(seq)
        inp = ModelInput.build(cache, seqs, [len(w) for w in windows], all_logits=True)
        with torch.inference_mode():
            return runner.forward(inp)
    finally:
        for seq in seqs:
            if seq.block_table:
                cache.free(seq)


def attention_latency(kv_dtype: str, num_seqs: int, context_len: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", backend: str = "auto", fused: bool = True,
                      iters: int = 20, seed: int = 0):
    """Time one layer's decode attention over a paged cache stored in ``kv_dtype``, the way the runner does it.

    Quantised formats go to ``decode_attention`` with their scales (``fused``: the Triton kernel on CUDA reads
    8-bit K/V and dequantises in registers; the torch path dequantises first), or, with ``fused=False``, are
    always dequantised to ``dtype`` (the blocks the batch names) before the attention.
    Returns ``(timing, bytes_read)``: a ``labkit.bench.Timing`` and the cache bytes one call must read (K, V and
    scales of ``num_seqs * context_len`` tokens), the floor against which the time is judged.
    """
    from labkit.bench import time_fn

    g = torch.Generator(device=device).manual_seed(seed)  # random K/V drawn where they live
    blocks_per_seq = -(-context_len // block_size)
    cache = PagedKVCache(1, num_kv_heads, head_dim, num_blocks=num_seqs * blocks_per_seq, block_size=block_size,
                         kv_dtype=kv_dtype, device=device)
    seqs = [SeqBlocks([0] * context_len, sid) for sid in range(num_seqs)]
    for seq in seqs:
        cache.allocate(seq)
        slots = torch.tensor(cache.slots(seq, 0, context_len), device=device)
        k, v = (torch.randn(context_len, num_kv_heads, head_dim, generator=g, device=device).to(dtype) for _ in "kv")
        cache.write(0, slots, k, v)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g, device=device).to(dtype)
    tables, lens = cache.block_tables(seqs), cache.context_lens(seqs)

    quant = cache.fmt.quantised
    scales = {"k_scale": cache.k_scales[0], "v_scale": cache.v_scales[0]} if quant else {}

    def step():
        if fused and (quant or cache.fmt.storage_dtype == dtype):
            return decode_attention(q, cache.k_caches[0], cache.v_caches[0], tables, lens, backend=backend, **scales)
        k_cache, v_cache, t = dequantised_blocks(cache, 0, tables, dtype)
        return decode_attention(q, k_cache, v_cache, t, lens, backend=backend)

    bytes_read = num_seqs * context_len * cache.bytes_per_token
    return time_fn(step, device=device, warmup=2, iters=iters), bytes_read


def draw_block_table(cache: PagedKVCache, seqs: Sequence[KVSequence], ax=None):
    """Draw the block tables of ``seqs`` (sequences holding blocks of ``cache``): one row per sequence of its logical
    blocks (shaded by how full each is, labelled with the physical block it names), and the physical pool on the
    right, coloured by owner. Returns the two axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax is None:
        fig, ax = plt.subplots(1, 2, figsize=(11, 0.55 * len(seqs) + 1.6), width_ratios=[1, 1.2])
    left, right = ax
    colours = plt.get_cmap("tab10")
    bs = cache.block_size
    owner = {b: i for i, seq in enumerate(seqs) for b in seq.block_table}
    widest = max(len(seq.block_table) for seq in seqs)
    for row, seq in enumerate(seqs):
        n, sid = cache.num_slots(seq), seq.seq_id
        y = len(seqs) - 1 - row
        for j, b in enumerate(seq.block_table):
            full = min(bs, n - j * bs) / bs
            left.add_patch(Rectangle((j, y + 0.1), 1, 0.8, fill=False, ec="k", lw=0.8))
            left.add_patch(Rectangle((j, y + 0.1), full, 0.8, color=colours(row), alpha=0.6, lw=0))
            left.text(j + 0.5, y + 0.5, str(b), ha="center", va="center", fontsize=10)
        left.text(-0.15, y + 0.5, f"seq {sid}: {n} tok", ha="right", va="center", fontsize=10)
    left.set(xlim=(-2.2, widest + 0.2), ylim=(0, len(seqs)), xticks=range(widest + 1), yticks=[],
             xlabel=f"logical block (each {bs} tokens; shading = filled)", title="block tables: sequence -> blocks")
    cols = 8
    rows = -(-cache.num_blocks // cols)
    for b in range(cache.num_blocks):
        x, y = b % cols, rows - 1 - b // cols
        c = colours(owner[b]) if b in owner else "white"
        right.add_patch(Rectangle((x, y + 0.05), 0.95, 0.9, fc=c, ec="k", lw=0.6, alpha=0.6 if b in owner else 1))
        right.text(x + 0.47, y + 0.5, str(b), ha="center", va="center", fontsize=9)
    right.set(xlim=(0, cols), ylim=(0, rows), xticks=[], yticks=[],
              title=f"physical pool: {cache.num_blocks} blocks (white = free)")
    for a in ax:
        a.set_frame_on(False)
    plt.tight_layout()
    return ax
