"""W8A16 and W4A16 fused matmuls (GEMV and GEMM paths) against dequantise-then-matmul references."""

import pytest
import torch

from labkit.evaluate import relative_error
from labkit.kernels.quantized_matmul import _any_empty, w4a16_matmul, w4a16_matmul_ref, w8a16_matmul, w8a16_matmul_ref
from labkit.quant.packing import pack_int4

# the weights are exactly representable; what remains is the activations' dtype and accumulation order
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on CUDA


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


FORMATS = ["int4", "int8"]
LAUNCHER = {"int4": "w4_gemv_xs", "int8": "w8_gemv_xs"}  # each format's stationary GEMV launcher


def _spy(monkeypatch, name: str) -> list[dict]:
    """Wrap ``labkit.kernels.quantized_matmul.<name>``: the returned list gets each call's keyword arguments."""
    import labkit.kernels.quantized_matmul as qm

    real, calls = getattr(qm, name), []

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(qm, name, spy)
    return calls


def _layer(fmt, n, k, dtype, seed, group=64, scale=1.0):
    """Random weights ``[n, k]`` of ``fmt`` (scales in ``dtype``, times ``scale``) as ``(matmul, ref)``:
    ``matmul(x, **neighbours)`` (``w4a16_matmul`` / ``w8a16_matmul``) and its float64 reference."""
    if fmt == "int4":
        packed, scales, zeros = _int4(n, k, group, seed)
        args = (packed, (scales * scale).to(dtype), zeros.to(dtype), group)
        return (lambda x, **kw: w4a16_matmul(x, *args, **kw)), (lambda x: w4a16_matmul_ref(x.double(), *args))
    q, s = _int8(n, k, seed)
    args = (q, (s * scale).to(dtype))
    return (lambda x, **kw: w8a16_matmul(x, *args, **kw)), (lambda x: w8a16_matmul_ref(x.double(), *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("x_shape", [(1, 192), (37, 192), (2, 3, 192)])  # GEMV, GEMM, leading dims
def test_w8a16(dtype, x_shape):
    q, s = _int8(100, 192, seed=1)
    x = _x(x_shape, dtype, seed=2)
    out = w8a16_matmul(x, q, s)
    assert out.shape == (*x_shape[:-1], 100) and out.dtype == dtype
    assert relative_error(out, w8a16_matmul_ref(x.double(), q, s)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("group", [64, 32, 6])  # power-of-two fast path and an arbitrary even group
def test_w4a16(dtype, rows, group):
    packed, scales, zeros = _int4(100, 192, group, seed=3)
    x = _x((rows, 192), dtype, seed=4)
    out = w4a16_matmul(x, packed, scales, zeros, group)
    assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, group)) < TOL[dtype]


@pytest.mark.parametrize("group,k,rows", [(16, 96, 3), (128, 384, 5), (256, 512, 17)])
def test_w4a16_grouped_gemm(group, k, rows):
    """The GEMM for power-of-two groups: steps narrower than a group (128, 256 with the interpreter's 32-wide
    step: several steps share one scale), as wide as one (16), row counts that leave partial tiles."""
    packed, scales, zeros = _int4(50, k, group, seed=7)
    x = _x((rows, k), torch.float32, seed=8)
    out = w4a16_matmul(x, packed, scales, zeros, group)
    assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, group)) < 1e-5


# GEMV tiles and split-K on the interpreter: (BLOCK_N, BLOCK_K, SPLIT_K); 3 splits of an odd number of steps
# leaves the last split short, 16 splits of a short K leaves some empty, a step wider than K masks most of itself;
# LOAD_STAGES is a no-op here
GEMV_TILES = [(16, 64, 1), (8, 32, 3), (32, 16, 16), (4, 256, 1)]


@pytest.mark.parametrize("tile", GEMV_TILES)
# K not a multiple of any step in the second; the third is even for two tiles (no masks: `_even`)
@pytest.mark.parametrize("n, k", [(100, 192), (37, 100), (96, 192)])
def test_w8a16_gemv_split_k(monkeypatch, tile, n, k):
    import labkit.kernels.quantized_matmul as qm

    bn, bk, split = tile
    monkeypatch.setitem(qm.CPU_GEMV8, "BLOCK_N", bn)
    monkeypatch.setitem(qm.CPU_GEMV8, "BLOCK_K", bk)
    monkeypatch.setitem(qm.CPU_GEMV8, "SPLIT_K", split)
    monkeypatch.setitem(qm.CPU_GEMV8, "LOAD_STAGES", 3)
    q, s = _int8(n, k, seed=20)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)  # both ends of the range decode exactly
    x = _x((1, k), torch.float32, seed=21)
    out = w8a16_matmul(x, q, s)
    assert relative_error(out, w8a16_matmul_ref(x.double(), q, s)) < 1e-5
    assert torch.equal(w8a16_matmul(x, q, s), out)  # partials added in a fixed order: the same bits again
    _, counters = qm._split_buffers(out.device, n)
    assert not counters.any()  # every row block's last split reset its counter for the next launch


@pytest.mark.parametrize("tile", GEMV_TILES)
@pytest.mark.parametrize("group", [8, 32, 64])
@pytest.mark.parametrize("n, k", [(37, 320), (32, 256)])  # uneven splits; even for some tiles (no masks)
@pytest.mark.parametrize("prefetch", [False, True])  # loads a step ahead (where even)
def test_w4a16_gemv_split_k(monkeypatch, tile, group, n, k, prefetch):
    import labkit.kernels.quantized_matmul as qm

    bn, bk, split = tile
    monkeypatch.setitem(qm.CPU_GEMV4, "BLOCK_N", bn)
    monkeypatch.setitem(qm.CPU_GEMV4, "BLOCK_K", bk)  # raised to the group where smaller
    monkeypatch.setitem(qm.CPU_GEMV4, "SPLIT_K", split)
    monkeypatch.setitem(qm.CPU_GEMV4, "PREFETCH", prefetch)
    packed, scales, zeros = _int4(n, k, group, seed=22)  # 320 / 64 = 5 groups: uneven splits
    packed[0, 0] = 0xF0  # q = 0 and 15 in one byte
    x = _x((1, k), torch.float32, seed=23)
    out = w4a16_matmul(x, packed, scales, zeros, group)
    assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, group)) < 1e-5
    _, counters = qm._split_buffers(out.device, n)
    assert not counters.any()


def test_w4a16_gemv_bf16_and_unaligned_words():
    packed, scales, zeros = _int4(37, 256, 128, seed=24)
    x = _x((1, 256), torch.bfloat16, seed=25)  # the GEMV has no tl.dot: bfloat16 runs on the interpreter too
    ref = w4a16_matmul_ref(x.double(), packed, scales, zeros, 128)
    assert relative_error(w4a16_matmul(x, packed, scales, zeros, 128), ref) < 1e-2
    shifted = torch.empty(packed.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(packed.shape)
    shifted.copy_(packed)  # rows not on a 4-byte boundary: no int32 view, the any-group kernel instead
    assert relative_error(w4a16_matmul(x, shifted, scales, zeros, 128), ref) < 1e-2


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


# the stationary-activation int4 GEMV (16-bit activations, whole tiles): (BLOCK_N, BLOCK_K, ROW_STEPS, PREFETCH,
# WEIGHTS_FIRST); BLOCK_K is raised to groups wider than it; 1 row step with a prefetch that loads nothing; 3 or 5
# slices (a reduction tile padded to 4 or 8 with masked-off slices)
XS_TILES = [(8, 128, 1, 1, False), (8, 128, 4, 1, True), (16, 64, 2, 0, False), (4, 256, 8, 1, True)]


@pytest.mark.parametrize("tile", XS_TILES)
@pytest.mark.parametrize("group", [32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_gemv_stationary_activations(monkeypatch, tile, group, dtype):
    import labkit.kernels.quantized_matmul as qm

    bn, bk, steps, prefetch, weights_first = tile
    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=bn, BLOCK_K=bk, ROW_STEPS=steps, PREFETCH=prefetch,
                                                WEIGHTS_FIRST=weights_first, num_warps=1))
    n, k = 2 * bn * steps, 5 * max(bk, group) if group < 256 else 3 * max(bk, group)
    launched = []
    monkeypatch.setattr(qm, "w4_gemv_xs", lambda *a, f=qm.w4_gemv_xs: launched.append(a[-1]) or f(*a))
    packed, scales, zeros = _int4(n, k, group, seed=50)
    packed[0, 0] = 0xF0  # q = 0 and 15 in one byte
    x = _x((1, k), dtype, seed=51)
    args = (packed, scales.to(dtype), zeros.to(dtype), group)
    out = w4a16_matmul(x, *args)
    assert launched and launched[0]["ROW_STEPS"] == steps and launched[0]["BLOCK_K"] == max(bk, group)
    assert relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert torch.equal(w4a16_matmul(x, *args), out)  # slices summed in a fixed order: the same bits again
    _, counters = qm._split_buffers(out.device, n)
    assert not counters.any()  # every row chunk's last slice reset its counter


@pytest.mark.parametrize("group", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_stationary_word_pairs(monkeypatch, group, dtype):
    """``PAIR_WORDS`` (two words' sixteen products in the same float16 lanes): within the tolerance of the
    reference, also where every lane is at its bound -- nibbles of 15 against activations of one sign, each
    group's largest scaled to just under 512, eight products a lane -- and refused for groups of one word."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=8, BLOCK_K=128, ROW_STEPS=2, PREFETCH=1, num_warps=1,
                                                PAIR_WORDS=True))
    for name in ("XS_TILE", "XS_WHOLE_K_TILE"):  # on CUDA (the PTX)
        monkeypatch.setattr(qm, name, dict(getattr(qm, name), PAIR_WORDS=True))
    launched = []
    monkeypatch.setattr(qm, "w4_gemv_xs", lambda *a, f=qm.w4_gemv_xs: launched.append(a[-1]) or f(*a))
    packed, scales, zeros = _int4(32, 384, group, seed=60)
    x = _x((1, 384), dtype, seed=61)
    args = (packed, scales.to(dtype), zeros.to(dtype), group)
    assert relative_error(w4a16_matmul(x, *args), w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    packed[:8] = 0xFF  # q = 15 everywhere in the first row block
    x = x.abs() * 3e3 + 1
    args = (packed, scales.to(dtype) / 3e3, zeros.to(dtype), group)
    out = w4a16_matmul(x, *args)
    assert out.isfinite().all() and relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert len(launched) == 2 and all(t["PAIR_WORDS"] for t in launched)
    with pytest.raises(ValueError, match="PAIR_WORDS needs groups of two int32 words or more"):
        qm.w4_gemv_xs(x, packed.view(torch.int32), scales.to(dtype), zeros.to(dtype), 8, qm.CPU_XS_TILE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stationary_gemv_with_the_whole_of_k_in_one_program(monkeypatch, dtype):
    """One slice (``BLOCK_K == K``): each program stores its rows itself, no partials, no counters."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=4, BLOCK_K=512, ROW_STEPS=2, PREFETCH=1, num_warps=1))
    packed, scales, zeros = _int4(40, 512, 128, seed=56)
    x = _x((1, 512), dtype, seed=57)
    args = (packed, scales.to(dtype), zeros.to(dtype), 128)
    tile = qm.xs_tile(40, 512, 128, torch.device(DEVICE))
    assert tile["SPLIT_P2"] == 1 and tile["BLOCK_K"] == 512
    out = w4a16_matmul(x, *args)
    assert relative_error(out, w4a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert not qm._split_buffers(out.device, 40)[1].any()


@pytest.mark.parametrize("tile", XS_TILES + [(2, 512, 2, 1, True)])  # the last: the whole of K in a program
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half", [True, False])  # packed float16 pairs (the default), or the float32 path
def test_w8a16_gemv_stationary_activations(monkeypatch, tile, dtype, half):
    """The stationary int8 GEMV (``_w8_gemv_xs``) on one 16-bit row, over slices of K or all of it, each row's
    words read in place: within the tolerance of the reference (int8 weights of every value, -128 and 127 in one
    word), the same bits twice, every counter reset."""
    import labkit.kernels.quantized_matmul as qm

    bn, bk, steps, prefetch, weights_first = tile
    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=bn, BLOCK_K=bk, ROW_STEPS=steps, PREFETCH=prefetch,
                                                WEIGHTS_FIRST=weights_first, num_warps=1,
                                                **({} if half else {"HALF_MATH": 0})))
    monkeypatch.setattr(qm, "XS8_PLAIN", True)
    n, k = 2 * bn * steps, 512 if bk == 512 else 5 * bk
    launched = []
    monkeypatch.setattr(qm, "w8_gemv_xs", lambda *a, f=qm.w8_gemv_xs: launched.append(a[-1]) or f(*a))
    q, s = _int8(n, k, seed=150)
    q[0, :4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    x = _x((1, k), dtype, seed=151)
    args = (q, s.to(dtype))
    out = w8a16_matmul(x, *args)
    assert launched and launched[0]["ROW_STEPS"] == steps and launched[0]["SPLIT_P2"] == qm.next_pow2(k // bk)
    assert relative_error(out, w8a16_matmul_ref(x.double(), *args)) < TOL[dtype]
    assert torch.equal(w8a16_matmul(x, *args), out)
    assert not qm._split_buffers(out.device, n)[1].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 3e3])
def test_w8a16_stationary_half_math_at_any_activation_scale(monkeypatch, dtype, magnitude):
    """The packed float16 path scales each slice's activations by a power of two into [32, 64): no float16 lane
    overflows at large activations (``|q x|`` up to 128 * 64, four a lane) and small ones keep their bits -- with
    weights of +-127 and -128 and one activation far above the others."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1))
    monkeypatch.setattr(qm, "XS8_PLAIN", True)
    q, s = _int8(32, 256, seed=155)
    q[:, ::3] = 127
    q[:, 1::3] = -128
    x = _x((1, 256), dtype, seed=156) * magnitude
    x[0, 7] = 20 * magnitude
    args = (q, (s / max(1.0, magnitude)).to(dtype))  # outputs within float16's range
    assert relative_error(w8a16_matmul(x, *args), w8a16_matmul_ref(x.double(), *args)) < TOL[dtype]


def test_bare_int8_products_keep_the_split_k_gemv_until_timed(monkeypatch):
    """Without ``XS8_PLAIN`` only a product with neighbours (or PDL) takes the stationary int8 GEMV; a bare one
    keeps the autotuned split-K GEMV whose speed notebook 03 measured. Unaligned words never take it;
    ``stationary=True`` / ``False`` asks for it or refuses it."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1))
    launched = _spy(monkeypatch, "w8_gemv_xs")
    q, s = _int8(64, 256, seed=152)
    x = _x((1, 256), torch.float16, seed=153)
    res = _x((1, 64), torch.float16, seed=154)
    w8a16_matmul(x, q, s.half())
    assert launched == []
    w8a16_matmul(x, q, s.half(), residual=res)
    assert [sorted(kw) for kw in launched] == [["residual"]]
    launched.clear()
    q_odd = torch.empty(64, 257, dtype=torch.int8, device=DEVICE)[:, 1:]  # rows off 4-byte boundaries
    q_odd.copy_(q)
    out = w8a16_matmul(x, q_odd, s.half(), residual=res)
    assert launched == [] and torch.equal(out, w8a16_matmul(x, q, s.half()) + res)
    w8a16_matmul(x, q, s.half(), stationary=True)  # asked for: taken without neighbours
    assert launched == [{}]
    launched.clear()
    w8a16_matmul(x, q, s.half(), residual=res, stationary=False)  # refused: the residual added after
    assert launched == []
    with pytest.raises(ValueError, match="stationary='yes'"):
        w8a16_matmul(x, q, s.half(), stationary="yes")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_down_projection_fused_into_the_gemv(monkeypatch, fmt, dtype):
    """``swiglu=True``: ``silu_and_mul(x) @ W.T`` from ``x = [gate | up]``. One 16-bit row on the stationary
    GEMV computes the activation as it prepares its slice: the same bits as running ``silu_and_mul`` first;
    more rows, float32 or a ragged N run ``silu_and_mul`` first. A wrong width is refused."""
    import labkit.kernels.quantized_matmul as qm
    from labkit.kernels.silu_and_mul import silu_and_mul

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1))
    monkeypatch.setattr(qm, "XS8_PLAIN", True)  # the bare int8 product on the same kernel: comparable bits
    fused = _spy(monkeypatch, LAUNCHER[fmt])
    k = 256
    for n, rows, dt, expect_fused in [(64, 1, dtype, True), (64, 3, dtype, False), (60, 1, dtype, False),
                                      (64, 1, torch.float32, False)]:
        fused.clear()
        matmul = _layer(fmt, n, k, dt, seed=70)[0]
        gate_up = _x((rows, 2 * k), dt, seed=71) * 3
        if rows > 1 and dt == torch.bfloat16:
            continue  # bfloat16 tl.dot is CUDA-only; the GEMM path is tested elsewhere
        out = matmul(gate_up, swiglu=True)
        assert out.shape == (rows, n)
        assert (fused == [{"swiglu": True}]) == expect_fused, (n, rows, dt)
        fused.clear()
        plain = matmul(silu_and_mul(gate_up))
        assert torch.equal(out, plain), (n, rows, dt)
    with pytest.raises(ValueError, match="swiglu=True"):
        matmul(_x((1, k), dtype, seed=72), swiglu=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,tile", [(384, dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1)),  # 3 slices
                                    (256, dict(BLOCK_N=4, BLOCK_K=256, PREFETCH=1, num_warps=1))])  # whole K
def test_norm_and_residual_fused_into_the_gemv(monkeypatch, fmt, dtype, k, tile):
    """``norm_weight``: ``rms_norm(x) @ W.T``; ``residual``: ``residual + x @ W.T`` (the product rounded first).
    One 16-bit row on the stationary GEMV does both inside the kernel -- every program takes the row's statistic
    itself, split over K or owning all of it: within one rounding of the separate kernels (the statistic's sum runs
    in another order), the residual add bit-equal to the separate add (bfloat16 on the CPU: within a rounding, as
    Triton's interpreter casts to it by truncation). More rows, float32 or a ragged N run the separate kernels: the
    same bits as them."""
    import labkit.kernels.quantized_matmul as qm
    from labkit.kernels.rms_norm import rms_norm, rms_norm_ref

    monkeypatch.setattr(qm, "CPU_XS_TILE", tile)
    monkeypatch.setattr(qm, "XS8_PLAIN", True)  # the bare int8 product on the same kernel: comparable bits
    fused = _spy(monkeypatch, LAUNCHER[fmt])
    for n, rows, dt, expect_fused in [(64, 1, dtype, True), (64, 3, torch.float16, False), (62, 1, dtype, False),
                                      (64, 1, torch.float32, False)]:
        matmul, ref_matmul = _layer(fmt, n, k, dt, seed=90)
        x = _x((rows, k), dt, seed=91) * 4
        w = (torch.rand(k, generator=torch.Generator().manual_seed(92)) + 0.5).to(dt).to(DEVICE)
        res = _x((rows, n), dt, seed=93) * 8
        fused.clear()
        out = matmul(x, norm_weight=w, norm_eps=1e-5, residual=res)
        assert ([sorted(kw) for kw in fused] == [["norm", "residual"]]) == expect_fused, (n, rows, dt)
        fused.clear()
        plain = matmul(rms_norm(x, w, 1e-5)) + res
        if expect_fused:
            ref = ref_matmul(rms_norm_ref(x, w, 1e-5)) + res.double()
            assert relative_error(out, ref) < TOL[dt] and relative_error(out, plain) < TOL[dt]
            added = matmul(x, residual=res)
            if dt == torch.float16 or DEVICE == "cuda":  # the interpreter casts to bfloat16 by truncation
                assert torch.equal(added, matmul(x) + res)
            assert relative_error(added, matmul(x) + res) < TOL[dt]
        else:
            assert torch.equal(out, plain), (n, rows, dt)


def _qkv_rope(fmt, n, k, dtype, seed, group=64, scale=1.0):
    """``(qkv_rope_cache, matmul, weight args)`` of ``fmt`` for random q/k/v weights ``[n, k]``."""
    from labkit.kernels.quantized_matmul import w4a16_qkv_rope_cache, w8a16_qkv_rope_cache

    if fmt == "int4":
        packed, scales, zeros = _int4(n, k, group, seed)
        return w4a16_qkv_rope_cache, w4a16_matmul, (packed, (scales * scale).to(dtype), zeros.to(dtype), group)
    q, s = _int8(n, k, seed)
    return w8a16_qkv_rope_cache, w8a16_matmul, (q, (s * scale).to(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("norm,tagged", [(False, False), (True, False), (True, True)])
def test_qkv_rope_and_cache_inside_the_gemv(monkeypatch, fmt, norm, tagged):
    """``w4a16_qkv_rope_cache`` / ``w8a16_qkv_rope_cache``: one float16 row on the split stationary tile walks
    each head's rows in rotary pairs and its last programs rotate q and k and write k and v to the paged caches --
    the same bits as the product then ``apply_rope_and_cache`` (4 q heads, 2 kv heads of 16 dims: two row blocks
    a head). A slot of -1 leaves the caches alone; more rows take the separate kernels; a wrong head count is
    refused. ``tagged``: both GEMVs end in the ``TAGGED`` reduction."""
    import labkit.kernels.quantized_matmul as qm
    from labkit.kernels import common
    from labkit.kernels.rope import apply_rope_and_cache

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1, TAGGED=tagged))
    monkeypatch.setattr(common, "_WORKSPACES", {})  # fresh, to see which ones this test makes
    monkeypatch.setattr(qm, "XS8_PLAIN", True)  # the bare int8 product on the same kernel: comparable bits
    fused = _spy(monkeypatch, LAUNCHER[fmt])
    heads, kv_heads, d, k, dt = 4, 2, 16, 256, torch.float16
    n = (heads + 2 * kv_heads) * d
    qkv_rope_cache, matmul, args = _qkv_rope(fmt, n, k, dt, seed=110, scale=0.2)
    opts = dict(norm_weight=(torch.rand(k) + 0.5).to(dt).to(DEVICE), norm_eps=1e-5) if norm else {}
    ang = torch.rand(5, d // 2, generator=torch.Generator().manual_seed(111)) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt).to(DEVICE), torch.cat([ang.sin()] * 2, -1).to(dt).to(DEVICE)
    for rows, slot in ((1, 13), (1, -1), (3, 5)):
        x = _x((rows, k), dt, seed=112 + rows) * 2
        slots = torch.arange(slot, slot + rows, device=DEVICE) if slot >= 0 else torch.full((rows,), -1,
                                                                                            device=DEVICE)
        caches = [[torch.full((6, 4, kv_heads, d), 7.0, dtype=dt, device=DEVICE) for _ in range(2)]
                  for _ in range(2)]
        fused.clear()
        q, kr = qkv_rope_cache(x, *args, heads, cos[:rows], sin[:rows], *caches[0], slots, **opts)
        assert [sorted(kw) for kw in fused] == ([["norm", "rope"] if norm else ["rope"]] if rows == 1 else []), \
            (rows, fused)
        fused.clear()
        qkv = matmul(x, *args, **opts)
        qs, ks, vs = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
        ref = apply_rope_and_cache(qs.reshape(rows, heads, d), ks.reshape(rows, kv_heads, d),
                                   vs.reshape(rows, kv_heads, d), cos[:rows], sin[:rows], *caches[1], slots)
        assert torch.equal(q, ref[0]) and torch.equal(kr, ref[1]), (rows, slot)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1]), (rows, slot)
        assert (caches[0][0] == 7.0).all() == (slot < 0)
    assert (("tagged GEMV partials", str(x.device)) in common._WORKSPACES) == tagged  # the path taken
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


def test_w4a16_gemv_takes_stationary_activations_only_where_it_fits(monkeypatch):
    """Whole tiles and 16-bit activations take the stationary kernel; a ragged N, a K that is not a whole number
    of slices or float32 activations take the split-K GEMV -- both correct."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "CPU_XS_TILE", dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1))
    launched = []
    monkeypatch.setattr(qm, "w4_gemv_xs", lambda *a, f=qm.w4_gemv_xs: launched.append(a) or f(*a))
    for n, k, dtype, stationary in [(64, 256, torch.float16, True), (60, 256, torch.float16, False),
                                    (64, 192, torch.float16, False), (64, 256, torch.float32, False)]:
        launched.clear()
        packed, scales, zeros = _int4(n, k, 64, seed=52)
        x = _x((1, k), dtype, seed=53)
        out = w4a16_matmul(x, packed, scales, zeros, 64)
        assert bool(launched) == stationary, (n, k, dtype)
        assert relative_error(out, w4a16_matmul_ref(x.double(), packed, scales, zeros, 64)) < TOL[dtype]


def test_stationary_tile_picks_the_measured_row_steps(monkeypatch):
    """On 132 SMs the rule -- the most row blocks per program that leave >= ``XS_SPLIT_WARPS_PER_SM`` (22) warps per
    SM for slices of K, >= ``XS_WARPS_PER_SM`` (11) for whole-K programs -- gives row steps that timed best or within
    2% of it on the H200 at the 8B decode shapes, each GEMV after a kernel that writes its activations
    (records/gemv_study_step_e38a902.json; split qkv s2 9.27 us against s4 9.14, o whole-K s2 7.79 best)."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "num_sms", lambda device: 132)
    split = {(6144, 4096): 2, (4096, 4096): 1, (28672, 4096): 8, (4096, 14336): 4, (14336, 4096): 4}
    whole = {(6144, 4096): 4, (4096, 4096): 2}  # whole-K programs where K <= 4096, N <= 8192 (5885d9a, 7b7213b)
    for (n, k), steps in split.items():
        assert qm.xs_tile(n, k, 128, torch.device("cpu"), qm.XS_TILE)["ROW_STEPS"] == steps
        cuda = qm.xs_tile(n, k, 128, torch.device("cuda"))
        assert cuda["ROW_STEPS"] == whole.get((n, k), steps) and cuda["BLOCK_K"] == (k if (n, k) in whole else 512)
        assert cuda["SPLIT_P2"] == (1 if (n, k) in whole else qm.next_pow2(k // 512))
        # with the RMSNorm in the prologue: always the split tile (a whole-K program holds the statistic too)
        normed = qm.xs_tile(n, k, 128, torch.device("cuda"), norm=True)
        assert normed["BLOCK_K"] == 512 and normed["ROW_STEPS"] == steps
        # words paired by default (records/gemv_study_pairs_f65fe09.json), except in groups of one word
        assert cuda["PAIR_WORDS"] and normed["PAIR_WORDS"]
        assert not qm.xs_tile(n, k, 8, torch.device("cuda"))["PAIR_WORDS"]
    assert "PAIR_WORDS" not in qm.xs_tile(4096, 4096, 4, torch.device("cuda"), bits=8)
    assert qm.xs_tile(4100, 4096, 128, torch.device("cpu"), qm.XS_TILE) is None  # no whole row blocks
    with pytest.raises(ValueError, match="ROW_STEPS=3"):
        qm.xs_tile(4096, 4096, 128, torch.device("cpu"), dict(qm.XS_TILE, ROW_STEPS=3))


@pytest.mark.parametrize("k", [102, 192])
def test_w8a16_gemv_unaligned_words(k):
    """K not a multiple of 4, or rows not on a 4-byte boundary: each word is assembled from byte loads."""
    q, s = _int8(37, k, seed=26)
    x = _x((1, k), torch.float32, seed=27)
    ref = w8a16_matmul_ref(x.double(), q, s)
    shifted = torch.empty(q.numel() + 1, dtype=torch.int8, device=DEVICE)[1:].view(q.shape)
    shifted.copy_(q)
    for w in (q, shifted):
        assert relative_error(w8a16_matmul(x, w, s), ref) < 1e-5


def test_even_needs_whole_steps_real_rows_and_words():
    import labkit.kernels.quantized_matmul as qm

    meta = {"N": 4096, "K": 4096, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4}
    assert qm._even(meta) and qm._even(dict(meta, WORDS_ALIGNED=True))
    assert not qm._even(dict(meta, N=4100)) and not qm._even(dict(meta, SPLIT_K=32))
    assert not qm._even(dict(meta, WORDS_ALIGNED=False))


def test_gemv_prune_splits_only_small_grids(monkeypatch):
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "num_sms", lambda device: 132)
    x = torch.empty(1, device=DEVICE)

    def kept(configs, n, k, group=None):
        out = qm._prune_gemv(configs, {"x_ptr": x, "N": n, "K": k}, **({"GROUP": group} if group else {}))
        return [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]) for c in out]

    w8, w4 = qm._gemv_configs(qm.W8_TILES), qm._gemv_configs(qm.W4_TILES)
    assert {s for *_, s in kept(w8, 128256, 4096)} == {1}  # the LM head fills the GPU unsplit
    for n, k in [(14336, 4096), (4096, 14336), (4096, 4096)]:
        cfgs = kept(w8, n, k)
        assert any(s > 1 for *_, s in cfgs) and len(cfgs) <= 48  # 8 tiles x 3 splits x 2 load pipelines
        assert all(-(-n // bn) * s <= qm.MAX_CTAS_PER_SM * 132 and -(-k // s) >= 2 * bk for bn, bk, s in cfgs if s > 1)
    cfgs = kept(w4, 14336, 4096, group=128)
    assert cfgs and all(bk >= 128 for _, bk, _ in cfgs) and any(s > 1 for *_, s in cfgs)
    assert all(bk >= 512 for _, bk, _ in kept(w4, 4096, 4096, group=512))


def test_w4a16_reads_the_quantisers_format():
    from labkit.quant.packing import dequantize_int4

    packed, scales, zeros = _int4(48, 128, 128, seed=5)
    x = _x((1, 128), torch.float32, seed=6)
    w = dequantize_int4(packed, scales, zeros, 128)
    assert relative_error(w4a16_matmul(x, packed, scales, zeros, 128), x @ w.T) < 1e-5


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bfloat16 refusal")
def test_bf16_gemv_runs_on_cpu_but_gemm_is_refused():
    q, s = _int8(40, 64, seed=7)
    x = _x((1, 64), torch.bfloat16, seed=8)
    assert relative_error(w8a16_matmul(x, q, s), w8a16_matmul_ref(x.double(), q, s)) < 1e-2  # no tl.dot
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        w8a16_matmul(_x((3, 64), torch.bfloat16, seed=9), q, s)


def test_bad_inputs():
    q, s = _int8(40, 64, seed=10)
    packed, scales, zeros = _int4(40, 64, 32, seed=11)
    x = _x((2, 64), torch.float32, seed=12)
    with pytest.raises(ValueError, match="K=64"):
        w8a16_matmul(_x((2, 63), torch.float32, seed=13), q, s)
    with pytest.raises(ValueError, match="qweight has dtype uint8"):
        w8a16_matmul(x, q.view(torch.uint8), s)
    with pytest.raises(ValueError, match="scale"):
        w8a16_matmul(x, q, s[:-1])
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, packed, scales, zeros, 48)
    with pytest.raises(ValueError, match="zeros"):
        w4a16_matmul(x, packed, scales, zeros[:, :1], 32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("n", [1000, 4096])  # 4096: whole tiles, the GEMVs' unmasked (EVEN) path
def test_quantized_matmul_gpu_bf16(rows, n):
    q, s = _int8(n, 4096, seed=14)
    packed, scales, zeros = _int4(n, 4096, 128, seed=15)
    x = _x((rows, 4096), torch.bfloat16, seed=16)
    out8 = w8a16_matmul(x, q, s.bfloat16())
    assert relative_error(out8, w8a16_matmul_ref(x.double(), q, s.bfloat16())) < 2e-2
    args = (packed, scales.bfloat16(), zeros.bfloat16(), 128)
    assert relative_error(w4a16_matmul(x, *args), w4a16_matmul_ref(x.double(), *args)) < 2e-2


@pytest.mark.gpu
def test_split_k_gemv_replays_in_a_cuda_graph(monkeypatch):
    """Split-K forced (the autotuner might not pick it): the last split reduces, counters reset, and the whole
    thing captures and replays in a CUDA graph with new activations."""
    import triton

    import labkit.kernels.quantized_matmul as qm

    def forced(kernel, bn, bk, split, **extra):
        cfg = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "LOAD_STAGES": 3, **extra}, num_warps=4)
        return triton.autotune([cfg], key=["N", "K"])(triton.heuristics({"EVEN": qm._even})(kernel))
    monkeypatch.setattr(qm, "_w8_gemv_tuned", forced(qm._w8_gemv, 128, 64, 4))
    monkeypatch.setattr(qm, "_w4_gemv_tuned", forced(qm._w4_gemv, 128, 128, 4, PREFETCH=False))
    n, k = 1000, 4096
    q, s = _int8(n, k, seed=30)
    packed, scales, zeros = _int4(n, k, 128, seed=31)
    w8_args, w4_args = (q, s.bfloat16()), (packed, scales.bfloat16(), zeros.bfloat16(), 128)
    x = _x((1, k), torch.bfloat16, seed=32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: the workspace is made here
        w8a16_matmul(x, *w8_args), w4a16_matmul(x, *w4_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out8, out4 = w8a16_matmul(x, *w8_args), w4a16_matmul(x, *w4_args)
    for seed in (33, 34):
        x.copy_(_x((1, k), torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out8, w8a16_matmul_ref(x.double(), *w8_args)) < 2e-2
        assert relative_error(out4, w4a16_matmul_ref(x.double(), *w4_args)) < 2e-2
    assert not qm._split_buffers(x.device, n)[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(4096, 14336), (4096, 4096)])  # 28 slices of K; all of K in each program
def test_stationary_gemv_replays_in_a_cuda_graph(monkeypatch, fmt, n, k):
    """The stationary-activation GEMV at 8B shapes: warmed up, captured, replayed with new activations; its
    counters are reset after every replay."""
    import labkit.kernels.quantized_matmul as qm

    monkeypatch.setattr(qm, "XS8_PLAIN", True)
    launched = _spy(monkeypatch, LAUNCHER[fmt])
    matmul, ref = _layer(fmt, n, k, torch.bfloat16, seed=35, group=128)
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
    assert not qm._split_buffers(x.device, n)[1].any()


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
def test_layer_ops_fused_into_the_gemv_on_the_gpu(monkeypatch, fmt, n, k, fuse):
    """The 8B decode projections with their neighbours inside (q/k/v and gate/up after RMSNorm: whole-K and split
    programs; o and down before the residual add, down with SwiGLU too): within a rounding of the separate kernels
    (the residual add bit-equal), and the same bits eagerly and replayed in a CUDA graph."""
    import labkit.kernels.quantized_matmul as qm
    from labkit.kernels.rms_norm import rms_norm
    from labkit.kernels.silu_and_mul import silu_and_mul

    monkeypatch.setattr(qm, "XS8_PLAIN", True)  # the separate int8 product on the same kernel: comparable bits
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
def test_qkv_rope_and_cache_inside_the_gemv_on_the_gpu(monkeypatch, fmt):
    """The 8B q/k/v projection (32 q heads, 8 kv heads of 128) with its RMSNorm, RoPE and the cache write in one
    GEMV, against the product then ``apply_rope_and_cache`` (within a rounding: the compiled kernels may contract
    the rotation into FMAs differently), eagerly and replayed in a CUDA graph at a new slot."""
    import labkit.kernels.quantized_matmul as qm
    from labkit.kernels.rope import apply_rope_and_cache

    monkeypatch.setattr(qm, "XS8_PLAIN", True)  # the separate int8 product on the same kernel: comparable bits
    heads, kv_heads, d, k, dt = 32, 8, 128, 4096, torch.bfloat16
    n = (heads + 2 * kv_heads) * d
    fused = _spy(monkeypatch, LAUNCHER[fmt])
    qkv_rope_cache, matmul, args = _qkv_rope(fmt, n, k, dt, seed=120, group=128, scale=0.1)
    opts = dict(norm_weight=(torch.rand(k, device=DEVICE) + 0.5).to(dt), norm_eps=1e-5)
    ang = torch.rand(1, d // 2, device=DEVICE) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    x = _x((1, k), dt, seed=121) * 2

    def both(slot: torch.Tensor):
        caches = [torch.zeros(64, 16, kv_heads, d, dtype=dt, device=DEVICE) for _ in range(4)]
        fused.clear()
        got = qkv_rope_cache(x, *args, heads, cos, sin, caches[0], caches[1], slot, **opts)
        assert [sorted(kw) for kw in fused] == [["norm", "rope"]]  # the fused path, not the fallback
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
def test_dependent_launches_wait_for_what_they_read(monkeypatch):
    """Launched with PDL (``pdl="overlap"``, sm_90), each GEMV starts before the kernel ahead of it ends and issues
    its first weight loads early; its activations come from that kernel: a scaling kernel, then a chain of three
    GEMVs, each reading the one before's output. Captured and replayed with new inputs, every output matches the
    reference."""
    import labkit.kernels.quantized_matmul as qm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    launched = []
    monkeypatch.setattr(qm, "w4_gemv_xs", lambda *a, f=qm.w4_gemv_xs, **kw: launched.append(kw["pdl"]) or f(*a, **kw))
    n = 4096
    layers = [_int4(n, n, 128, seed=60 + i) for i in range(3)]
    layers = [(p, s.bfloat16() * 0.05, z.bfloat16(), 128) for p, s, z in layers]
    x = _x((1, n), torch.bfloat16, seed=64)

    def chain():
        h = [x * 2]
        for args in layers:
            h.append(w4a16_matmul(h[-1], *args, pdl="overlap"))
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
    assert launched == ["overlap"] * 3
    for seed in (65, 66):
        x.copy_(_x((1, n), torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        for i, args in enumerate(layers):
            assert relative_error(outs[i + 1], w4a16_matmul_ref(outs[i].double(), *args)) < 2e-2, i


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fuse", ["plain", "residual", "swiglu"])
def test_stationary_gemv_tagged_reduction(monkeypatch, fmt, fuse):
    """``TAGGED`` (each row chunk's last slice waits for its peers' partials, no fence or counter): the same bits
    as the counted reduction -- both add the slices in slice order -- over irregular slice counts (5 and 3, padded
    to 8 and 4) and reduction tiles smaller than a chunk, twice in a row (the first launch must leave its
    workspace empty again), the workspace all empty afterwards, and a NaN activation giving NaN rows, not a
    reducer waiting forever."""
    import labkit.kernels.quantized_matmul as qm

    n, k = 48, 640 if fmt == "int4" else 384  # 5 slices of 128 (int4), 3 of 128 (int8)
    base = dict(BLOCK_N=8, BLOCK_K=128, ROW_STEPS=2, PREFETCH=1, num_warps=1)
    monkeypatch.setattr(qm, "XS_REDUCE_TILE", 32)  # RED_ROWS below the 16 rows of a chunk
    kx = 2 * k if fuse == "swiglu" else k
    x = _x((1, kx), torch.float16, seed=70)
    residual = _x((1, n), torch.float16, seed=71) if fuse == "residual" else None
    if fmt == "int4":
        packed, scales, zeros = _int4(n, k, 64, seed=72)
        weights, group, bits = (packed.view(torch.int32), scales.half(), zeros.half()), 64, 4
    else:
        q = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(73), dtype=torch.int8)
        scale = (torch.rand(n, generator=torch.Generator().manual_seed(74)) * 0.01 + 1e-3).half()
        weights, group, bits = (q.to(DEVICE).view(torch.int32), scale.to(DEVICE)), 4, 8

    def launch(tile, x=x):
        f = qm.w4_gemv_xs if fmt == "int4" else qm.w8_gemv_xs
        return f(x, *weights, *((group,) if fmt == "int4" else ()), tile, swiglu=fuse == "swiglu",
                 residual=residual)
    tile = qm.xs_tile(n, k, group, torch.device(DEVICE), base, bits=bits)
    tagged = qm.xs_tile(n, k, group, torch.device(DEVICE), dict(base, TAGGED=True), bits=bits)
    assert tile["SPLIT_P2"] > k // 128 and tagged["RED_ROWS"] == tile["RED_ROWS"] < 16
    counted = launch(tile)
    for _ in range(2):
        assert torch.equal(launch(tagged), counted)
        assert (qm._empty_partials(counted.device, n * (k // 128)).view(torch.int32) == -1).all()
    with pytest.raises(ValueError, match="TAGGED needs REDUCE"):
        launch(dict(tagged, REDUCE=False))
    x_nan = x.clone()
    x_nan[0, 130] = float("nan")
    assert torch.equal(launch(tagged, x_nan).isnan(), launch(tile, x_nan).isnan())


@pytest.mark.parametrize("stages", [2, 3])
def test_w4a16_stationary_pipelined_loads(stages):
    """``LOOP_STAGES`` (the row blocks' loads left to Triton's pipeliner, through shared memory on a GPU): the
    same bits as the default's loads a block ahead in registers, over 5 slices and 4 row steps."""
    import labkit.kernels.quantized_matmul as qm

    n, k = 128, 640
    packed, scales, zeros = _int4(n, k, 64, seed=80)
    x = _x((1, k), torch.float16, seed=81)
    weights = (packed.view(torch.int32), scales.half(), zeros.half(), 64)
    base = dict(BLOCK_N=16, BLOCK_K=128, ROW_STEPS=4, PREFETCH=1, num_warps=1)
    want = qm.w4_gemv_xs(x, *weights, qm.xs_tile(n, k, 64, torch.device(DEVICE), base))
    tile = qm.xs_tile(n, k, 64, torch.device(DEVICE), dict(base, PREFETCH=0, LOOP_STAGES=stages))
    assert torch.equal(qm.w4_gemv_xs(x, *weights, tile), want)
    assert relative_error(want, w4a16_matmul_ref(x.double(), packed, scales.half(), zeros.half(), 64)) < TOL[
        torch.float16]


import triton  # noqa: E402  (labkit, imported above, has routed it to the interpreter on a CPU-only host)
import triton.language as tl  # noqa: E402


@triton.jit
def _any_empty_probe(src_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    parts = tl.load(src_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(out_ptr, _any_empty(parts).to(tl.int32))


def test_tagged_reduction_sees_an_empty_word_among_negative_partials():
    """The ``TAGGED`` reducer's wait condition: an empty word (bits -1) is found in a block whose landed partials
    include negative floats (whose int32 bits are below -1), and a block of landed words is not empty. (The
    interpreter runs every peer before the reducer, so the GEMV tests never see a word still on its way.)"""
    words = torch.tensor([[-2.0, 3.0, -0.5, 1.0], [7.0, -9.0, 0.0, float("nan")]])
    out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    _any_empty_probe[(1,)](words.to(DEVICE), out, R=2, C=4)
    assert out.item() == 0
    words.view(torch.int32)[1, 2] = -1
    _any_empty_probe[(1,)](words.to(DEVICE), out, R=2, C=4)
    assert out.item() == 1
