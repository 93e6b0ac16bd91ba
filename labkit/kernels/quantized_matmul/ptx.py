"""Reading int4 and int8 weights in registers without a conversion instruction, and the packed float16 dots.

OR-ing an integer ``v < 2**23`` into the mantissa of a power of two gives that power plus ``v`` exactly;
subtracting the power back is one exact float add. Words of weights are read as int32 and each field decoded *in
place*, under the exponent that makes its lowest bit the units digit: int8 bytes 0 and 1 of each half-word under
2**23 and 2**15 (``(w & 0xFF) ^ 0x4B000080`` is one LOP3; the XOR also turns two's complement into offset binary),
int4 nibble ``P`` under ``2**(23 - 4P)``. Then one FADD and one FFMA per weight.

With 16-bit activations the stationary GEMVs multiply in packed float16 instead (inline PTX on CUDA; the same
steps in Triton operations under the interpreter, which runs no PTX): one LOP3 turns two nibbles into a float16
pair ``1024 + q``, HSUB2/HFMA2 make ``q`` exact, HFMA2 multiplies by activation pairs and sums in float16 lanes,
added in float32 per word (int4: 16 instructions per 8 weights against 27; two words per lane pair, 30 per 16).
A power of two per group (int4) or slice (int8) keeps every float16 partial sum below 65504.
"""

from __future__ import annotations

import triton
import triton.language as tl

_MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23: OR an integer v < 2**23 in, read 2**23 + v
_TWO23 = tl.constexpr(8388608.0)


@triton.jit
def _byte_pair(src, lo_mask, hi_mask):
    """Bytes 0 and 1 of ``src`` (int8 weights, two's complement) as exact floats, read in place: each byte is the
    units digit of a float whose exponent puts its lowest bit at 1 -- 2**23 for bits 0-7 (AND 0xFF, XOR
    0x4B000080: one LOP3), 2**15 for bits 8-15 (AND 0xFF00, XOR 0x47008000) -- so no shift is needed; the XORs'
    0x80 also turns two's complement into offset binary, and one FADD takes the power and the 128 back off."""
    b0 = ((src & lo_mask) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0  # 2**23 + 128
    b1 = ((src & hi_mask) ^ 0x47008000).to(tl.float32, bitcast=True) - 32896.0  # 2**15 + 128
    return b0, b1


@triton.jit
def _nibble(src, P: tl.constexpr):
    """Nibble ``P`` (bits 4P..4P+3) of ``src`` -- a word OR-ed with ``0x4F000000`` -- read in place: under the
    exponent of 2**(23 - 4P) the nibble is the float's units digit, so the float is 2**(23 - 4P) + q exactly.
    (The OR sets every exponent bit used by P = 0..3; the mask keeps P's and clears the word's own high bits.)"""
    bits = src & ((0x4B000000 - (P << 25)) | (0xF << (4 * P)))
    return bits.to(tl.float32, bitcast=True) - 8388608.0 / (1 << (4 * P))


def _f16x2_fmas(first: int, more: bool = False) -> str:
    """PTX: the float16 pairs ``t0 .. t3`` times the activation pairs in operands ``$first .. $first + 3`` into the
    two float16 lanes of ``acc`` (HMUL2 and three HFMA2; ``more``: four HFMA2 onto the lanes already there)."""
    head = "" if more else f"mul.f16x2 acc, t0, ${first};\n"
    return head + "".join(f"fma.rn.f16x2 acc, t{i}, ${first + i}, acc;\n" for i in range(int(not more), 4))


_F16X2_SUM = "mov.b32 {lo, hi}, acc;\ncvt.f32.f16 flo, lo;\ncvt.f32.f16 fhi, hi;\nadd.f32 $0, flo, fhi;\n}"


def _f16x2_products(first: int) -> str:
    """PTX that ends the packed float16 dots: ``_f16x2_fmas(first)``, then the lanes added in float32 into
    ``$0``."""
    return _f16x2_fmas(first) + _F16X2_SUM


def _w4_nibbles(src: int) -> str:
    """PTX that reads the 8 nibbles of the int32 word in operand ``$src`` as the exact float16 pairs ``t0 .. t3``
    (``_w4_word_dot``'s LOP3s, SHR, HSUB2s and HFMA2s)."""
    return f"""lop3.b32 t0, ${src}, 0x000F000F, m, 0xEA;
lop3.b32 t1, ${src}, 0x00F000F0, m, 0xEA;
shr.u32 w8, ${src}, 8;
lop3.b32 t2, w8, 0x000F000F, m, 0xEA;
lop3.b32 t3, w8, 0x00F000F0, m, 0xEA;
sub.f16x2 t0, t0, m;
fma.rn.f16x2 t1, t1, r16, n64;
sub.f16x2 t2, t2, m;
fma.rn.f16x2 t3, t3, r16, n64;
"""


_W4_DOT_HEAD = """{
.reg .b32 m, r16, n64, t0, t1, t2, t3, w8, acc;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 m, 0x64006400;
mov.b32 r16, 0x2C002C00;
mov.b32 n64, 0xD400D400;
"""
_W4_WORD_DOT = tl.constexpr(_W4_DOT_HEAD + _w4_nibbles(1) + _f16x2_products(2))
# two words into the same float16 lanes: the second word's products go on in the first's accumulator, so one
# conversion to float32 and one float32 add per 16 weights instead of per 8
_W4_PAIR_DOT = tl.constexpr(_W4_DOT_HEAD + _w4_nibbles(1) + _f16x2_fmas(3) + _w4_nibbles(2) +
                            _f16x2_fmas(7, more=True) + _F16X2_SUM)


@triton.jit
def _f16_halves(v):
    """The float16 pair in each int32 word of ``v`` (low half first)."""
    lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, ((v >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _w4_word_dot_emulated(wd, xa, xb, xc, xd):
    """``_w4_word_dot`` in Triton operations (for the CPU interpreter, which runs no PTX): the same float16
    values, nibble order and pairing, with the multiply and the add of each HFMA2 rounded separately."""
    acc_lo, acc_hi = _w4_word_lanes(wd, xa, xb, xc, xd, tl.zeros(wd.shape, tl.float16), tl.zeros(wd.shape, tl.float16))
    return acc_lo.to(tl.float32) + acc_hi.to(tl.float32)


@triton.jit
def _w4_word_lanes(wd, xa, xb, xc, xd, acc_lo, acc_hi):
    """The two float16 lanes of ``_w4_word_dot_emulated`` with the word's eight products added to ``acc_lo``,
    ``acc_hi`` (nibbles 0-3 into the low lane, 4-7 into the high one)."""
    for i in tl.static_range(4):
        src = wd if i < 2 else wd >> 8
        mask = 0x000F000F if i % 2 == 0 else 0x00F000F0
        t_lo, t_hi = _f16_halves((src & mask) | 0x64006400)  # 1024 + q, or 1024 + 16 q for odd i
        x_lo, x_hi = _f16_halves(xa if i == 0 else (xb if i == 1 else (xc if i == 2 else xd)))
        div = 1.0 if i % 2 == 0 else 16.0
        acc_lo += ((t_lo - 1024.0) / div).to(tl.float16) * x_lo
        acc_hi += ((t_hi - 1024.0) / div).to(tl.float16) * x_hi
    return acc_lo, acc_hi


@triton.jit
def _w4_word_dot(wd, xa, xb, xc, xd):
    """``sum_i q_i x_i`` over the 8 nibbles of each int32 word ``wd`` in packed float16 arithmetic (CUDA only:
    inline PTX). ``(w & 0x000F000F) | 0x6400_6400`` is a pair of float16 ``1024 + q`` (nibbles 0 and 4) in one
    LOP3; the mask ``0x00F000F0`` reads nibbles 1 and 5 in place as ``1024 + 16 q``, and the word shifted by 8
    gives nibbles 2, 6 and 3, 7 the same way. ``t - 1024`` and ``t / 16 - 64`` give every ``q`` exactly (two
    HSUB2, two HFMA2), then four HFMA2 multiply by the activation pairs ``xa = (x0, x4)``, ``xb = (x1, x5)``,
    ``xc = (x2, x6)``, ``xd = (x3, x7)`` (int32 words holding float16 pairs, low half first) and sum the eight
    products in two float16 lanes, added in float32: 16 instructions per 8 weights, against 27 on the float32
    path. The caller scales the activations so that ``|x| < 512`` (no partial sum reaches float16's 65504)."""
    return tl.inline_asm_elementwise(_W4_WORD_DOT, "=f,r,r,r,r,r", [wd, xa, xb, xc, xd], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _half2(lo, hi, ASM: tl.constexpr):
    """Two float32 tensors as float16 pairs packed in int32 words (``lo`` in bits 0-15): one CVT per pair
    (``ASM``), or the same bits through Triton casts."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    bits_lo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16) | bits_lo


@triton.jit
def _x_octets(x8, BLOCK_G: tl.constexpr, WORDS: tl.constexpr):
    """The 8 activations of each int32 word of weights, ``x8`` ``[groups, words, 8]`` -> 8 x ``[groups, words]``
    (``x0`` meets nibble 0, i.e. ``k = 8w``)."""
    ev, od = tl.split(tl.reshape(x8, [BLOCK_G, WORDS, 2, 2, 2]))
    ee, eo = tl.split(ev)
    oe, oo = tl.split(od)
    x0, x4 = tl.split(ee)
    x2, x6 = tl.split(eo)
    x1, x5 = tl.split(oe)
    x3, x7 = tl.split(oo)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _pow2_scales(x8):
    """Per group (``x8`` ``[groups, words, 8]`` float32) a power of two ``up`` that puts max |x| in [256, 512),
    and ``down = 1 / up``: float16 then holds every x that matters (down to 2**-23 of the group's largest) and
    no float16 partial sum of 4 products ``q x`` (``q <= 15``) can overflow."""
    return _pow2_of(tl.max(tl.max(tl.abs(x8), 2), 1), 8)


@triton.jit
def _x_half2(x0, x1, x2, x3, x4, x5, x6, x7, u, ASM: tl.constexpr):
    """The activation pairs ``_w4_word_dot`` takes -- (x0, x4), (x1, x5), (x2, x6), (x3, x7) times ``u`` -- as
    float16 pairs in int32 words."""
    return (_half2(x0 * u, x4 * u, ASM), _half2(x1 * u, x5 * u, ASM), _half2(x2 * u, x6 * u, ASM),
            _half2(x3 * u, x7 * u, ASM))


@triton.jit
def _word_dot(wd, xa, xb, xc, xd, ASM: tl.constexpr):
    if ASM:
        return _w4_word_dot(wd, xa, xb, xc, xd)
    return _w4_word_dot_emulated(wd, xa, xb, xc, xd)


@triton.jit
def _w4_pair_dot(we, wo, xa, xb, xc, xd, ya, yb, yc, yd, ASM: tl.constexpr):
    """``_w4_word_dot`` of word ``we`` (activation pairs ``xa .. xd``) plus that of word ``wo`` (``ya .. yd``), the
    sixteen products summed in the same two float16 lanes before the one float32 add: 30 instructions per 16
    weights against 34. Each lane then holds eight products ``|q x| < 15 * 512``, below float16's 65504. ``ASM``
    False: ``_w4_word_dot_emulated``'s steps over both words."""
    if ASM:
        return tl.inline_asm_elementwise(_W4_PAIR_DOT, "=f,r,r,r,r,r,r,r,r,r,r",
                                         [we, wo, xa, xb, xc, xd, ya, yb, yc, yd], dtype=tl.float32, is_pure=True,
                                         pack=1)
    lo, hi = _w4_word_lanes(we, xa, xb, xc, xd, tl.zeros(we.shape, tl.float16), tl.zeros(we.shape, tl.float16))
    lo, hi = _w4_word_lanes(wo, ya, yb, yc, yd, lo, hi)
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _even_odd_words(v, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``v`` ``[ROWS, WORDS]`` as its even words and its odd words, each ``[ROWS, WORDS // 2]``."""
    return tl.split(tl.reshape(v, [ROWS, WORDS // 2, 2]))


_W8_PAIR_DOT = tl.constexpr("""{
.reg .b32 m, c, u, v, t0, t1, t2, t3, acc;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 m, 0x64646464;
mov.b32 c, 0x64806480;
xor.b32 u, $1, 0x80808080;
xor.b32 v, $2, 0x80808080;
prmt.b32 t0, u, m, 0x4240;
prmt.b32 t1, u, m, 0x4341;
prmt.b32 t2, v, m, 0x4240;
prmt.b32 t3, v, m, 0x4341;
sub.f16x2 t0, t0, c;
sub.f16x2 t1, t1, c;
sub.f16x2 t2, t2, c;
sub.f16x2 t3, t3, c;
""" + _f16x2_products(3))


@triton.jit
def _w8_pair_dot(wa, wb, a02, a13, b02, b13, ASM: tl.constexpr):
    """``sum_i q_i x_i`` over the 8 int8 weights of two int32 words ``wa``, ``wb`` in packed float16 arithmetic:
    the XOR with 0x80808080 makes each byte ``q + 128``, one PRMT per pair lays bytes 0 and 2 (then 1 and 3) under
    the float16 exponent byte 0x64 -- the pair ``1152 + q`` -- and one HSUB2 makes ``q`` exact; HMUL2 and three
    HFMA2 multiply by the activation pairs (``a02 = (x0, x2)`` of ``wa``'s bytes, ``a13``, ``b02``, ``b13``:
    int32 words holding float16 pairs) and sum the eight products in two float16 lanes, added in float32: 17
    instructions per 8 weights, against 26 on the float32 path. The caller scales the activations so that
    ``|x| < 64`` (no lane of four products ``|q x| <= 128 * 64`` can reach float16's 65504). ``ASM`` False: the
    same steps in Triton operations (the interpreter runs no PTX), each HFMA2's multiply and add rounded
    separately."""
    if ASM:
        return tl.inline_asm_elementwise(_W8_PAIR_DOT, "=f,r,r,r,r,r,r", [wa, wb, a02, a13, b02, b13],
                                         dtype=tl.float32, is_pure=True, pack=1)
    x0, x2 = _f16_halves(a02)
    x1, x3 = _f16_halves(a13)
    lo = _w8_byte(wa, 0) * x0
    hi = _w8_byte(wa, 2) * x2
    lo = _f16_fma(_w8_byte(wa, 1), x1, lo)
    hi = _f16_fma(_w8_byte(wa, 3), x3, hi)
    x0, x2 = _f16_halves(b02)
    x1, x3 = _f16_halves(b13)
    lo = _f16_fma(_w8_byte(wb, 1), x1, _f16_fma(_w8_byte(wb, 0), x0, lo))
    hi = _f16_fma(_w8_byte(wb, 3), x3, _f16_fma(_w8_byte(wb, 2), x2, hi))
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _f16_fma(a, b, c):
    """``a * b + c`` of float16 values, the product exact in float32, rounded to float16 at the end."""
    return (a.to(tl.float32) * b.to(tl.float32) + c.to(tl.float32)).to(tl.float16)


@triton.jit
def _x_bytes(x4):
    """The activations ``x4`` ``[words, 2, 2]`` (``k = 4w + 2a + b``) met by bytes 0, 1, 2, 3 of each word."""
    ev, od = tl.split(x4)
    x0, x2 = tl.split(ev)
    x1, x3 = tl.split(od)
    return x0, x1, x2, x3


@triton.jit
def _x_byte_pairs(x4, up, ASM: tl.constexpr):
    """``_x_bytes`` times ``up`` as the float16 pairs ``_w8_pair_dot`` takes: ``(x0, x2)`` and ``(x1, x3)``."""
    x0, x1, x2, x3 = _x_bytes(x4)
    return _half2(x0 * up, x2 * up, ASM), _half2(x1 * up, x3 * up, ASM)


@triton.jit
def _w8_byte(wd, i: tl.constexpr):
    """Byte ``i`` of each int32 word as the signed int8 value it holds, in float16 (exact)."""
    return ((((wd >> (8 * i)) & 0xFF) ^ 0x80) - 128).to(tl.float16)


@triton.jit
def _pow2_of(m, TOP: tl.constexpr):
    """For magnitudes ``m`` (float32, any shape) the power of two ``up`` that puts each in ``[2**TOP, 2**(TOP + 1))``
    (tiny or zero ``m``: capped) and ``down = 1 / up``."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 9)
    up = ((254 + TOP - e) << 23).to(tl.float32, bitcast=True)  # 2**(TOP - E) for m = f 2**E
    down = ((e - TOP) << 23).to(tl.float32, bitcast=True)
    return up, down


# int8 -> float16 without I2F: PRMT spreads two bytes of a word into two float16 lanes, one LOP3 sets the exponent
# of 1024 and flips the sign bit, one HSUB2 takes 1152 off (exact). On an H100 it left int8 attention at 1.13x
# bf16 (1.11x with I2F; results/h100/records/03_kernels.json): the conversion is not what binds
# (research/kv_quant_decode_study.py asks what does). Used by paged decode attention's quantised KV path.
_I8_TO_F16 = tl.constexpr("""{
.reg .b32 lo, hi, c;
prmt.b32 lo, $2, 0, 0x4140;
prmt.b32 hi, $2, 0, 0x4342;
lop3.b32 lo, lo, 0x00800080, 0x64006400, 0xBE;
lop3.b32 hi, hi, 0x00800080, 0x64006400, 0xBE;
mov.b32 c, 0x64806480;
sub.f16x2 $0, lo, c;
sub.f16x2 $1, hi, c;
}""")


@triton.jit
def kv_as_16bit(x, dtype: tl.constexpr, PTX: tl.constexpr):
    """A quantised K or V tile (int8 or float8_e4m3fn) as ``dtype`` values, exactly (the scale is applied by the
    caller). int8 to float16 on CUDA: ``_I8_TO_F16``; under the interpreter (``PTX`` False) the same bit steps
    in Triton operations."""
    if x.dtype == tl.int8 and dtype == tl.float16:
        if PTX:
            return tl.inline_asm_elementwise(_I8_TO_F16, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            bits = (x.to(tl.int16) & 0xFF) ^ 0x6480  # 1024 + (x + 128) as float16 bits
            return bits.to(tl.float16, bitcast=True) - 1152.0
    else:
        return x.to(dtype)  # float8_e4m3fn -> float16: CVT.F16X2.E4M3X2 on sm_89+, two per instruction
