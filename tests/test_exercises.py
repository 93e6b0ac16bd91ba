"""Exercises: every checker passes labkit's solution and a learner's correct answer written another way, and fails
with a useful message on the notebook's skeleton and on plausible wrong answers (an off-by-one, a missing scale,
a wrong mask, a skipped queue), never printing the solution; predict-then-measure checks set the prediction against
this run's record or the committed one and say which."""

import importlib.util
import inspect
import json
import math
import re

import pytest
import torch
import triton
import triton.language as tl

from labkit.data import REPO_ROOT
from labkit.exercises import check, exercise_source, exercises, report
from labkit.exercises.cells import EXERCISE_DIR, checked_names
from labkit.exercises.checker import ExerciseError
from labkit.exercises.core import KINDS, REGISTRY, Case, Exercise, Prediction, tensor_diff
from labkit.kvcache import CacheFullError
from labkit.model import dtype_bytes
from labkit.parallel.cost_model import memory_per_device

NAMES = [ex.name for ex in exercises()]
NOTEBOOKS = [f"{i:02d}" for i in range(10)]


@pytest.fixture(autouse=True)
def interactive(monkeypatch, tmp_path):
    """Run as a learner would: no runner environment, status in a temporary file."""
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    monkeypatch.setenv("LABKIT_EXERCISES_STATUS", str(tmp_path / "status.json"))
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path / "run"))  # an empty run: measurements from the committed records


def _check(name, impl, **kw):
    return check(name, impl, verbose=False, **kw)


# --- the registry and the notebooks -----------------------------------------------------------------------------
def test_every_notebook_00_to_09_has_exercises_with_checkers():
    for nn in NOTEBOOKS:
        names = checked_names(nn)
        assert names, f"notebook {nn} has no exercise"
        assert all(n in REGISTRY and n.startswith(nn + ".") for n in names), names
    assert sorted(n for nn in NOTEBOOKS for n in checked_names(nn)) == sorted(NAMES)


def test_at_least_24_exercises_of_each_kind_and_four_predictions_against_measurements():
    kinds = {k: [ex.name for ex in exercises() if ex.kind == k] for k in KINDS}
    assert len(NAMES) >= 24 and all(kinds.values()), kinds
    assert len(kinds["predict-then-measure"]) >= 4
    # the four the issue asks for: a profile table's bounds, int8 KV attention, TP or PP, the 175B GPU count
    for name in ("01.classify_ops", "03.int8_kv_speedup", "06.tp_or_pp", "08.gpus_175b"):
        assert isinstance(REGISTRY[name], Prediction) and REGISTRY[name].measure is not None, name
    # the transcription exercises of 04, 06 and 07 gave way to decisions
    for nn in ("04", "06", "07"):
        assert any(REGISTRY[n].kind != "implement" for n in checked_names(nn)), nn
    assert not {"04.int4_quantize", "04.int4_dequantize", "04.int8_quantize", "06.column_parallel",
                "06.row_parallel", "07.lora_forward", "07.lora_merge"} & set(NAMES)


def test_exercise_cells_are_appended_to_the_built_notebooks():
    from labkit.workbook import NOTEBOOK_DIR, build_notebooks

    assert build_notebooks(check=True) == []  # the committed notebooks include the cells
    nb = json.loads((NOTEBOOK_DIR / "02_kv_cache.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"]]
    assert any('check("02.cow", MyBlockTables)' in s for s in sources)
    assert exercise_source("99_nothing") == ""
    assert 'check("00.fifo_p99_ttft", fifo_p99_ttft)' in exercise_source("00_baseline")


@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name):
    r = _check(name, REGISTRY[name].solution)
    assert r.status == "pass" and r.passed == r.total >= 5, r.message


def _skeletons(nn: str, tmp_path):
    """The notebook's skeleton cells, imported from a file (Triton needs the source of a kernel), and the
    ``{exercise: object}`` its check cells pass."""
    src = exercise_source(nn)
    code = [c for c in re.split(r"^# %%.*$", src, flags=re.M) if c.strip() and not c.lstrip().startswith("# ")]
    body = "\n\n".join(c for c in code if "check(" not in c)
    path = tmp_path / f"skeleton_{nn}.py"
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = re.findall(r"""check\(\s*["'](\d\d\.\w+)["']\s*,\s*(\w+)\s*\)""", src)
    return {name: getattr(mod, var) for name, var in calls}


@pytest.mark.parametrize("nn", NOTEBOOKS)
def test_skeleton_is_not_tried_for_a_learner_and_replaced_by_the_solution_in_a_headless_run(nn, tmp_path,
                                                                                            monkeypatch, capsys):
    status = tmp_path / "status.json"
    for name, skeleton in _skeletons(nn, tmp_path).items():
        r = _check(name, skeleton, status_path=status)
        assert r.status == "not tried" and "NotImplementedError" in r.message, r.message
        assert json.loads(status.read_text())[name]["status"] == "not tried"
        monkeypatch.setenv("LABKIT_PROFILE", "ci")  # what the workbook runner sets
        r = check(name, skeleton, status_path=status)
        monkeypatch.delenv("LABKIT_PROFILE")
        assert r.status == "pass" and r.used_solution, r.message
        assert "reference solution instead" in capsys.readouterr().out
        assert json.loads(status.read_text())[name]["status"] == "not tried"  # a headless run records nothing


def test_a_failing_solution_fails_a_headless_run(monkeypatch):
    ex = Exercise("99.broken", "broken", solution=lambda: 1, cases=lambda: [Case("one", None)],
                  run=lambda fn, _: fn(), compare=lambda e, a: "always wrong")
    monkeypatch.setenv("LABKIT_EXERCISES", "solutions")

    def skeleton():
        raise NotImplementedError

    with pytest.raises(ExerciseError, match="99.broken"):
        check(ex, skeleton, verbose=False)  # an exercise of one's own, unregistered


def test_unknown_exercise_names_the_allowed_ones():
    with pytest.raises(ValueError, match="02.allocator"):
        check("02.alocator", object)


def test_status_is_recorded_and_listed(tmp_path, capsys):
    from labkit.__main__ import main

    status = tmp_path / "s.json"
    assert _check("09.spec_speedup", REGISTRY["09.spec_speedup"].solution, status_path=status)
    assert not _check("07.lora_rank", lambda *a, **k: {"table": {}, "choice": 8}, status_path=status)
    assert main(["exercises", "--status", str(status)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"09.spec_speedup\s+predict-then-measure\s+pass\s+6/6", out), out
    assert re.search(r"07.lora_rank\s+decide\s+fail\s+0/6", out), out
    assert re.search(r"01.kv_bytes\s+implement\s+not tried", out) and f"1 of {len(NAMES)} passed" in out
    n_ptm = sum(ex.kind == "predict-then-measure" for ex in exercises())
    assert f"{n_ptm} predict-then-measure" in out
    assert f"1 of {len(NAMES)} passed" in report(status)


def test_tensor_diff_says_which_elements_differ():
    e = torch.arange(12.0).view(3, 4)
    a = e.clone()
    a[1, 2], a[2, 3] = 100.0, float("nan")
    msg = tensor_diff(e, a)
    assert "2 of 12 elements differ" in msg and "[1, 2]" in msg and "[2, 3]" in msg
    assert "1 of them are NaN" in msg and "max abs error" in msg and "expected 6" in msg
    assert "  ....\n  ..x.\n  ...N" in msg  # the picture: one line per row
    assert "shape" in tensor_diff(e, e[:2]) and tensor_diff(e, e.clone()) is None


# --- plausible answers, right and wrong --------------------------------------------------------------------------
def _fails(name, impl, *needles):
    r = _check(name, impl)
    assert r.status == "fail", r.message
    assert "FAILED case" in r.message, r.message
    for n in needles:
        assert n in r.message, f"{n!r} not in\n{r.message}"
    return r


def _passes(name, impl):
    r = _check(name, impl)
    assert r.status == "pass", r.message


# 01
def test_roofline_without_two_flops_per_multiply_add_fails():
    def roofline(t, i, o, b, peak, bw):
        flops, nbytes = t * i * o, (i * o + t * (i + o)) * b
        return flops, nbytes, max(flops / peak, nbytes / bw), "compute" if flops / peak >= nbytes / bw else "memory"

    _fails("01.linear_roofline", roofline, "expected", "ratio 0.5")


def test_kv_bytes_with_query_heads_instead_of_kv_heads_fails():
    def kv(spec, batch, context, dtype):
        return 2 * spec.num_layers * spec.num_heads * spec.head_dim * dtype_bytes(dtype) * batch * context

    def kv_right(spec, batch, context, dtype):
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes(dtype) * batch * context

    _fails("01.kv_bytes", kv, "expected", "llama-3-8b")
    _passes("01.kv_bytes", kv_right)


# 02
class StackAllocator:
    """A learner's allocator: a LIFO free list (other ids than labkit's), right otherwise."""

    def __init__(self, num_blocks):
        self.free_list, self.refs = list(range(num_blocks))[::-1], [0] * num_blocks

    def allocate(self, n):
        if n > len(self.free_list):
            raise CacheFullError(f"{n} > {len(self.free_list)}")
        out = [self.free_list.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def incref(self, block):
        if self.refs[block] < 1:
            raise ValueError("free block")
        self.refs[block] += 1

    def free(self, block):
        if self.refs[block] < 1:
            raise ValueError("double free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_list.append(block)

    @property
    def num_free(self):
        return len(self.free_list)


class NoDoubleFreeCheck(StackAllocator):
    def free(self, block):
        self.refs[block] -= 1
        if self.refs[block] <= 0:
            self.free_list.append(block)


class PartialAllocate(StackAllocator):
    def allocate(self, n):  # takes what it can before noticing: the cache is left changed
        out = []
        for _ in range(n):
            if not self.free_list:
                raise CacheFullError("full")
            out.append(self.free_list.pop())
            self.refs[out[-1]] = 1
        return out


def test_allocator_right_with_other_ids_wrong_without_double_free_or_atomic_allocate():
    _passes("02.allocator", StackAllocator)
    _fails("02.allocator", NoDoubleFreeCheck, "again, now that it is free", "outcome", "expected 'error', got 'ok'")
    _fails("02.allocator", PartialAllocate, "num_free")


class LearnerTables:
    """A learner's block tables with copy on write, on the stack allocator."""

    def __init__(self, num_blocks, block_size, cow=True):
        self.bs, self.a, self.tables, self.lengths, self.copies = block_size, StackAllocator(num_blocks), {}, {}, []
        self.cow = cow

    def allocate(self, seq_id, num_tokens):
        self.tables[seq_id] = self.a.allocate(math.ceil(num_tokens / self.bs))
        self.lengths[seq_id] = num_tokens

    def append(self, seq_id):
        table, n = self.tables[seq_id], self.lengths[seq_id]
        partial, shared = n % self.bs != 0, self.a.refs[table[-1]] > 1
        need = (0 if partial else 1) + (1 if (self.cow and partial and shared) else 0)
        if need > self.a.num_free:
            raise CacheFullError("full")
        if self.cow and partial and shared:
            (new,) = self.a.allocate(1)
            self.copies.append((table[-1], new))
            self.a.free(table[-1])
            table[-1] = new
        if not partial:
            table += self.a.allocate(1)
        self.lengths[seq_id] = n + 1

    def fork(self, parent, child):
        for b in self.tables[parent]:
            self.a.incref(b)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def free(self, seq_id):
        for b in self.tables.pop(seq_id):
            self.a.free(b)
        del self.lengths[seq_id]

    def block_table(self, seq_id):
        return self.tables[seq_id]

    @property
    def num_free(self):
        return self.a.num_free


class NoCopyOnWrite(LearnerTables):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size, cow=False)


def test_block_tables_right_with_copy_on_write_wrong_without():
    _passes("02.cow", LearnerTables)
    _fails("02.cow", NoCopyOnWrite, "block table of b", "append('b')")


# 03
@triton.jit
def rms_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_kernel_mean_over_block(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)
    tl.store(out_ptr + row * n_cols + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_kernel_no_eps(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols)
    tl.store(out_ptr + row * n_cols + cols, x * rstd * w, mask=mask)


def test_rms_norm_kernel_right_and_wrong():
    _passes("03.rms_norm", rms_kernel)
    r = _fails("03.rms_norm", rms_kernel_mean_over_block, "elements differ", "max abs error", "x [3, 33]")
    assert r.passed == 1  # n_cols 8 is a power of two: BLOCK == n_cols there
    _fails("03.rms_norm", rms_kernel_no_eps, "eps=0.5")


@triton.jit
def swiglu_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, g * tl.sigmoid(g) * u, mask=mask)


@triton.jit
def swiglu_kernel_off_by_one(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements - 1
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, g * tl.sigmoid(g) * u, mask=mask)


def test_swiglu_kernel_right_and_wrong_mask():
    _passes("03.silu_and_mul", swiglu_kernel)
    _fails("03.silu_and_mul", swiglu_kernel_off_by_one, "1 of 1 elements differ", "NaN")


# 05
def _learner_step(running, waiting, budget, max_seqs, free, bs, skip_ahead=False, chunk=True):
    rows = [(r.id, 1) for r in running if r.num_computed >= r.prompt_len][:budget]
    budget -= len(rows)
    for r in running:
        if r.num_computed < r.prompt_len and budget > 0:
            n = min(r.prompt_len - r.num_computed, budget)
            rows.append((r.id, n))
            budget -= n
    count = len(running)
    for r in waiting:
        need = -(-r.prompt_len // bs)
        if budget <= 0 or count >= max_seqs:
            break
        if need > free:
            if skip_ahead:
                continue
            break
        n = min(r.prompt_len, budget) if chunk else r.prompt_len
        rows.append((r.id, n))
        budget, free, count = budget - n, free - need, count + 1
    return rows


def test_schedule_step_right_and_wrong():
    _passes("05.schedule_step", _learner_step)
    _fails("05.schedule_step", lambda *a: _learner_step(*a, skip_ahead=True), "does not fit", "got 1")
    _fails("05.schedule_step", lambda *a: _learner_step(*a, chunk=False), "chunked prefill", "expected 63, got 100",
           "expected [('a', 1), ('b', 63)]")


def _learner_reserve(running, free, bs, victim_index=-1):
    alive, scheduled, preempted = list(running), [], []
    for r in running:
        if r not in alive or r.num_computed < r.prompt_len:
            continue
        need = 1 if (r.num_tokens - 1) % bs == 0 else 0
        while need > free:
            v = alive.pop(victim_index)
            preempted.append(v.id)
            free += -(-(v.num_tokens - (1 if v.num_computed >= v.prompt_len else 0)) // bs)
            if v is r:
                break
        if r in alive:
            free -= need
            scheduled.append(r.id)
    return scheduled, preempted


def test_decode_slots_right_and_preempting_the_oldest():
    _passes("05.decode_slots", _learner_reserve)
    _fails("05.decode_slots", lambda *a: _learner_reserve(*a, victim_index=0), "preempted", "expected")


# 08
def _learner_memory(spec, tp, pp, kv_tokens, dtype="bf16", kv_dtype=None, replicate_kv=True):
    layers = math.ceil(spec.num_layers / pp)
    table = spec.vocab_size * spec.hidden_size
    tables = 2 * table if pp == 1 and not spec.tie_word_embeddings else table
    mats = layers * (spec.attn_params_per_layer + spec.mlp_params_per_layer) + tables
    weights = (mats / tp + layers * spec.norm_params_per_layer) * dtype_bytes(dtype)
    heads = max(1, spec.num_kv_heads // tp) if replicate_kv else spec.num_kv_heads / tp
    kv = 2 * layers * heads * spec.head_dim * dtype_bytes(kv_dtype or dtype) * kv_tokens
    return {"weights": weights, "kv": kv}


def test_memory_per_gpu_right_and_without_kv_head_replication():
    _passes("08.memory_per_gpu", _learner_memory)
    _fails("08.memory_per_gpu", lambda *a: _learner_memory(*a, replicate_kv=False), "'kv': expected", "TP8")


def test_max_batch_right_and_without_headroom():
    def mb(spec, tp, context, gpu, dtype="bf16", kv_dtype=None, headroom=0.9, use_headroom=True):
        m0 = memory_per_device(spec, tp, 1, 0, dtype, kv_dtype)["weights"]
        per = memory_per_device(spec, tp, 1, context, dtype, kv_dtype)["kv"]
        return max(0, int(((headroom if use_headroom else 1.0) * gpu - m0) // per))

    _passes("08.max_batch", mb)
    _fails("08.max_batch", lambda *a: mb(*a, use_headroom=False), "expected")


def test_exercise_sources_live_beside_the_notebook_sources():
    assert EXERCISE_DIR.is_dir() and len(list(EXERCISE_DIR.glob("0[0-9]_*.py"))) == 10


@pytest.mark.notebooks
def test_exercise_cells_run_headless_as_the_workbook_runner_runs_them(tmp_path):
    """Every exercise cell of notebooks 00-09, in one notebook, under papermill with the runner's environment: the
    skeletons are replaced by the solutions and every check passes (predictions set against the committed records)."""
    from labkit.workbook import NOTEBOOK_DIR, _render, execute_notebook, notebook_from_percent

    src = '# %% tags=["parameters"]\nprofile = "ci"\n' + "".join(exercise_source(nn) for nn in NOTEBOOKS)
    nb = tmp_path / "src" / "99_exercises.ipynb"
    nb.parent.mkdir()
    nb.write_text(_render(notebook_from_percent(src)))
    assert NOTEBOOK_DIR.is_dir()
    execute_notebook(nb, tmp_path / "out", profile="ci", timeout=300)
    out = json.loads((tmp_path / "out" / nb.name).read_text())
    text = "".join("".join(o.get("text", "")) for c in out["cells"] for o in c.get("outputs", []))
    assert text.count("checking labkit's reference solution instead") == len(NAMES), text
    assert text.count("cases passed") == len(NAMES), text
    assert text.count("predict then measure:") >= sum(ex.kind == "predict-then-measure" for ex in exercises()), text


def test_decode_floor_right_and_reading_the_whole_embedding_table():
    def floor(spec, batch, context, dtype, bw, skip_table=True):
        params = spec.num_params - (spec.embedding_params if skip_table and not spec.tie_word_embeddings else 0)
        kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * batch * context
        return (params + kv) * dtype_bytes(dtype) / bw

    _passes("01.decode_floor", floor)
    _fails("01.decode_floor", lambda *a: floor(*a, skip_table=False), "llama-3-8b", "expected")


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def softmax_kernel_pads_zeros(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def softmax_kernel_no_max(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=float("-inf"))
    e = tl.exp(x)
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_softmax_kernel_right_wrong_padding_and_without_the_maximum():
    _passes("03.softmax", softmax_kernel)
    _fails("03.softmax", softmax_kernel_pads_zeros, "x [3, 37]", "elements differ")
    _fails("03.softmax", softmax_kernel_no_max, "NaN")


def test_a_half_filled_function_that_fails_otherwise_is_a_failure_not_untried():
    def half(tokens, d_in, d_out, bytes_per_el, peak_flops, bandwidth):
        if tokens < 0:
            raise NotImplementedError("the negative case")
        return tokens * None

    r = _check("01.linear_roofline", half)
    assert r.status == "fail" and "TypeError" in r.message, r.message


def test_skeleton_source_gives_back_the_cell_to_start_again():
    from labkit.exercises import skeleton_source

    src = skeleton_source("02.cow")
    assert src.startswith("from labkit.kvcache.block_allocator import BlockAllocator") and "class MyBlockTables" in src
    assert 'raise NotImplementedError("fill in softmax_kernel")' in skeleton_source("03.softmax")
    with pytest.raises(ValueError, match="02.cow"):
        skeleton_source("02.nothing")


# --- exercises of judgement: decisions and predictions set against measurements -----------------------------------
def _solution_lines(name):
    """The code lines of an exercise's solution (its docstring and comments left out): none may reach a report."""
    src = inspect.getsource(REGISTRY[name].solution)
    doc = inspect.getdoc(REGISTRY[name].solution) or ""
    return [ln.strip() for ln in src.splitlines()[1:] if len(ln.strip()) > 20 and ln.strip() not in doc
            and not ln.strip().startswith(("#", '"""')) and ("=" in ln or "return" in ln)]


def _judged_fails(name, impl, *needles):
    """A plausible wrong answer: it fails, the report shows expected and actual, and never the solution."""
    r = _fails(name, impl, "expected", *needles)
    leaked = [ln for ln in _solution_lines(name) if ln in r.message]
    assert not leaked, f"the report of {name} shows the solution's code: {leaked}"
    if isinstance(REGISTRY[name], Prediction):
        assert "predict then measure: waits until every case passes" in r.message and not r.measurements
    return r


# 00
def test_fifo_p99_right_and_without_the_prefill_or_the_load_in_the_log():
    def fifo(n, rate, service, prefill, with_prefill=True, log_rho=True):
        rho = rate * service
        if rho >= 1:
            wait = (n - 1) * 0.99 * (service - 1 / rate)
        else:
            wait = max(0.0, -service / (1 - rho) * math.log(0.01 / (rho if log_rho else 1)))
        return wait + (prefill if with_prefill else 0)

    _passes("00.fifo_p99_ttft", fifo)
    _judged_fails("00.fifo_p99_ttft", lambda *a: fifo(*a, with_prefill=False), "half capacity")
    _judged_fails("00.fifo_p99_ttft", lambda *a: fifo(*a, log_rho=False), "ratio")


def test_static_vs_fifo_right_and_pricing_the_partial_batch_as_a_full_one():
    def static(lens, batch, step_s, partial_right=True):
        groups = [lens[i:i + batch] for i in range(0, len(lens), batch)]
        t = sum(max(g) * step_s[len(g) if partial_right else batch] for g in groups)
        fifo = sum(lens) * step_s[1]
        return {"fifo_s": fifo, "static_s": t, "speedup": fifo / t,
                "useful_slot_frac": sum(lens) / sum(len(g) * max(g) for g in groups),
                "choice": "static" if t < fifo else "FIFO"}

    _passes("00.static_vs_fifo", static)
    _judged_fails("00.static_vs_fifo", lambda *a: static(*a, partial_right=False), "static_s", "one long request")


# 01
def test_classify_ops_right_and_strict_at_the_ridge():
    def classify(ops, peak, bw, factor=5.0, strict=False):
        out = {}
        for r in ops:
            floor = max(r["flops"] / peak, r["bytes"] / bw)
            intensity = math.inf if r["bytes"] == 0 else r["flops"] / r["bytes"]
            if floor == 0 or r["time_s"] / floor > factor:
                out[r["op"]] = "launch-bound"
            else:
                above = intensity > peak / bw if strict else intensity >= peak / bw
                out[r["op"]] = "compute-bound" if above else "memory-bound"
        return out

    _passes("01.classify_ops", classify)
    _judged_fails("01.classify_ops", lambda *a: classify(*a, strict=True), "exactly at the ridge",
                  "expected 'compute-bound', got 'memory-bound'")


# 02
def test_paged_capacity_right_and_averaged_over_requests():
    def capacity(prompts, outputs, budget, slab, bs, over_steps=True):
        if over_steps:
            steps = [(p + t) for p, o in zip(prompts, outputs) for t in range(1, o + 1)]
            held = sum(math.ceil(x / bs) * bs for x in steps) / len(steps)
        else:
            held = sum(math.ceil((p + o / 2) / bs) * bs for p, o in zip(prompts, outputs)) / len(prompts)
        return {"contiguous_seqs": budget // slab, "paged_seqs": budget / held,
                "ratio": budget / held / (budget // slab)}

    _passes("02.paged_capacity", capacity)
    _judged_fails("02.paged_capacity", lambda *a: capacity(*a, over_steps=False), "paged_seqs")


# 03
def test_int8_kv_speedup_right_and_without_the_scales():
    def kv(seqs, heads, kv_heads, dim, ctx, scale_bytes=4, scales=True):
        cache = 2 * seqs * ctx * kv_heads * dim
        qo = 4 * seqs * heads * dim
        int8 = cache + (2 * seqs * ctx * kv_heads * scale_bytes if scales else 0) + qo
        return {"bf16_bytes": 2 * cache + qo, "int8_bytes": int8, "speedup": (2 * cache + qo) / int8}

    _passes("03.int8_kv_speedup", kv)
    _judged_fails("03.int8_kv_speedup", lambda *a: kv(*a, scales=False), "int8_bytes")


# 04
def test_group_size_right_and_forgetting_the_zero_point_or_choosing_the_least_error():
    from labkit.kernels.quantized_matmul.packing import dequantize_int4
    from labkit.quant.weight_only import quantize_int4

    def choose(w, sizes, bar, scale_bytes=2, zero=True, least_error=False):
        table = {}
        for g in sizes:
            deq = dequantize_int4(*quantize_int4(w, g), g)
            table[g] = {"rel_err": float(torch.linalg.norm(deq - w) / torch.linalg.norm(w)),
                        "bytes_per_weight": 0.5 + (2 if zero else 1) * scale_bytes / g}
        ok = [g for g in sizes if table[g]["rel_err"] <= bar]
        pick = (min(ok, key=lambda g: table[g]["rel_err"]) if least_error else max(ok)) if ok else None
        return {"table": table, "choice": pick}

    _passes("04.group_size", choose)
    _judged_fails("04.group_size", lambda *a: choose(*a, zero=False), "bytes_per_weight")
    _judged_fails("04.group_size", lambda *a: choose(*a, least_error=True), "'choice'")


def test_decode_speedup_right_and_reading_the_embedding_table_too():
    def speedup(spec, method, context, group=128, scale_bytes=2, embedding=False):
        def step(m):
            bpw = {"bf16": 2, "int8": 1 + scale_bytes / spec.hidden_size, "int4": 0.5 + 2 * scale_bytes / group}[m]
            linears = spec.num_layers * (spec.attn_params_per_layer + spec.mlp_params_per_layer)
            tables = (2 if embedding else 1) * spec.vocab_size * spec.hidden_size
            norms = spec.num_layers * spec.norm_params_per_layer + spec.hidden_size
            kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * context * 2
            return linears * bpw + 2 * (tables + norms) + kv
        return {"bf16_bytes": step("bf16"), "bytes": step(method), "speedup": step("bf16") / step(method)}

    _passes("04.decode_speedup", speedup)
    _judged_fails("04.decode_speedup", lambda *a: speedup(*a, embedding=True), "bf16_bytes")


# 06
def test_tp_plan_right_and_one_all_reduce_per_row_linear():
    def plan(block, hidden, b, tp, per_row=False):
        splits = {n: ("column" if set(ins) <= {"x", "encoder"} else "row") for sub in block
                  for n, ins in sub["linears"].items()}
        n = sum((sum(splits[x] == "row" for x in sub["residual"]) if per_row else
                 any(splits[x] == "row" for x in sub["residual"])) for sub in block)
        return {"splits": splits, "all_reduces": n, "bytes_per_token": n * hidden * b,
                "wire_bytes_per_token": 2 * (tp - 1) / tp * n * hidden * b}

    _passes("06.tp_plan", plan)
    _judged_fails("06.tp_plan", lambda *a: plan(*a, per_row=True), "parallel block", "'all_reduces': expected 1")


def test_tp_or_pp_right_and_with_a_one_way_all_reduce():
    def choose(layers, hidden, tokens, b, p, bw, lat, compute, objective="latency", ring=True):
        msg = tokens * hidden * b
        factor = 2 if ring else 1
        ar = 0 if p == 1 else factor * (p - 1) * lat + factor * (p - 1) / p * msg / bw
        send = 0 if p == 1 else lat + msg / bw
        tp = compute / p + 2 * layers * ar
        out = {"tp_comm_s": 2 * layers * ar, "pp_comm_s": (p - 1) * send, "tp_latency_s": tp,
               "pp_latency_s": compute + (p - 1) * send, "tp_step_s": tp, "pp_step_s": compute / p + send}
        k = "latency_s" if objective == "latency" else "step_s"
        out["choice"] = "TP" if out["tp_" + k] <= out["pp_" + k] else "PP"
        return out

    _passes("06.tp_or_pp", choose)
    _judged_fails("06.tp_or_pp", lambda *a: choose(*a, ring=False), "tp_comm_s")


# 07
def test_lora_rank_right_and_with_query_heads_for_k_and_v():
    def rank(spec, losses, budget, targets, per=16, tol=0.0, gqa=True):
        kv = (spec.num_kv_heads if gqa else spec.num_heads) * spec.head_dim
        q, h, ff = spec.num_heads * spec.head_dim, spec.hidden_size, spec.intermediate_size
        size = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h, "gate_proj": h + ff,
                "up_proj": h + ff, "down_proj": ff + h}
        n = spec.num_layers * sum(size[t] for t in targets)
        table = {r: {"trainable_params": r * n, "bytes": r * n * per, "loss": loss} for r, loss in losses.items()}
        fit = sorted(r for r in table if table[r]["bytes"] <= budget)
        if not fit:
            return {"table": table, "choice": None}
        best = min(table[r]["loss"] for r in fit)
        return {"table": table, "choice": next(r for r in fit if table[r]["loss"] <= best + tol)}

    _passes("07.lora_rank", rank)
    _judged_fails("07.lora_rank", lambda *a: rank(*a, gqa=False), "trainable_params", "llama-3-8b")


# 08
def test_gpus_for_slo_right_and_rounding_replicas_down():
    def gpus(spec, batch, ctx, w, kv, gpu, rate, out_mean, tpot, headroom=0.9, per_node=8, ceil=True):
        kv_tok = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes(kv)
        need = spec.num_params * dtype_bytes(w) + batch * ctx * kv_tok
        tp = next((t for t in (1, 2, 4, 8) if t <= per_node and spec.num_heads % t == 0
                   and need <= t * headroom * gpu), None)
        if tp is None:
            return {"kv_bytes_per_token": kv_tok, "mem_per_gpu": None, "tp": None, "replicas": None, "gpus": None}
        reps = (math.ceil if ceil else math.floor)(rate * out_mean * tpot / batch)
        return {"kv_bytes_per_token": kv_tok, "mem_per_gpu": need / tp, "tp": tp, "replicas": reps,
                "gpus": tp * reps}

    _passes("08.gpus_175b", gpus)
    _judged_fails("08.gpus_175b", lambda *a: gpus(*a, ceil=False), "'replicas'")


def test_the_175b_kv_per_token_is_the_issue_s_4_5_mib():
    from labkit.model import get_config

    out = REGISTRY["08.gpus_175b"].solution(get_config("gpt3-175b"), 1, 1, "bf16", "bf16", 141e9, 1.0, 1, 0.1)
    assert out["kv_bytes_per_token"] == 2 * 96 * 12288 * 2 == 4.5 * 2**20


# 09
def test_spec_speedup_right_and_without_the_draft_cost():
    def speedup(alpha, k, c, c_d=0.0, draft=True):
        e = sum(alpha ** i for i in range(k + 1))
        return {"tokens_per_step": e, "speedup": e / ((k * c_d if draft else 0) + c)}

    _passes("09.spec_speedup", speedup)
    _judged_fails("09.spec_speedup", lambda *a: speedup(*a, draft=False), "'speedup'")


def test_best_k_right_and_speculating_when_it_only_breaks_even():
    def best(alpha, costs, c_d=0.0, strict=True):
        out = {}
        for b, table in costs.items():
            rows = [(k, (k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)) / (k * c_d + c))
                    for k, c in sorted(table.items())]
            k, s = max(rows, key=lambda r: (r[1], -r[0]))
            out[b] = (k, s) if (s > 1 if strict else s >= 1) else (0, 1.0)
        return out

    _passes("09.best_k", best)
    _judged_fails("09.best_k", lambda *a: best(*a, strict=False), "a tie at exactly 1x")


# --- the measurement side of predict-then-measure -----------------------------------------------------------------
PREDICTIONS = [ex.name for ex in exercises() if ex.kind == "predict-then-measure"]


@pytest.mark.parametrize("name", PREDICTIONS)
def test_a_passing_prediction_is_set_against_the_committed_records_when_this_run_has_none(name):
    r = _check(name, REGISTRY[name].solution)
    assert r.status == "pass" and r.measurements, r.message
    for m in r.measurements:
        assert "error" not in m and m["source"].startswith("the committed results/"), m
        assert isinstance(m["inside"], bool)
    assert r.message.count("why they differ: ") == len(r.measurements)
    assert "predict then measure:" in r.message and ("measured:" in r.message or "the planner:" in r.message)


def test_a_run_that_recorded_the_figure_is_used_before_the_committed_record(tmp_path, monkeypatch):
    """This run's record (here: the committed 09 record with other measured speed-ups) wins, and the check says so."""
    run = tmp_path / "run"
    (run / "records").mkdir(parents=True)
    rec = json.loads((REPO_ROOT / "results/cpu/records/09_speculative.json").read_text())
    rec["data"]["measured"] = {"draft": 0.5, "prompt_lookup": 2.0}
    (run / "records" / "09_speculative.json").write_text(json.dumps(rec))
    (run / "figures.json").write_text(json.dumps({"spec.measured_speedup_b1": {
        "value": 0.5, "unit": "ratio", "machine": "cpu", "record": str(run / "records" / "09_speculative.json")}}))
    monkeypatch.setenv("LABKIT_OUT", str(run))
    r = _check("09.spec_speedup", REGISTRY["09.spec_speedup"].solution)
    assert [m["measured"] for m in r.measurements] == [0.5, 2.0], r.message
    assert all(m["source"].startswith("this run's ") for m in r.measurements), r.message
    assert "measured / predicted" in r.message


def test_no_measurement_anywhere_is_said_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_SUMMARY", str(tmp_path / "no-summary.json"))
    r = _check("00.fifo_p99_ttft", REGISTRY["00.fifo_p99_ttft"].solution)
    assert r.status == "pass" and not r.measurements
    assert "no measurement to compare with" in r.message and "baseline.fifo_ttft_p99_peak_s" in r.message


def test_a_learner_s_own_prediction_is_the_one_compared(tmp_path):
    def fifo(n, rate, service, prefill):  # right on every case, written another way
        rho = rate * service
        if rho < 1:
            return prefill + max(0.0, service * math.log(100 * rho) / (1 - rho))
        return prefill + 0.99 * (n - 1) * (service - 1 / rate)

    r = _check("00.fifo_p99_ttft", fifo)
    assert r.status == "pass" and "your prediction:" in r.message and "labkit's prediction" not in r.message
    assert len(r.measurements) >= 2  # one per load of the sweep


def test_the_headless_check_of_a_prediction_uses_labkit_s_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_PROFILE", "ci")

    def skeleton(*a):
        raise NotImplementedError

    r = check("00.fifo_p99_ttft", skeleton)
    out = capsys.readouterr().out
    assert r.status == "pass" and r.used_solution and "labkit's prediction:" in out and "why they differ" in out


def test_a_measurement_from_a_record_of_another_shape_is_reported_not_raised(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "records").mkdir(parents=True)
    (run / "records" / "01_diagnose.json").write_text(json.dumps({"env": {}, "data": {"no": "regimes"}}))
    (run / "figures.json").write_text(json.dumps({"diagnose.regime_matmul": {
        "value": "x", "unit": "regime", "machine": "cpu", "record": str(run / "records" / "01_diagnose.json")}}))
    monkeypatch.setenv("LABKIT_OUT", str(run))
    r = _check("01.classify_ops", REGISTRY["01.classify_ops"].solution)
    assert r.status == "pass" and "no measurement to compare with" in r.message, r.message


def test_the_readme_counts_the_exercises_it_describes():
    text = (REPO_ROOT / "README.md").read_text()
    para = text[text.index("## Exercises"):text.index("## The embedded model")]
    assert f"{len(NAMES)} in all" in para and "00 to 09" in para
    labels = {"implement": "Implement", "decide": "Decide", "predict-then-measure": "Predict then measure"}
    for kind, label in labels.items():
        assert f"**{label}** ({sum(ex.kind == kind for ex in exercises())})" in para, kind
