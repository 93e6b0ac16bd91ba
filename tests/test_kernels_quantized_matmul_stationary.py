"""The stationary-activation GEMVs (one 16-bit row, whole tiles; int4 and int8) and what they take in -- SwiGLU,
RMSNorm, the residual add, RoPE with the paged-cache write, programmatic dependent launch -- against the torch
references and the separate kernels. Tiles are passed as tuning data (``QuantTuning``)."""

from dataclasses import replace

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.common import KernelLog, next_pow2
from labkit.kernels.quantized_matmul import (
    StationaryRule,
    StationaryTile,
    pack_int4,
    splitk,
    stationary,
    stationary_plan,
    tuning_for,
    w4a16_matmul,
    w4a16_matmul_ref,
    w4a16_qkv_rope_cache,
    w8a16_matmul,
    w8a16_matmul_ref,
    w8a16_qkv_rope_cache,
)

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA
FORMATS = ["int4", "int8"]
LAUNCHER = {"int4": "w4_gemv_xs", "int8": "w8_gemv_xs"}  # each format's stationary GEMV launcher


def _int8(n, k, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q, s = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.01 + 1e-3
    return q.to(device), s.to(device)


def _int4(n, k, group, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    packed = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zeros = torch.rand(n, k // group, generator=g) * 15
    return packed.to(device), scales.to(device), zeros.to(device)


def _x(shape, dtype, seed, device=DEVICE):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _tile(block_n, block_k, row_steps=None, num_warps=1, reduce_floats=4096):
    """The device's tuning with every stationary GEMV on one tile (no whole-K rule)."""
    rule = StationaryRule(split=StationaryTile(block_n, block_k, num_warps, row_steps), reduce_floats=reduce_floats)
    return replace(tuning_for(torch.device(DEVICE)), w4_stationary=rule, w8_stationary=rule)


class Launches(KernelLog):
    """The launches of one stationary launcher (``w4_gemv_xs`` / ``w8_gemv_xs``) that the calls handed it as ``log=``
    recorded (the public kernel log of ``labkit.kernels.common``): ``KernelCall`` s with their plan and neighbours."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def record(self, op, kernel, *args, **kwargs) -> None:
        if kernel == self.name:
            super().record(op, kernel, *args, **kwargs)


def _kwargs(calls: Launches) -> list[list[str]]:
    """The neighbours each launch took in, by name (``pdl`` too where it was set)."""
    return [sorted(c.fused + (("pdl",) if c.pdl else ())) for c in calls]


def _zero_residual(x: torch.Tensor, n: int, kw: dict) -> dict:
    """``kw`` with a zero residual where it asks for no neighbour: an int8 product on the stationary GEMV, the kernel
    a fused one takes (a bare one keeps the split-K GEMV), with a bare product's bits (``y + 0`` is ``y``)."""
    if kw.get("swiglu") or kw.get("pdl") or kw.get("norm_weight") is not None or kw.get("residual") is not None:
        return kw
    return {**kw, "residual": torch.zeros(*x.shape[:-1], n, dtype=x.dtype, device=x.device)}


def _layer(fmt, n, k, dtype, seed, group=64, scale=1.0, tuning=None, log=None):
    """Random weights ``[n, k]`` of ``fmt`` (scales in ``dtype``, times ``scale``) as ``(matmul, ref)``:
    ``matmul(x, **neighbours)`` (``w4a16_matmul`` / ``w8a16_matmul``; int8's bare product with a zero residual, so
    that it runs on the same kernel as a fused one: comparable bits) and its float64 reference."""
    opts = {"log": log, **({} if tuning is None else {"tuning": tuning})}
    if fmt == "int4":
        packed, scales, zeros = _int4(n, k, group, seed)
        args = (packed, (scales * scale).to(dtype), zeros.to(dtype), group)
        return (lambda x, **kw: w4a16_matmul(x, *args, **opts, **kw)), (lambda x: w4a16_matmul_ref(x.double(), *args))
    q, s = _int8(n, k, seed)
    args = (q, (s * scale).to(dtype))
    return ((lambda x, **kw: w8a16_matmul(x, *args, **opts, **_zero_residual(x, n, kw))),
            (lambda x: w8a16_matmul_ref(x.double(), *args)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 3e3])
def test_w4a16_gemv_half_math_at_any_activation_scale(dtype, magnitude):
    """16-bit activations take packed float16 math (PTX on CUDA, emulated on the interpreter) with a power of
    two per group that puts its largest |x| in [256, 512): as accurate for tiny activations as for ones whose
    float16 partial sums would overflow unscaled; a group of zeros stays zero."""
    packed, scales, zeros = _int4(64, 512, 128, seed=40)
    x = _x((1, 512), torch.float32, seed=41) * magnitude
    x[0, ::37] *= 10  # outliers inside groups
    x[0, 128:256] = 0
    xd = x.to(dtype)
    args = (packed, scales.to(dtype), zeros.to(dtype), 128)
    assert relative_error(w4a16_matmul(xd, *args), w4a16_matmul_ref(xd.double(), *args)) < 1e-2


# the stationary GEMVs' tiles: (block_n, block_k, row_steps); block_k is raised to groups wider than it; 1 row step
# with a prefetch that loads nothing; 3 or 5 slices (a reduction tile padded to 4 or 8 with masked-off slices)
XS_TILES = [(8, 128, 1), (8, 128, 4), (16, 64, 2), (4, 256, 4)]


@pytest.mark.parametrize("tile", XS_TILES)
@pytest.mark.parametrize("group", [32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_gemv_stationary_activations(tile, group, dtype):
    bn, bk, steps = tile
    n, k = 2 * bn * steps, 5 * max(bk, group) if group < 256 else 3 * max(bk, group)
    launched = Launches("w4_gemv_xs")
    packed, scales, zeros = _int4(n, k, group, seed=50)
    packed[0, 0] = 0xF0  # q = 0 and 15 in one byte
    x = _x((1, k), dtype, seed=51)
    args = (packed, scales.to(dtype), zeros.to(dtype), group)
    out = w4a16_matmul(x, *args, tuning=_tile(bn, bk, steps), log=launched)
    plan = launched[0].plan
    assert plan.row_steps == steps and plan.block_k == max(bk, group) and plan.pair_words
    assert relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert torch.equal(w4a16_matmul(x, *args, tuning=_tile(bn, bk, steps)), out)  # slices summed in a fixed order
    _, counters = splitk._split_buffers(out.device, n)
    assert not counters.any()  # every row chunk's last slice reset its counter


@pytest.mark.parametrize("group", [8, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_stationary_word_pairs(group, dtype):
    """Word pairs (two words' sixteen products in the same float16 lanes; groups of 8 weights are one word, not
    paired): within the tolerance of the reference, also where every lane is at its bound -- nibbles of 15 against
    activations of one sign, each group's largest scaled to just under 512, eight products a lane -- and pairs
    refused for groups of one word."""
    launched = Launches("w4_gemv_xs")
    tuning = _tile(8, 128, 2)
    packed, scales, zeros = _int4(32, 384, group, seed=60)
    x = _x((1, 384), dtype, seed=61)
    args = (packed, scales.to(dtype), zeros.to(dtype), group)
    out = w4a16_matmul(x, *args, tuning=tuning, log=launched)
    assert relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    packed[:8] = 0xFF  # q = 15 everywhere in the first row block
    x = x.abs() * 3e3 + 1
    args = (packed, scales.to(dtype) / 3e3, zeros.to(dtype), group)
    out = w4a16_matmul(x, *args, tuning=tuning, log=launched)
    assert out.isfinite().all() and relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert len(launched) == 2 and all(c.plan.pair_words == (group >= 16) for c in launched)
    paired = replace(launched[0].plan, pair_words=True)
    with pytest.raises(ValueError, match="pair_words needs groups of two int32 words or more"):
        stationary.w4_gemv_xs(x, packed.view(torch.int32), scales.to(dtype), zeros.to(dtype), 8, paired)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stationary_gemv_with_the_whole_of_k_in_one_program(dtype):
    """One slice (``block_k == K``): each program stores its rows itself, no partials, no counters."""
    tuning = _tile(4, 512, 2)
    packed, scales, zeros = _int4(40, 512, 128, seed=56)
    x = _x((1, 512), dtype, seed=57)
    args = (packed, scales.to(dtype), zeros.to(dtype), 128)
    plan = stationary_plan(40, 512, 128, tuning.w4_stationary, 4)
    assert plan.split_p2 == 1 and plan.block_k == 512
    out = w4a16_matmul(x, *args, tuning=tuning)
    assert relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert not splitk._split_buffers(out.device, 40)[1].any()


@pytest.mark.parametrize("tile", XS_TILES + [(2, 512, 2)])  # the last: the whole of K in a program
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a16_gemv_stationary_activations(tile, dtype):
    """The stationary int8 GEMV (``w8_gemv_xs``, taken with a zero residual) on one 16-bit row, over slices of K or
    all of it, each row's words read in place: within the tolerance of the reference (int8 weights of every value,
    -128 and 127 in one word), the same bits twice, every counter reset."""
    bn, bk, steps = tile
    n, k = 2 * bn * steps, 512 if bk == 512 else 5 * bk
    launched = Launches("w8_gemv_xs")
    q, s = _int8(n, k, seed=150)
    q[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    x = _x((1, k), dtype, seed=151)
    args = (q, s.to(dtype))
    zero = _zero_residual(x, n, {})
    out = w8a16_matmul(x, *args, tuning=_tile(bn, bk, steps), log=launched, **zero)
    plan = launched[0].plan
    assert plan.row_steps == steps and plan.split_p2 == next_pow2(k // bk)
    assert relative_error(out, w8a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert torch.equal(w8a16_matmul(x, *args, tuning=_tile(bn, bk, steps), **zero), out)
    assert not splitk._split_buffers(out.device, n)[1].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 3e3])
def test_w8a16_stationary_half_math_at_any_activation_scale(dtype, magnitude):
    """The packed float16 path scales each slice's activations by a power of two into [32, 64): no float16 lane
    overflows at large activations (``|q x|`` up to 128 * 64, four a lane) and small ones keep their bits -- with
    weights of +-127 and -128 and one activation far above the others."""
    q, s = _int8(32, 256, seed=155)
    q[:, ::3] = 127
    q[:, 1::3] = -128
    x = _x((1, 256), dtype, seed=156) * magnitude
    x[0, 7] = 20 * magnitude
    args = (q, (s / max(1.0, magnitude)).to(dtype))  # outputs within float16's range
    out = w8a16_matmul(x, *args, tuning=_tile(8, 128), **_zero_residual(x, 32, {}))
    assert relative_error(out, w8a16_matmul_ref(x.double(), *args)) < TOL[dtype]


def test_bare_int8_products_keep_the_split_k_gemv():
    """Only a product with neighbours (or PDL) takes the stationary int8 GEMV; a bare one keeps the autotuned
    split-K GEMV whose speed notebook 03 measures. Unaligned words never take it. The kernel log says which ran."""
    tuning = _tile(8, 128)
    log = KernelLog()
    q, s = _int8(64, 256, seed=152)
    x = _x((1, 256), torch.float16, seed=153)
    res = _x((1, 64), torch.float16, seed=154)
    w8a16_matmul(x, q, s.half(), tuning=tuning, log=log)
    assert log.kernels() == ["splitk_gemv"]
    w8a16_matmul(x, q, s.half(), residual=res, tuning=tuning, log=log)
    assert log[-1].kernel == "w8_gemv_xs" and log[-1].fused == ("residual",) and log[-1].plan is not None
    log.clear()
    q_odd = torch.empty(64, 257, dtype=torch.int8, device=DEVICE)[:, 1:]  # rows off 4-byte boundaries
    q_odd.copy_(q)
    out = w8a16_matmul(x, q_odd, s.half(), residual=res, tuning=tuning, log=log)
    assert log.kernels() == ["splitk_gemv"] and torch.equal(out, w8a16_matmul(x, q, s.half(), tuning=tuning) + res)
    log.clear()
    w8a16_matmul(x.expand(3, 256).contiguous(), q, s.half(), residual=res.expand(3, 64), log=log)
    assert [(c.kernel, c.rows) for c in log] == [("quantized_gemm", 3)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fuse", ["plain", "residual", "swiglu"])
def test_stationary_reduction_in_tiles_smaller_than_a_row_chunk(fmt, fuse):
    """The last slice of a row chunk sums the slices' partials ``reduction`` rows at a time: with reduction tiles
    smaller than a chunk (8 rows of 16) and irregular slice counts (5 and 3, padded to 8 and 4), within the
    reference's tolerance, the same bits twice in a row, every counter reset, and a NaN activation gives NaN
    rows."""
    n, k = 48, 640 if fmt == "int4" else 384  # 5 slices of 128 (int4), 3 of 128 (int8)
    tuning = _tile(8, 128, 2, reduce_floats=32)
    kx = 2 * k if fuse == "swiglu" else k
    x = _x((1, kx), torch.float16, seed=70)
    residual = _x((1, n), torch.float16, seed=71) if fuse == "residual" else None
    matmul, ref = _layer(fmt, n, k, torch.float16, seed=72, tuning=tuning)
    rule = tuning.w4_stationary
    plan = stationary_plan(n, k, 64 if fmt == "int4" else 4, rule, 4)
    assert plan.split_p2 > k // 128 and plan.red_rows < plan.block_n * plan.row_steps

    def launch(x):
        return matmul(x, swiglu=fuse == "swiglu", residual=residual)

    out = launch(x)
    expected = ref(torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float() if fuse == "swiglu" else x)
    expected = expected + residual.double() if residual is not None else expected
    assert relative_error(out, expected) < 1e-2
    assert torch.equal(launch(x), out)
    assert not splitk._split_buffers(out.device, n)[1].any()
    x_nan = x.clone()
    x_nan[0, 130] = float("nan")
    assert launch(x_nan).isnan().all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_down_projection_fused_into_the_gemv(fmt, dtype):
    """``swiglu=True``: ``silu_and_mul(x) @ W.T`` from ``x = [gate | up]``. One 16-bit row on the stationary
    GEMV computes the activation as it prepares its slice: the same bits as running ``silu_and_mul`` first;
    more rows, float32 or a ragged N run ``silu_and_mul`` first. A wrong width is refused."""
    from labkit.kernels.silu_and_mul import silu_and_mul

    fused = Launches(LAUNCHER[fmt])
    k = 256
    # 16 rows: two row blocks of the tile; 12 is not a whole number of them
    for n, rows, dt, expect_fused in [(16, 1, dtype, True), (16, 3, dtype, False), (12, 1, dtype, False),
                                      (16, 1, torch.float32, False)]:
        fused.clear()
        matmul = _layer(fmt, n, k, dt, seed=70, tuning=_tile(8, 128), log=fused)[0]
        gate_up = _x((rows, 2 * k), dt, seed=71) * 3
        if rows > 1 and dt == torch.bfloat16 and DEVICE == "cpu":
            continue  # bfloat16 tl.dot is CUDA-only; the GEMM path is tested elsewhere
        out = matmul(gate_up, swiglu=True)
        assert out.shape == (rows, n)
        assert (_kwargs(fused) == [["swiglu"]]) == expect_fused, (n, rows, dt)
        fused.clear()
        plain = matmul(silu_and_mul(gate_up))
        assert torch.equal(out, plain), (n, rows, dt)
    with pytest.raises(ValueError, match="swiglu=True"):
        matmul(_x((1, k), dtype, seed=72), swiglu=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,tile", [(384, (8, 128)), (256, (4, 256))])  # 3 slices; the whole of K
def test_norm_and_residual_fused_into_the_gemv(fmt, dtype, k, tile):
    """``norm_weight``: ``rms_norm(x) @ W.T``; ``residual``: ``residual + x @ W.T`` (the product rounded first).
    One 16-bit row on the stationary GEMV does both inside the kernel -- every program takes the row's statistic
    itself, split over K or owning all of it: within one rounding of the separate kernels (the statistic's sum runs
    in another order), the residual add bit-equal to the separate add (bfloat16 on the CPU: within a rounding, as
    Triton's interpreter casts to it by truncation). More rows, float32 or a ragged N run the separate kernels: the
    same bits as them."""
    from labkit.kernels.rms_norm import rms_norm, rms_norm_ref

    fused = Launches(LAUNCHER[fmt])
    # 16 rows: two or four row blocks of the tile; 14 is not a whole number of either
    for n, rows, dt, expect_fused in [(16, 1, dtype, True), (16, 3, torch.float16, False), (14, 1, dtype, False),
                                      (16, 1, torch.float32, False)]:
        matmul, ref_matmul = _layer(fmt, n, k, dt, seed=90, tuning=_tile(*tile), log=fused)
        x = _x((rows, k), dt, seed=91) * 4
        w = (torch.rand(k, generator=torch.Generator().manual_seed(92)) + 0.5).to(dt).to(DEVICE)
        res = _x((rows, n), dt, seed=93) * 8
        fused.clear()
        out = matmul(x, norm_weight=w, norm_eps=1e-5, residual=res)
        assert (_kwargs(fused) == [["norm", "residual"]]) == expect_fused, (n, rows, dt)
        fused.clear()
        plain = matmul(rms_norm(x, w, 1e-5)) + res
        if expect_fused:
            ref = ref_matmul(rms_norm_ref(x, w, 1e-5)) + res.double()
            assert relative_error(out, ref) < TOL[dt] and relative_error(out, plain) < TOL[dt]
            added, separate = matmul(x, residual=res), matmul(x) + res
            if dt == torch.float16 or DEVICE == "cuda":  # the interpreter casts to bfloat16 by truncation
                assert torch.equal(added, separate)
            assert relative_error(added, separate) < TOL[dt]
        else:
            assert torch.equal(out, plain), (n, rows, dt)


def _qkv_rope(fmt, n, k, dtype, seed, group=64, scale=1.0):
    """``(qkv_rope_cache, matmul, weight args)`` of ``fmt`` for random q/k/v weights ``[n, k]`` (int8's bare
    ``matmul`` with a zero residual: on the kernel the fused path takes, comparable bits)."""
    if fmt == "int4":
        packed, scales, zeros = _int4(n, k, group, seed)
        return w4a16_qkv_rope_cache, w4a16_matmul, (packed, (scales * scale).to(dtype), zeros.to(dtype), group)
    q, s = _int8(n, k, seed)
    return (w8a16_qkv_rope_cache, lambda x, *a, **kw: w8a16_matmul(x, *a, **_zero_residual(x, n, kw)),
            (q, (s * scale).to(dtype)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("norm", [False, True])
def test_qkv_rope_and_cache_inside_the_gemv(fmt, norm):
    """``w4a16_qkv_rope_cache`` / ``w8a16_qkv_rope_cache``: one float16 row on the split stationary tile walks
    each head's rows in rotary pairs and its last programs rotate q and k and write k and v to the paged caches --
    the same bits as the product then ``apply_rope_and_cache`` (4 q heads, 2 kv heads of 16 dims: two row blocks
    a head). A slot of -1 leaves the caches alone; more rows take the separate kernels; a wrong head count is
    refused."""
    from labkit.kernels.rope import apply_rope_and_cache

    fused = Launches(LAUNCHER[fmt])
    heads, kv_heads, d, k, dt = 4, 2, 16, 256, torch.float16
    n = (heads + 2 * kv_heads) * d
    qkv_rope_cache, matmul, args = _qkv_rope(fmt, n, k, dt, seed=110, scale=0.2)
    opts = dict(norm_weight=(torch.rand(k) + 0.5).to(dt).to(DEVICE), norm_eps=1e-5) if norm else {}
    opts["tuning"] = _tile(8, 128)
    ang = torch.rand(5, d // 2, generator=torch.Generator().manual_seed(111)) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt).to(DEVICE), torch.cat([ang.sin()] * 2, -1).to(dt).to(DEVICE)
    products = {}  # the separate product of each x (both one-row cases take the same x)
    for rows, slot in ((1, 13), (1, -1), (3, 5)):
        x = _x((rows, k), dt, seed=112 + rows) * 2
        slots = torch.arange(slot, slot + rows, device=DEVICE) if slot >= 0 else torch.full((rows,), -1,
                                                                                            device=DEVICE)
        caches = [[torch.full((6, 4, kv_heads, d), 7.0, dtype=dt, device=DEVICE) for _ in range(2)]
                  for _ in range(2)]
        fused.clear()
        q, kr = qkv_rope_cache(x, *args, heads, cos[:rows], sin[:rows], *caches[0], slots, **opts, log=fused)
        assert _kwargs(fused) == ([["norm", "rope"] if norm else ["rope"]] if rows == 1 else []), (rows, fused)
        fused.clear()
        if rows not in products:
            products[rows] = matmul(x, *args, **opts)
        qs, ks, vs = products[rows].split([heads * d, kv_heads * d, kv_heads * d], -1)
        ref = apply_rope_and_cache(qs.reshape(rows, heads, d), ks.reshape(rows, kv_heads, d),
                                   vs.reshape(rows, kv_heads, d), cos[:rows], sin[:rows], *caches[1], slots)
        assert torch.equal(q, ref[0]) and torch.equal(kr, ref[1]), (rows, slot)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1]), (rows, slot)
        assert (caches[0][0] == 7.0).all() == (slot < 0)
    with pytest.raises(ValueError, match="num_heads=3"):
        qkv_rope_cache(x, *args, 3, cos[:3], sin[:3], *caches[0], slots)
    with pytest.raises(ValueError, match="scale"):  # one row, as the fused path takes it: the weights checked
        qkv_rope_cache(x[:1], args[0], args[1][:, :2] if fmt == "int4" else args[1][:2], *args[2:], heads,
                       cos[:1], sin[:1], *caches[0], slots[:1])


def test_fused_gemv_arguments_are_checked():
    packed, scales, zeros = _int4(64, 256, 64, seed=94)
    args = (packed, scales.half(), zeros.half(), 64)
    x = _x((1, 256), torch.float16, seed=95)
    w = torch.ones(256, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight and swiglu"):
        w4a16_matmul(torch.cat([x, x], -1), *args, swiglu=True, norm_weight=w)
    with pytest.raises(ValueError, match="norm_weight .* must be \\[K\\]"):
        w4a16_matmul(x, *args, norm_weight=w[:128])
    with pytest.raises(ValueError, match="norm_eps"):
        w4a16_matmul(x, *args, norm_weight=w, norm_eps=-1.0)
    with pytest.raises(ValueError, match="residual .* must be the output's shape"):
        w4a16_matmul(x, *args, residual=torch.zeros(1, 32, dtype=torch.float16, device=DEVICE))
    with pytest.raises((TypeError, ValueError), match="residual"):
        w4a16_matmul(x, *args, residual=torch.zeros(1, 64, device=DEVICE))
    with pytest.raises(ValueError, match="pdl='yes' is unknown; allowed"):
        w4a16_matmul(x, *args, pdl="yes")


def test_w4a16_gemv_takes_stationary_activations_only_where_it_fits():
    """Whole tiles and 16-bit activations take the stationary kernel; a ragged N, a K that is not a whole number
    of slices or float32 activations take the split-K GEMV -- both correct (the kernel log says which ran)."""
    log = KernelLog()
    for n, k, dtype, stationary_ in [(64, 256, torch.float16, True), (60, 256, torch.float16, False),
                                     (64, 192, torch.float16, False), (64, 256, torch.float32, False)]:
        log.clear()
        packed, scales, zeros = _int4(n, k, 64, seed=52)
        x = _x((1, k), dtype, seed=53)
        out = w4a16_matmul(x, packed, scales, zeros, 64, tuning=_tile(8, 128), log=log)
        assert log.kernels() == ["w4_gemv_xs" if stationary_ else "splitk_gemv"], (n, k, dtype)
        assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, 64)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(4096, 14336), (4096, 4096)])  # 28 slices of K; all of K in each program
def test_stationary_gemv_replays_in_a_cuda_graph(fmt, n, k):
    """The stationary-activation GEMV at 8B shapes (the device's tuning): warmed up, captured, replayed with new
    activations; its counters are reset after every replay."""
    launched = Launches(LAUNCHER[fmt])
    matmul, ref = _layer(fmt, n, k, torch.bfloat16, seed=35, group=128, log=launched)
    x = _x((1, k), torch.bfloat16, seed=36)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        matmul(x)
    torch.cuda.current_stream().wait_stream(side)
    assert launched, "the stationary GEMV takes 8B shapes"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul(x)
    for seed in (37, 38):
        x.copy_(_x((1, k), torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, ref(x)) < 2e-2
        assert torch.equal(out, matmul(x))  # captured and eager: the same bits
    assert not splitk._split_buffers(x.device, n)[1].any()


@pytest.mark.gpu
def test_swiglu_down_projection_on_the_gpu():
    """The 8B down projection (4096 x 14336) with SwiGLU inside the GEMV: the same bits as ``silu_and_mul`` then
    the GEMV, eagerly and replayed in a CUDA graph."""
    from labkit.kernels.silu_and_mul import silu_and_mul

    n, k = 4096, 14336
    packed, scales, zeros = _int4(n, k, 128, seed=80)
    args = (packed, scales.bfloat16(), zeros.bfloat16(), 128)
    gate_up = _x((1, 2 * k), torch.bfloat16, seed=81) * 2
    out = w4a16_matmul(gate_up, *args, swiglu=True)
    assert torch.equal(out, w4a16_matmul(silu_and_mul(gate_up), *args))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = w4a16_matmul(gate_up, *args, swiglu=True)
    gate_up.copy_(_x((1, 2 * k), torch.bfloat16, seed=82))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, w4a16_matmul(silu_and_mul(gate_up), *args))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,fuse", [(6144, 4096, "norm"), (28672, 4096, "norm"), (4096, 4096, "residual"),
                                      (4096, 14336, "swiglu+residual")])
def test_layer_ops_fused_into_the_gemv_on_the_gpu(fmt, n, k, fuse):
    """The 8B decode projections with their neighbours inside (q/k/v and gate/up after RMSNorm: whole-K and split
    programs; o and down before the residual add, down with SwiGLU too): within a rounding of the separate kernels
    (the residual add bit-equal), and the same bits eagerly and replayed in a CUDA graph."""
    from labkit.kernels.rms_norm import rms_norm
    from labkit.kernels.silu_and_mul import silu_and_mul

    matmul = _layer(fmt, n, k, torch.bfloat16, seed=100, group=128, scale=0.1)[0]
    swiglu = fuse.startswith("swiglu")
    x = _x((1, 2 * k if swiglu else k), torch.bfloat16, seed=101) * 3
    opts = dict(swiglu=swiglu)
    if fuse == "norm":
        opts["norm_weight"] = (torch.rand(k, device=DEVICE) + 0.5).bfloat16()
    else:
        opts["residual"] = _x((1, n), torch.bfloat16, seed=102) * 5

    def separate(x):
        y = silu_and_mul(x) if swiglu else x
        y = rms_norm(y, opts["norm_weight"], 1e-6) if fuse == "norm" else y
        out = matmul(y)
        return out + opts["residual"] if "residual" in opts else out

    out = matmul(x, **opts)
    assert relative_error(out, separate(x)) < 1e-2
    if fuse != "norm":
        assert torch.equal(out, separate(x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = matmul(x, **opts)
    x.copy_(_x(x.shape, torch.bfloat16, seed=103))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, matmul(x, **opts))
    assert relative_error(replayed, separate(x)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_qkv_rope_and_cache_inside_the_gemv_on_the_gpu(fmt):
    """The 8B q/k/v projection (32 q heads, 8 kv heads of 128) with its RMSNorm, RoPE and the cache write in one
    GEMV, against the product then ``apply_rope_and_cache`` (within a rounding: the compiled kernels may contract
    the rotation into FMAs differently), eagerly and replayed in a CUDA graph at a new slot."""
    from labkit.kernels.rope import apply_rope_and_cache

    heads, kv_heads, d, k, dt = 32, 8, 128, 4096, torch.bfloat16
    n = (heads + 2 * kv_heads) * d
    fused = Launches(LAUNCHER[fmt])
    qkv_rope_cache, matmul, args = _qkv_rope(fmt, n, k, dt, seed=120, group=128, scale=0.1)
    opts = dict(norm_weight=(torch.rand(k, device=DEVICE) + 0.5).to(dt), norm_eps=1e-5)
    ang = torch.rand(1, d // 2, device=DEVICE) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    x = _x((1, k), dt, seed=121) * 2

    def both(slot: torch.Tensor):
        caches = [torch.zeros(64, 16, kv_heads, d, dtype=dt, device=DEVICE) for _ in range(4)]
        fused.clear()
        got = qkv_rope_cache(x, *args, heads, cos, sin, caches[0], caches[1], slot, **opts, log=fused)
        assert _kwargs(fused) == [["norm", "rope"]]  # the fused path, not the fallback
        qs, ks, vs = matmul(x, *args, **opts).split([heads * d, kv_heads * d, kv_heads * d], -1)
        ref = apply_rope_and_cache(qs.view(1, heads, d), ks.view(1, kv_heads, d), vs.view(1, kv_heads, d), cos, sin,
                                   caches[2], caches[3], slot)
        for a, b in zip((*got, caches[0], caches[1]), (*ref, caches[2], caches[3])):
            assert relative_error(a, b) < 1e-2
        assert torch.equal(caches[1], caches[3])  # v is not rotated: the same bits
        return got, caches

    both(torch.tensor([77], device=DEVICE))
    slot = torch.tensor([5], device=DEVICE)
    caches = [torch.zeros(64, 16, kv_heads, d, dtype=dt, device=DEVICE) for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = qkv_rope_cache(x, *args, heads, cos, sin, *caches, slot, **opts)
    slot.fill_(300)
    x.copy_(_x((1, k), dt, seed=122))
    graph.replay()
    torch.cuda.synchronize()
    eager, eager_caches = both(slot)
    assert torch.equal(replayed[0], eager[0]) and torch.equal(caches[0], eager_caches[0])


@pytest.mark.gpu
def test_dependent_launches_wait_for_what_they_read():
    """Launched with PDL (``pdl="overlap"``, sm_90), each GEMV starts before the kernel ahead of it ends and issues
    its first weight loads early; its activations come from that kernel: a scaling kernel, then a chain of three
    GEMVs, each reading the one before's output. Captured and replayed with new inputs, every output matches the
    reference."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    launched = Launches("w4_gemv_xs")
    n = 4096
    layers = [_int4(n, n, 128, seed=60 + i) for i in range(3)]
    layers = [(p, s.bfloat16() * 0.05, z.bfloat16(), 128) for p, s, z in layers]
    x = _x((1, n), torch.bfloat16, seed=64)

    def chain():
        h = [x * 2]
        for args in layers:
            h.append(w4a16_matmul(h[-1], *args, pdl="overlap", log=launched))
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    launched.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    assert [c.pdl for c in launched] == ["overlap"] * 3
    for seed in (65, 66):
        x.copy_(_x((1, n), torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        for i, args in enumerate(layers):
            assert relative_error(outs[i + 1], w4a16_matmul_ref(outs[i].double(), *args)) < 2e-2, i
