"""Weight-only quantised matmul with the dequantisation fused into the weight load (W8A16, W4A16).

``y = x @ W.T`` where ``W`` is stored as int8 (per-output-channel scale) or packed int4 (group-wise scale and
zero-point), in the formats of ``labkit.quant.packing``. At decode batch sizes a linear layer is a GEMV: it
reads every weight byte once and does 2 FLOPs per weight, so its time is the weight bytes over bandwidth.
Storing 1 or 0.5 bytes per weight instead of 2 and expanding them in registers -- never in memory -- cuts
that time about 2x or 4x (minus the scales' bytes). Dequantising to a bf16 copy first, as the torch
reference does, would read the int weights, write and re-read bf16: slower than plain bf16.

Two kernels per format: a GEMV for one row of ``x`` (no Tensor Cores) and a tiled GEMM on Tensor Cores
(``tl.dot``) for more rows, so every batch size is correct and the decode case is fast. The int4 GEMM for
power-of-two groups steps through K inside one group at a time, so it loads each scale and zero-point once per
step and row of weights (the general one loads them once per weight: on the H200 it made a batch-8 decode step
of the 8B shape 9x slower than batch 1, 52.6 ms against 6.0, through HF's model; unmeasured since).

**The GEMV's budget**, 4096 -> 14336 on an H200 (4.25 TB/s copy; 132 SMs x 4 schedulers x 32 lanes at
1.98 GHz = 33.4 T lane-instructions/s): int8 weights are 58.7 MB (13.8 us), int4 at group 128 29.4 MB plus
1.8 MB of bf16 scales and zeros (7.3 us); bf16 is 117 MB (27.6 us; cuBLAS 30.7 us in a CUDA graph over
weights not in L2). The first kernels converted every weight with ``I2F`` (16 per clock per SM: 14 us of
conversions alone for 58.7 M weights); ncu on the H200 then found the next ones bound by instruction issue
(int8 5.7, int4 5.0 instructions per weight; 38-67% of DRAM bandwidth). Now:

* **No conversion instruction.** OR-ing an integer ``v < 2**23`` into the mantissa of a power of two gives
  that power plus ``v`` exactly; subtracting the power back is one exact float add. Both kernels read int32
  words and decode each field *in place*, under the exponent that makes its lowest bit the units digit:
  int8 bytes 0 and 1 of each half-word under 2**23 and 2**15 (``(w & 0xFF) ^ 0x4B000080`` is one LOP3; the
  XOR also turns two's complement into offset binary), int4 nibble ``P`` under ``2**(23 - 4P)``. Then one
  FADD and one FFMA per weight; a shift per word for the high half. sm_90 loop: 3.8-4.1 instructions per int8
  weight (was 5.4-6.6 with byte loads).
* **Packed float16 math for int4 with 16-bit activations** (``_w4_word_dot``, inline PTX): one LOP3 turns two
  nibbles into a float16 pair ``1024 + q``, HSUB2/HFMA2 make ``q`` exact, HFMA2 multiplies by activation pairs
  and sums in float16 lanes, added in float32 per word: 16 instructions per 8 weights against 27. A power of
  two per group puts the group's largest ``|x|`` in [256, 512), so no float16 partial sum can overflow and
  every activation within 2**23 of the largest keeps 11 bits. float32 activations take the float32 path.
* **Scales once per group.** int4 accumulates ``sum_k q x`` per group and row, then adds
  ``s * (sum_k q x - z * sum_k x)`` (``sum_k x`` is shared by all rows).
* **Split-K** (``SPLIT_K`` programs per block of rows) where the grid would be small. Partial sums go to a
  float32 workspace; the last split of a row block to arrive (an atomic counter) adds them in split order
  (deterministic), writes the output and resets its counter: one launch, no memset, CUDA-graph capturable.
* **16-byte loads, no masks in the steady state** (``EVEN``: whole steps and rows, as at every LLM shape;
  ``other`` is left off the weight loads -- any bit pattern decodes to a finite value), optionally
  pipelined through shared memory (``tl.range(num_stages=3)``, cp.async) or, for int4, prefetched a step
  ahead in registers (``PREFETCH``).
* **Autotuned** per ``(N, K)`` over tiles, splits, warps and load pipelines, each candidate timed after a
  *clean* L2 flush (``cold_l2_bench``), and the tile sets chosen from ``scripts/gemv_study.py``, which times
  every candidate as a decode step runs it (records/gemv_study.json). The autotuner times the candidates once
  per shape on the first call: warm up before capturing a CUDA graph (capture also refuses to allocate the
  workspace).

Measured on the H200 (``python scripts/gemv_study.py``, graph replays over weights not in L2, best candidate /
autotuner's pick), 4096 -> 14336: bf16 30.7 us; int8 16.5 / 16.5 us (1.86x, 0.82 of copy bandwidth); int4
15.7 / 17.1 us (1.8-2.0x, 0.47 of bandwidth: neither issue- nor bandwidth-bound, latency is what is left).
Tried and dropped (records/gemv_study_maxnreg_prep_e66a969.json): preparing the int4 activations once per GEMV
(pairs, powers of two and sums in a 1.6 us kernel of their own, every thread then loading its pairs from L1)
saved nothing inside the GEMV, so it only added the launch; the GEMV's own preparation is not what holds it back.
**Stationary activations** (int4 with 16-bit activations, whole tiles: every 8B shape). The split-K kernel
prepares the activations (float16 pairs, powers of two, sums, and a layout change through shared memory with its
barrier) at every step of every row block; ncu found its L1/shared-memory pipe the busiest unit (72%) and half
the issue slots idle. ``_w4_gemv_xs`` turns the loop around: each program owns one slice of 512 activations,
prepares it once, and walks down 16-row blocks with the next block's loads in flight; the last slice of a row
chunk to arrive sums the slices' partials. sm_90 loop: 2.7-2.8 instructions per weight, 68-96 registers, no
barrier. On the H200 (records/gemv_study_xs_2748180.json, graph replays, us): qkv 8.8 against the split-K
kernel's best 10.1, gate_up 24.4 against 30.6, down 14.5 against 16.2, 14336 x 4096 14.2 against 15.6 (0.52 of
bandwidth); only 4096 x 4096 is slower (7.2 against 6.5). Weights brought in by TMA descriptors, several steps
in flight through shared memory, were slower than registers (17.3 against 15.3 us; gemv_study_tma_9df440a).
At 7016fbe the first row block's loads are issued before the slice's preparation (``WEIGHTS_FIRST``, 1-2%), and
where ``K <= 4096`` and ``N <= 8192`` each program owns the whole of K (no partials, no arrival counters; k/v, o
and qkv 3-9% faster when each GEMV follows a kernel that writes its activations, gemv_study_xs_step_7b7213b).
The cross-program reduction costs ~2 us a launch (13.1 -> 11.2 us at 4096 -> 14336 without it: wrong sums,
timing only). Tried (records/gemv_study_xs_*_{492b4c7,495f9d6,b39937c}): slice-major weights (one contiguous
stream a program: 0.5-2%), a 64-register cap (spills: 2.5x slower), bulk L2 prefetch (slower), and programmatic
dependent launch (PDL, ``PDL``: the first weight loads before ``griddepcontrol.wait``). PDL saved 0.4-0.8 us a
GEMV launched after another GEMV (13.9 -> 13.1 us; notebook 03's ratio 2.36 with it at dcaf71d), but cost 0.3-0.8
us after any other kernel -- the decode step's case then (the engine's int4 step 2.54 -> 2.65 ms) -- so it is off
by default. With the norms and residual adds inside the GEMVs, three of a layer's four GEMVs follow a GEMV, so
``pdl=`` asks for it per call: ``"release"`` (the next launch may start at once) or ``"overlap"`` (that, and this
launch overlaps the one ahead); ``ModelRunner(gemv_pdl=True)`` uses them.
``w4a16_matmul(gate_up, ..., swiglu=True)`` (an MLP's down projection) computes ``silu(gate) * up`` while the
stationary GEMV prepares its slice: a decode step loses the ``silu_and_mul`` launch and its round trip of the
activations through memory, with the same bits. ``norm_weight=`` and ``residual=`` do the same for a decoder
layer's add + RMSNorm: the q/k/v and gate/up GEMVs normalise their row in the prologue (each program takes the
row's statistic: a split program re-reads the row from L2), the o and down GEMVs add the residual as they store.
Measured after a kernel that writes the activations (gemv_study_fused_ed2d5a7, us): the norm costs 0.4-0.7 us a
GEMV on the split tile (qkv 9.09 -> 9.48, gate_up 25.40 -> 26.13; a whole-K program needs 96 registers for it, not
72 -- ``scripts/sass_report.py --kernel xs``, results/cpu/records/sass_xs.json -- and lost 1.2 us, so normed GEMVs
take the split tile), the residual add nothing measurable (o 7.94 -> 7.74,
down 15.43 -> 15.47), against ~2.2 us for each add + RMSNorm launch they remove; the engine's int4 step at batch 1
went 2.474 -> 2.371 ms with them and the attention change of the same commits. RoPE and the k/v cache write in the
q/k/v GEMV's store (``w4a16_qkv_rope_cache``) took it 2.387 -> 2.325 ms (one run's A/B, records/
04_quantization_4204cc0.json).
bitsandbytes LLM.int8 took 30.9 us there: a 3x bar over it needs 10.3 us, below the int8 bytes' floor of
13.8 us -- no int8 kernel can meet that at this shape (at most 30.9 / 13.8 = 2.24x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.kernels.common import (
    FLOAT_DTYPES,
    check_pdl,
    check_tensor,
    cold_l2_bench,
    kernel_workspace,
    next_pow2,
    num_sms,
    pdl_launch,
    refuse_bf16_dot_on_cpu,
)

MAX_SPLIT_K = 16  # rows of the float32 partial-sum workspace
_MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23: OR an integer v < 2**23 in, read 2**23 + v
_TWO23 = tl.constexpr(8388608.0)


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference: dequantise to float32 (float64 if ``x`` is), matmul, cast to ``x``'s dtype."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(dt) @ (qweight.to(dt) * scale.to(dt)[:, None]).T).to(x.dtype)


def w4a16_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """Torch reference through ``labkit.quant.packing.dequantize_int4`` in float32 (float64 if ``x`` is)."""
    from labkit.quant.packing import dequantize_int4

    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_int4(packed, scales.to(dt), zeros.to(dt), group_size)
    return (x.to(dt) @ w.T).to(x.dtype)


# --- GEMV (one row of x) ---------------------------------------------------------------------------------
@triton.jit
def _store_rows(part, offs_n, n_ok, out_ptr, ws_ptr, cnt_ptr, N, SPLIT_K: tl.constexpr):
    """Write this program's float32 sums for its rows; with ``SPLIT_K > 1`` the last split of the row block
    to finish adds every split's partials in split order and writes the output."""
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        pid_n = tl.program_id(0)
        tl.store(ws_ptr + tl.program_id(1) * N + offs_n, part, mask=n_ok)
        tl.debug_barrier()  # all of this CTA's partials are written before its arrival is counted
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # release ours, acquire the others'
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(part)
            for s in tl.static_range(SPLIT_K):  # fixed order: the same bits whichever split came last
                total += tl.load(ws_ptr + s * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


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
def _w8_gemv(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_wn, lo_mask, hi_mask,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, LOAD_STAGES: tl.constexpr,
             WORDS_ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """``w_ptr``: the int8 weights as raw bytes, taken four at a time as int32 words (k = 4w + i at bits 8i).
    ``WORDS_ALIGNED`` (rows start on 4-byte boundaries, K % 4 == 0): one 32-bit load per word; otherwise each
    word is assembled from byte loads (correct, slower). ``lo_mask``/``hi_mask`` are 0xFF/0xFF00, passed at run
    time so that each byte's AND + XOR stays one LOP3 with a constant-bank operand."""
    WORDS: tl.constexpr = BLOCK_K // 4
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    offs_w = tl.arange(0, WORDS)
    n_words = tl.cdiv(K, 4)
    w_per = tl.cdiv(tl.cdiv(n_words, SPLIT_K), WORDS) * WORDS  # whole steps, so splits never overlap
    w_lo = tl.program_id(1) * w_per
    w_hi = tl.minimum(w_lo + w_per, n_words)
    k4 = (w_lo + offs_w)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [words, 4]: k of each byte, this step
    x_ptrs = x_ptr + k4
    if WORDS_ALIGNED:
        w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + n64[:, None] * (stride_wn // 4) + (w_lo + offs_w)[None, :]
    else:
        w_ptrs = w_ptr + n64[:, None, None] * stride_wn + k4[None, :, :]
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)  # reduced once at the end, not once per step
    for w0 in tl.range(w_lo, w_hi, WORDS, num_stages=LOAD_STAGES):
        # no `other` on whole words: any bits decode to finite values, met by x = 0 (k >= K) or rows never stored
        if EVEN:  # every step whole and every row real (the autotuner's heuristic): no masks
            wd = tl.load(w_ptrs)
            x4 = tl.load(x_ptrs)
        elif WORDS_ALIGNED:
            wd = tl.load(w_ptrs, mask=n_ok[:, None] & (w0 + offs_w < n_words)[None, :])
            x4 = tl.load(x_ptrs, mask=k4 < K, other=0.0)
        else:
            b = tl.load(w_ptrs, mask=n_ok[:, None, None] & (k4 < K)[None, :, :], other=0).to(tl.int32)
            wd = tl.sum(b << (tl.arange(0, 4) * 8)[None, None, :], 2)
            x4 = tl.load(x_ptrs, mask=k4 < K, other=0.0)
        x4 = x4.to(tl.float32)
        x_ptrs += BLOCK_K
        k4 += BLOCK_K
        if WORDS_ALIGNED:
            w_ptrs += WORDS
        else:
            w_ptrs += BLOCK_K
        ev, od = tl.split(tl.reshape(x4, [WORDS, 2, 2]))
        x0, x2 = tl.split(ev)
        x1, x3 = tl.split(od)
        b0, b1 = _byte_pair(wd, lo_mask, hi_mask)
        acc += b0 * x0[None, :]
        acc += b1 * x1[None, :]
        b2, b3 = _byte_pair(wd >> 16, lo_mask, hi_mask)
        acc += b2 * x2[None, :]
        acc += b3 * x3[None, :]
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    _store_rows(tl.sum(acc, 1) * s, offs_n, n_ok, out_ptr, ws_ptr, cnt_ptr, N, SPLIT_K)


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
def _w8_word_fma(wd, x0, x1, x2, x3, lo_mask, hi_mask):
    """``sum_i q_i x_i`` per int32 word of int8 weights on the float32 path: bytes read in place (``_byte_pair``),
    one FFMA each."""
    b0, b1 = _byte_pair(wd, lo_mask, hi_mask)
    b2, b3 = _byte_pair(wd >> 16, lo_mask, hi_mask)
    return b0 * x0[None, :] + b1 * x1[None, :] + b2 * x2[None, :] + b3 * x3[None, :]


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


@triton.jit
def _w4_program(N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's rows and groups in the int4 GEMVs: rows ``offs_n`` (``n_ok`` real, ``n64`` as int64), the
    step's groups ``g = g_lo + offs_g`` up to ``g_hi`` (split ``program_id(1)`` of ``SPLIT_K``, whole steps, so
    splits never overlap) and ``kw`` ``[groups, words]``, each word's index along a row."""
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    n_groups = K // GROUP
    g_per = tl.cdiv(tl.cdiv(n_groups, SPLIT_K), BLOCK_G) * BLOCK_G
    g_lo = tl.program_id(1) * g_per
    g = g_lo + offs_g
    kw = g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    return offs_n, offs_n < N, offs_n.to(tl.int64), offs_g, g_lo, tl.minimum(g_lo + g_per, n_groups), g, kw


@triton.jit
def _w4_gemv(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_pn, stride_sn, stride_zn, exp_bits,
             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
             LOAD_STAGES: tl.constexpr, EVEN: tl.constexpr, HALF_MATH: tl.constexpr, PREFETCH: tl.constexpr):
    """Power-of-two groups >= 8. ``p_ptr``: the packed bytes viewed as int32 words (8 nibbles: k = 8w + i at
    bits 4i); a step is ``BLOCK_K // GROUP`` whole groups, a ``[BLOCK_N, groups, words]`` tile.
    ``exp_bits`` is 0x4F000000, passed at run time so that the compiler keeps one OR per word instead of
    folding it into every nibble's mask (which costs a register move per nibble). ``PREFETCH`` (with ``EVEN``)
    keeps the next step's loads in flight in registers while this step computes."""
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8  # int32 words per group and row
    offs_n, n_ok, n64, offs_g, g_lo, g_hi, g, kw = _w4_program(N, K, GROUP, BLOCK_N, BLOCK_K, SPLIT_K)
    p_ptrs = p_ptr + n64[:, None, None] * stride_pn + kw[None, :, :]
    x_ptrs = x_ptr + kw[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    n_groups = K // GROUP
    s_ptrs = s_ptr + n64[:, None] * stride_sn + g[None, :]
    z_ptrs = z_ptr + n64[:, None] * stride_zn + g[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    if EVEN and PREFETCH:
        nw, nx, ns, nz = tl.load(p_ptrs), tl.load(x_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)
    for g0 in tl.range(g_lo, g_hi, BLOCK_G, num_stages=LOAD_STAGES):
        if EVEN and PREFETCH:  # this step's loads were issued a step ago; issue the next step's now
            wd, x8, s, z = nw, nx, ns, nz
            more = g0 + BLOCK_G + offs_g < g_hi  # all or none: the last step prefetches nothing
            nw = tl.load(p_ptrs + BLOCK_G * WORDS, mask=more[None, :, None])
            nx = tl.load(x_ptrs + BLOCK_K, mask=more[:, None, None])
            ns = tl.load(s_ptrs + BLOCK_G, mask=more[None, :])
            nz = tl.load(z_ptrs + BLOCK_G, mask=more[None, :])
        elif EVEN:  # whole steps, real rows (the autotuner's heuristic): no masks
            wd = tl.load(p_ptrs)
            x8 = tl.load(x_ptrs)
            s = tl.load(s_ptrs)
            z = tl.load(z_ptrs)
        else:
            g_ok = g0 + offs_g < n_groups
            # no `other`: masked-off words decode to finite values that meet x = 0 or rows never stored
            wd = tl.load(p_ptrs, mask=n_ok[:, None, None] & g_ok[None, :, None])
            x8 = tl.load(x_ptrs, mask=g_ok[:, None, None], other=0.0)
            ld = n_ok[:, None] & g_ok[None, :]
            s = tl.load(s_ptrs, mask=ld, other=0.0)
            z = tl.load(z_ptrs, mask=ld, other=0.0)
        x8 = x8.to(tl.float32)
        p_ptrs += BLOCK_G * WORDS
        x_ptrs += BLOCK_K
        s_ptrs += BLOCK_G
        z_ptrs += BLOCK_G
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_octets(x8, BLOCK_G, WORDS)
        x_sum = tl.sum((x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7), 1)  # [groups], for the zero-points
        if HALF_MATH:  # 16-bit activations: packed float16 pairs (1: PTX on CUDA, 2: emulated on the CPU)
            up, down = _pow2_scales(x8)
            xa, xb, xc, xd = _x_half2(x0, x1, x2, x3, x4, x5, x6, x7, up[:, None], HALF_MATH == 1)
            q_x = tl.sum(_word_dot(wd, xa[None], xb[None], xc[None], xd[None], HALF_MATH == 1), 2) * down[None, :]
        else:
            lo = wd | exp_bits
            hi = (wd >> 16) | exp_bits
            qx = _nibble(lo, 0) * x0[None]  # sum_i q_i x_i, one FFMA per weight
            qx += _nibble(lo, 1) * x1[None]
            qx += _nibble(lo, 2) * x2[None]
            qx += _nibble(lo, 3) * x3[None]
            qx += _nibble(hi, 0) * x4[None]
            qx += _nibble(hi, 1) * x5[None]
            qx += _nibble(hi, 2) * x6[None]
            qx += _nibble(hi, 3) * x7[None]
            q_x = tl.sum(qx, 2)
        # sum_k (q - z) s x: the scale once per group
        acc += s.to(tl.float32) * (q_x - z.to(tl.float32) * x_sum[None, :])
    _store_rows(tl.sum(acc, 1), offs_n, n_ok, out_ptr, ws_ptr, cnt_ptr, N, SPLIT_K)


@triton.jit
def _row_rstd(x_ptr, K, eps, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """``1 / sqrt(mean(x ** 2) + eps)`` of the whole row ``x`` (``K = CHUNKS * CHUNK`` values), in float32 as
    ``labkit.kernels.rms_norm`` computes it; every chunk's load is issued before the first is summed."""
    offs = tl.arange(0, CHUNK)
    sq = tl.zeros([CHUNK], tl.float32)
    for j in tl.static_range(CHUNKS):
        v = tl.load(x_ptr + j * CHUNK + offs).to(tl.float32)
        sq += v * v
    return 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)


@triton.jit
def _slice_activations(x_ptr, k, K, SWIGLU: tl.constexpr):
    """The activations at positions ``k`` as float32; with ``SWIGLU`` ``x_ptr`` holds ``[gate | up]`` (``2K``
    values) and they are ``silu(gate) * up``, rounded as ``silu_and_mul`` rounds (the silu, then the product, to
    the input dtype): the same bits as running that kernel first."""
    if SWIGLU:
        g = tl.load(x_ptr + k)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (act.to(tl.float32) * tl.load(x_ptr + K + k).to(tl.float32)).to(g.dtype).to(tl.float32)
    return tl.load(x_ptr + k).to(tl.float32)


@triton.jit
def _normed_activations(x_ptr, norm_w_ptr, k, K, eps, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """RMSNorm's output at positions ``k`` as float32: ``x`` times the row's ``rstd`` rounded to the input dtype,
    times the norm's weight, rounded again (as ``labkit.kernels.rms_norm`` and Hugging Face's ``LlamaRMSNorm``
    round). The slice's and the weight's loads go out first; ``CHUNKS == 1``: ``k`` is the whole row and the
    statistic comes from it, else from the row read again in ``CHUNKS`` chunks of ``CHUNK`` (from L2)."""
    x = tl.load(x_ptr + k)
    w = tl.load(norm_w_ptr + k).to(tl.float32)
    xf = x.to(tl.float32)
    if CHUNKS == 1:
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(tl.sum(xf * xf, 2), 1), 0) / K + eps)
    else:
        rstd = _row_rstd(x_ptr, K, eps, CHUNK, CHUNKS)
    return ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)


@triton.jit
def _output_rows(total, rows, res_ptr, out_ptr, RESIDUAL: tl.constexpr):
    """Store float32 row sums in the output's dtype; with ``RESIDUAL`` plus the residual stream's rows, the sum
    rounded again (a decoder layer's ``residual + hidden_states``: the projection's output is rounded first)."""
    y = total.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        y = (y.to(tl.float32) + tl.load(res_ptr + rows).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows, y)


@triton.jit
def _rope_first_row(g, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """The first physical row of logical row block ``g`` when blocks pair rotary dims: heads of ``2 * HALF`` rows
    hold ``2 * HALF / BLOCK_N`` blocks, block ``m`` of a head taking dims ``m * BLOCK_N / 2 + j`` and ``HALF + m *
    BLOCK_N / 2 + j``."""
    G: tl.constexpr = 2 * HALF // BLOCK_N
    return (g // G) * (2 * HALF) + (g % G) * (BLOCK_N // 2)


@triton.jit
def _rope_rows(g, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Physical rows (int64 ``[BLOCK_N]``) of logical row block ``g``: half of them in a head's first half, the
    same dims of its second half after them."""
    S: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, BLOCK_N)
    return (_rope_first_row(g, BLOCK_N, HALF) + (j % S) + (j // S) * HALF).to(tl.int64)


@triton.jit
def _rope_step(g, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Physical rows from logical block ``g``'s first row to block ``g + 1``'s."""
    return _rope_first_row(g + 1, BLOCK_N, HALF) - _rope_first_row(g, BLOCK_N, HALF)


@triton.jit
def _rope_cache_rows(total, g0, out_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots,
                     R: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """Store ``R`` logical rows' float32 sums (blocks ``g0``...) at their physical rows: rounded to the output's
    dtype, the first ``n_rot_rows`` rows (q, k) rotated as ``labkit.kernels.rope`` rotates them (float32 math on
    the rounded values, one rounding), k and v rows also written to the paged caches' row at the token's slot."""
    S: tl.constexpr = BLOCK_N // 2
    dt = out_ptr.dtype.element_ty
    y = tl.reshape(total.to(dt), [R // BLOCK_N, 2, S])
    x1, x2 = tl.split(tl.permute(y, (0, 2, 1)))  # [blocks, S]: dims d of the first half, HALF + d of the second
    g = g0 + tl.arange(0, R // BLOCK_N)[:, None]
    G: tl.constexpr = 2 * HALF // BLOCK_N
    d = (g % G) * S + tl.arange(0, S)[None, :]
    row1 = ((g // G) * (2 * HALF) + d).to(tl.int64)
    c = tl.load(cos_ptr + d).to(tl.float32)
    sn = tl.load(sin_ptr + d).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    rot = row1 < n_rot_rows
    lo = tl.where(rot, (x1f * c - x2f * sn).to(dt), x1)
    hi = tl.where(rot, (x2f * c + x1f * sn).to(dt), x2)
    tl.store(out_ptr + row1, lo)
    tl.store(out_ptr + row1 + HALF, hi)
    slot = tl.zeros_like(row1) + tl.load(slot_ptr).to(tl.int64)  # as a block: a scalar mask will not broadcast
    in_pool = (slot >= 0) & (slot < n_slots)
    base = tl.where(in_pool, slot, 0) * n_k_rows
    k_first = n_rot_rows - n_k_rows
    is_k = in_pool & (row1 >= k_first) & (row1 < n_rot_rows)
    is_v = in_pool & (row1 >= n_rot_rows)
    tl.store(kc_ptr + base + row1 - k_first, lo, mask=is_k)
    tl.store(kc_ptr + base + row1 + HALF - k_first, hi, mask=is_k)
    tl.store(vc_ptr + base + row1 - n_rot_rows, lo, mask=is_v)
    tl.store(vc_ptr + base + row1 + HALF - n_rot_rows, hi, mask=is_v)


_EMPTY = tl.constexpr(-1)  # int32 bits of a workspace word no partial has landed in (a NaN arithmetic never makes)


@triton.jit
def _landed(part):
    """float32 partials with the one bit pattern reserved for empty words (-1, a NaN) made the canonical NaN."""
    bits = part.to(tl.int32, bitcast=True)
    return tl.where(bits == _EMPTY, 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _any_empty(parts):
    """Whether any word of the 2-D block ``parts`` is empty: its bits -1 are the largest unsigned 32-bit value,
    which ``_landed`` keeps every partial from being (as a signed int32, -1 is not the least of a block whose
    negative floats have their sign bit set)."""
    return tl.max(tl.max(parts.to(tl.uint32, bitcast=True), 1), 0) == 0xFFFFFFFF


@triton.jit
def _xs_block_done(part, rows, lrows, ws_ptr, res_ptr, out_ptr, N, SPLIT_P2: tl.constexpr, RESIDUAL: tl.constexpr,
                   TAGGED: tl.constexpr = False):
    """A stationary program's float32 sums for one row block: the output rows ``rows`` where the program owns
    the whole of K (``SPLIT_P2 == 1``), else its slice's partials at the logical rows ``lrows`` of the workspace
    (``TAGGED``: never the empty word, ``_landed``)."""
    if SPLIT_P2 == 1:
        _output_rows(part, rows, res_ptr, out_ptr, RESIDUAL)
    elif TAGGED:
        tl.store(ws_ptr + tl.program_id(0) * N + lrows, _landed(part))
    else:
        tl.store(ws_ptr + tl.program_id(0) * N + lrows, part)


@triton.jit
def _xs_reduce(ws_ptr, cnt_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
               n_k_rows, n_slots, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT_P2: tl.constexpr,
               RED_ROWS: tl.constexpr, RESIDUAL: tl.constexpr, ROPE_HALF: tl.constexpr, REDUCE: tl.constexpr,
               TAGGED: tl.constexpr = False):
    """Where K is split (``SPLIT_P2 > 1``): count this program's arrival at its row chunk (``program_id(1)``,
    ``ROWS`` rows); the last slice to arrive sums every slice's partials in slice order, ``RED_ROWS`` rows at a
    time, stores them (``_output_rows``, or ``_rope_cache_rows`` with ``ROPE_HALF``) and resets the chunk's
    counter. That is three memory round trips one after another at the end of the kernel: the fence that makes
    the partials visible, the counter, the partials' loads. ``TAGGED`` (an experiment): no fence, no counter --
    the workspace words start empty (bits -1, a NaN no arithmetic makes), each slice's partials land in one
    4-byte store each, and the chunk's last slice (the last of its programs to be scheduled, so the others are
    already running: it cannot wait on a program that has no SM) waits until no word of the chunk is empty, sums
    and empties them again: one round trip, as CUTLASS's stream-K fix-up waits on its peers' flags. ``REDUCE``
    False (a timing experiment): the partials are left unsummed."""
    if SPLIT_P2 == 1 or not REDUCE:
        return
    pid_n = tl.program_id(1)
    tl.debug_barrier()  # all of this program's partials are written before its arrival is counted / they are read
    if TAGGED:
        if tl.program_id(0) == tl.num_programs(0) - 1:
            _xs_sum_tagged(ws_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
                           n_k_rows, n_slots, BLOCK_N, ROWS, SPLIT_P2, RED_ROWS, RESIDUAL, ROPE_HALF)
    elif tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        sl = tl.arange(0, SPLIT_P2)
        for r0 in range(0, ROWS, RED_ROWS):  # slices summed in a fixed order: the same bits whoever came last
            rows = pid_n * ROWS + r0 + tl.arange(0, RED_ROWS)
            parts = tl.load(ws_ptr + sl[:, None] * N + rows[None, :], mask=(sl < tl.num_programs(0))[:, None],
                            other=0.0, cache_modifier=".cg")
            _xs_chunk_rows(tl.sum(parts, 0), rows, pid_n * ROWS + r0, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                           kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots, BLOCK_N, RED_ROWS, RESIDUAL, ROPE_HALF)
        tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def _xs_chunk_rows(total, rows, r0, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
                   n_k_rows, n_slots, BLOCK_N: tl.constexpr, RED_ROWS: tl.constexpr, RESIDUAL: tl.constexpr,
                   ROPE_HALF: tl.constexpr):
    """Store ``RED_ROWS`` summed rows from logical row ``r0``: ``_output_rows``, or ``_rope_cache_rows``."""
    if ROPE_HALF > 0:
        _rope_cache_rows(total, r0 // BLOCK_N, out_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
                         n_k_rows, n_slots, RED_ROWS, BLOCK_N, ROPE_HALF)
    else:
        _output_rows(total, rows, res_ptr, out_ptr, RESIDUAL)


@triton.jit
def _xs_sum_tagged(ws_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows, n_k_rows,
                   n_slots, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT_P2: tl.constexpr,
                   RED_ROWS: tl.constexpr, RESIDUAL: tl.constexpr, ROPE_HALF: tl.constexpr):
    """The ``TAGGED`` reduction of row chunk ``program_id(1)``: wait until every slice's word of each row has
    landed (volatile loads: read again from L2, never from a copy), sum in slice order, empty the words (the
    workspace is all empty between launches) and store the rows."""
    pid_n = tl.program_id(1)
    sl = tl.arange(0, SPLIT_P2)
    ok = (sl < tl.num_programs(0))[:, None]
    for r0 in range(0, ROWS, RED_ROWS):
        rows = pid_n * ROWS + r0 + tl.arange(0, RED_ROWS)
        ptrs = ws_ptr + sl[:, None] * N + rows[None, :]
        parts = tl.load(ptrs, mask=ok, other=0.0, volatile=True)
        while _any_empty(parts):  # a slice's partials still on their way
            parts = tl.load(ptrs, mask=ok, other=0.0, volatile=True)
        tl.store(ptrs, tl.full(parts.shape, _EMPTY, tl.int32).to(tl.float32, bitcast=True), mask=ok)
        _xs_chunk_rows(tl.sum(parts, 0), rows, pid_n * ROWS + r0, res_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                       kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots, BLOCK_N, RED_ROWS, RESIDUAL, ROPE_HALF)


@triton.jit
def _w4_gemv_xs(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, norm_w_ptr, res_ptr, eps, N, K, stride_pk,
                stride_pn, stride_sk, stride_sn, stride_zk, stride_zn, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr,
                n_rot_rows, n_k_rows, n_slots, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, ROW_STEPS: tl.constexpr, PREFETCH: tl.constexpr, SPLIT_P2: tl.constexpr,
                RED_ROWS: tl.constexpr, HALF_MATH: tl.constexpr, WEIGHTS_FIRST: tl.constexpr = False,
                PDL: tl.constexpr = False, REDUCE: tl.constexpr = True, SWIGLU: tl.constexpr = False,
                NORM_CHUNKS: tl.constexpr = 0, RESIDUAL: tl.constexpr = False, ROPE_HALF: tl.constexpr = 0,
                PAIR_WORDS: tl.constexpr = False, TAGGED: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 1):
    """The int4 GEMV with the activations *stationary* (16-bit activations, whole tiles: ``N`` a multiple of
    ``BLOCK_N * ROW_STEPS``, ``K`` of ``BLOCK_K``, power-of-two groups that divide ``BLOCK_K``).

    Program ``(k, n)`` owns slice ``k`` of ``BLOCK_K`` activations and ``ROW_STEPS`` blocks of ``BLOCK_N`` rows.
    It prepares its slice once (float16 pairs, powers of two, sums) and walks down its rows with nothing but
    weight, scale and zero loads and the packed float16 dot, the next row block's loads issued before this one's
    math (``PREFETCH``; ``WEIGHTS_FIRST``: the first block's loads issued before the slice's preparation).
    ``_w4_gemv`` redoes that preparation, with a layout change through shared memory and a barrier, at every step
    of every row block. With one slice (``SPLIT_P2 == 1``: the program owns the whole of K) it stores its rows;
    otherwise partials go to the float32 workspace ``[slices, N]`` and the last slice of a row chunk to arrive
    sums all slices (``SPLIT_P2 >= slices``, ``RED_ROWS`` rows at a time) in slice order, writes the rows and
    resets its counter. ``SWIGLU``: ``x_ptr`` holds ``[gate | up]`` and the activations are ``silu(gate) * up``.
    ``NORM_CHUNKS > 0``: ``x_ptr`` holds a decoder layer's residual stream and the activations are its RMSNorm
    (weight ``norm_w_ptr``, ``eps``): a whole-K program takes the statistic from its own activations, a split one
    reads the whole row (``NORM_CHUNKS`` chunks of ``BLOCK_K``, from L2) after issuing its slice's loads.
    ``RESIDUAL``: the rows written are the projection plus ``res_ptr``'s rows, loaded at the store (loading them at
    the program's start was no faster: gemv_study_fused_ed2d5a7). Together they take a decode step's add + RMSNorm
    kernels into the GEMVs around them. ``ROPE_HALF > 0`` (split programs; a merged q/k/v projection of heads of
    ``2 * ROPE_HALF`` rows): each block of ``BLOCK_N`` rows holds half a block of a head's first half and the same
    dims of its second half (``_rope_rows``), so the last program rotates the first ``n_rot_rows`` rows (q and k)
    by ``cos_ptr``/``sin_ptr`` as it stores them, and writes the k and v rows (``n_k_rows`` each) to the paged
    caches at ``slot_ptr``'s slot (skipped outside ``[0, n_slots)``), as ``apply_rope_and_cache`` does.
    ``PDL`` (``pdl_meta``): the next launch released at the start and, where this one is launched as a
    programmatic dependent launch, the first loads issued before waiting for the kernel ahead. ``PAIR_WORDS``
    (groups of 16 weights or more; on in the default tiles): two words' products share float16 lanes
    (``_w4_pair_dot``), one float32 conversion and add per 16 weights. Experiments of scripts/gemv_study.py:
    ``REDUCE=False`` (the partials left unsummed: wrong output, for the time the reduction costs); ``TAGGED``: the
    reduction of ``_xs_reduce`` without fence or counter (the workspace from ``_empty_partials``); ``LOOP_STAGES``
    > 1 with ``PREFETCH`` 0: Triton's pipeliner takes the row blocks' loads, ``LOOP_STAGES - 1`` blocks in flight
    through shared memory (cp.async) instead of one in registers (sm_90 under Triton 3.6: 65-67 registers against
    72)."""
    BLOCK_G: tl.constexpr = BLOCK_K // GROUP
    WORDS: tl.constexpr = GROUP // 8
    ROWS: tl.constexpr = BLOCK_N * ROW_STEPS
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    gl = tl.arange(0, BLOCK_G)  # the slice's groups
    wl = gl[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # and its words
    kw = pid_k * (BLOCK_G * WORDS) + wl
    lrows = (pid_n * ROWS + tl.arange(0, BLOCK_N)).to(tl.int64)  # the logical rows of this program's first block
    n64 = _rope_rows(pid_n * ROW_STEPS, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else lrows  # and the weights' rows
    # the weights as 2-D rows of the slice's contiguous words, viewed as [rows, groups, words] only for the math
    p_ptrs = p_ptr + pid_k.to(tl.int64) * stride_pk + n64[:, None] * stride_pn + tl.arange(0, BLOCK_G * WORDS)[None, :]
    s_ptrs = s_ptr + pid_k.to(tl.int64) * stride_sk + n64[:, None] * stride_sn + gl[None, :]
    z_ptrs = z_ptr + pid_k.to(tl.int64) * stride_zk + n64[:, None] * stride_zn + gl[None, :]
    if PDL:  # the next launch may start now: its first weight loads overlap this kernel's tail
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH and WEIGHTS_FIRST:  # the first block's loads in flight while the slice is prepared
        nw, ns, nz = tl.load(p_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)
    if PDL:  # launched before the kernel ahead finished: nothing it writes may be read or written before this
        tl.extra.cuda.gdc_wait()
    k8 = kw[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    if NORM_CHUNKS > 0:
        x8 = _normed_activations(x_ptr, norm_w_ptr, k8, K, eps, BLOCK_K, NORM_CHUNKS)
    else:
        x8 = _slice_activations(x_ptr, k8, K, SWIGLU)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_octets(x8, BLOCK_G, WORDS)
    x_sum = tl.sum((x0 + x1) + (x2 + x3) + (x4 + x5) + (x6 + x7), 1)
    up, down = _pow2_scales(x8)
    xa, xb, xc, xd = _x_half2(x0, x1, x2, x3, x4, x5, x6, x7, up[:, None], HALF_MATH == 1)
    if PAIR_WORDS:  # words 2j and 2j + 1 of a group share float16 lanes
        xa, ya = _even_odd_words(xa, BLOCK_G, WORDS)
        xb, yb = _even_odd_words(xb, BLOCK_G, WORDS)
        xc, yc = _even_odd_words(xc, BLOCK_G, WORDS)
        xd, yd = _even_odd_words(xd, BLOCK_G, WORDS)
    if PREFETCH and not WEIGHTS_FIRST:
        nw, ns, nz = tl.load(p_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)
    for i in tl.range(0, ROW_STEPS, num_stages=LOOP_STAGES):
        step = _rope_step(pid_n * ROW_STEPS + i, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else BLOCK_N  # rows to next
        if PREFETCH:  # this block's loads were issued a block ago; issue the next block's now
            wd, s, z = nw, ns, nz
            more = i + 1 < ROW_STEPS
            nw = tl.load(p_ptrs + step * stride_pn, mask=more)
            ns = tl.load(s_ptrs + step * stride_sn, mask=more)
            nz = tl.load(z_ptrs + step * stride_zn, mask=more)
        else:
            wd, s, z = tl.load(p_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)
        p_ptrs += step * stride_pn
        s_ptrs += step * stride_sn
        z_ptrs += step * stride_zn
        if PAIR_WORDS:
            we, wo = tl.split(tl.reshape(wd, [BLOCK_N, BLOCK_G, WORDS // 2, 2]))
            dots = _w4_pair_dot(we, wo, xa[None], xb[None], xc[None], xd[None], ya[None], yb[None], yc[None],
                                yd[None], HALF_MATH == 1)
        else:
            dots = _word_dot(tl.reshape(wd, [BLOCK_N, BLOCK_G, WORDS]), xa[None], xb[None], xc[None], xd[None],
                             HALF_MATH == 1)
        q_x = tl.sum(dots, 2) * down[None, :]
        part = tl.sum(s.to(tl.float32) * (q_x - z.to(tl.float32) * x_sum[None, :]), 1)
        _xs_block_done(part, n64 + i * BLOCK_N, lrows + i * BLOCK_N, ws_ptr, res_ptr, out_ptr, N, SPLIT_P2,
                       RESIDUAL, TAGGED)
    _xs_reduce(ws_ptr, cnt_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
               n_k_rows, n_slots, BLOCK_N, ROWS, SPLIT_P2, RED_ROWS, RESIDUAL, ROPE_HALF, REDUCE, TAGGED)


@triton.jit
def _w8_gemv_xs(x_ptr, w_ptr, s_ptr, lo_mask, hi_mask, out_ptr, ws_ptr, cnt_ptr, norm_w_ptr, res_ptr, eps, N, K,
                stride_wk, stride_wn, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows, n_k_rows, n_slots,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_STEPS: tl.constexpr, PREFETCH: tl.constexpr,
                SPLIT_P2: tl.constexpr, RED_ROWS: tl.constexpr, WEIGHTS_FIRST: tl.constexpr = False,
                PDL: tl.constexpr = False, REDUCE: tl.constexpr = True, SWIGLU: tl.constexpr = False,
                NORM_CHUNKS: tl.constexpr = 0, RESIDUAL: tl.constexpr = False, ROPE_HALF: tl.constexpr = 0,
                HALF_MATH: tl.constexpr = 0, TAGGED: tl.constexpr = False):
    """``_w4_gemv_xs`` for int8 weights with a per-row scale: the same grid, slices, prefetch, programmatic
    dependent launch, cross-slice reduction and neighbours (``SWIGLU``, ``NORM_CHUNKS``, ``RESIDUAL``,
    ``ROPE_HALF``), so an int8 decode step loses the same kernels an int4 one does. ``w_ptr``: the weights as int32
    words (bytes ``4w .. 4w + 3`` of a row, k = 4w + i at bits 8i); ``s_ptr`` ``[N]``; strides in words,
    ``stride_wk`` from one slice to the next. ``HALF_MATH`` 0: each byte read in place by ``_byte_pair`` (one LOP3,
    one FADD and one FFMA per weight, float32 activations held by the program; sm_90: 4.6-4.7 loop instructions per
    weight); 1 (PTX) or 2 (emulated): packed float16 pairs (``_w8_pair_dot``: word p of the slice's first half with
    word p of its second), the slice's activations scaled by one power of two into [32, 64). Each slice's partial
    sum is scaled by its row's scale before the slices are summed."""
    WORDS: tl.constexpr = BLOCK_K // 4
    ROWS: tl.constexpr = BLOCK_N * ROW_STEPS
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    HALF_WORDS: tl.constexpr = WORDS // 2
    wl = tl.arange(0, WORDS)
    lrows = (pid_n * ROWS + tl.arange(0, BLOCK_N)).to(tl.int64)
    n64 = _rope_rows(pid_n * ROW_STEPS, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else lrows
    # the slice's words in two halves, word p of the first meeting word p of the second in one packed dot
    w_ptrs = w_ptr + pid_k.to(tl.int64) * stride_wk + n64[:, None] * stride_wn + tl.arange(0, HALF_WORDS)[None, :]
    s_ptrs = s_ptr + n64
    if PDL:  # the next launch may start now: its first weight loads overlap this kernel's tail
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH and WEIGHTS_FIRST:  # the first block's loads in flight while the slice is prepared
        na, nb, ns = tl.load(w_ptrs), tl.load(w_ptrs + HALF_WORDS), tl.load(s_ptrs)
    if PDL:  # nothing the kernel ahead writes may be read or written before this
        tl.extra.cuda.gdc_wait()
    # [words, 2, 2]: k = 4w + 2a + b, so splitting b then a gives bytes 0 and 2, then 1 and 3 of each word
    k4 = (pid_k * WORDS + wl)[:, None, None] * 4 + (tl.arange(0, 2)[:, None] * 2 + tl.arange(0, 2)[None, :])[None]
    if NORM_CHUNKS > 0:
        x4 = _normed_activations(x_ptr, norm_w_ptr, k4, K, eps, BLOCK_K, NORM_CHUNKS)
    else:
        x4 = _slice_activations(x_ptr, k4, K, SWIGLU)
    xa, xb = tl.split(tl.permute(tl.reshape(x4, [2, HALF_WORDS, 2, 2]), (1, 2, 3, 0)))  # the two halves
    if HALF_MATH:  # one power of two puts the slice's largest |x| in [32, 64): no float16 lane overflows
        up, down = _pow2_of(tl.max(tl.max(tl.max(tl.abs(x4), 2), 1), 0), 5)
        a02, a13 = _x_byte_pairs(xa, up, HALF_MATH == 1)
        b02, b13 = _x_byte_pairs(xb, up, HALF_MATH == 1)
    else:
        a0, a1, a2, a3 = _x_bytes(xa)
        b0, b1, b2, b3 = _x_bytes(xb)
    if PREFETCH and not WEIGHTS_FIRST:
        na, nb, ns = tl.load(w_ptrs), tl.load(w_ptrs + HALF_WORDS), tl.load(s_ptrs)
    for i in range(ROW_STEPS):
        step = _rope_step(pid_n * ROW_STEPS + i, BLOCK_N, ROPE_HALF) if ROPE_HALF > 0 else BLOCK_N  # rows to next
        if PREFETCH:  # this block's loads were issued a block ago; issue the next block's now
            wa, wb, s = na, nb, ns
            more = i + 1 < ROW_STEPS
            na = tl.load(w_ptrs + step * stride_wn, mask=more)
            nb = tl.load(w_ptrs + step * stride_wn + HALF_WORDS, mask=more)
            ns = tl.load(s_ptrs + step, mask=more)
        else:
            wa, wb, s = tl.load(w_ptrs), tl.load(w_ptrs + HALF_WORDS), tl.load(s_ptrs)
        w_ptrs += step * stride_wn
        s_ptrs += step
        if HALF_MATH:
            qx = _w8_pair_dot(wa, wb, a02[None, :], a13[None, :], b02[None, :], b13[None, :], HALF_MATH == 1)
            part = tl.sum(qx, 1) * (down * s.to(tl.float32))
        else:
            qx = _w8_word_fma(wa, a0, a1, a2, a3, lo_mask, hi_mask) + _w8_word_fma(wb, b0, b1, b2, b3, lo_mask,
                                                                                  hi_mask)
            part = tl.sum(qx, 1) * s.to(tl.float32)
        _xs_block_done(part, n64 + i * BLOCK_N, lrows + i * BLOCK_N, ws_ptr, res_ptr, out_ptr, N, SPLIT_P2,
                       RESIDUAL, TAGGED)
    _xs_reduce(ws_ptr, cnt_ptr, res_ptr, out_ptr, N, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, n_rot_rows,
               n_k_rows, n_slots, BLOCK_N, ROWS, SPLIT_P2, RED_ROWS, RESIDUAL, ROPE_HALF, REDUCE, TAGGED)


@triton.jit
def _w4_gemv_any_group(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_pn, stride_sn, stride_zn,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Any even group size (per-weight scale loads): correct, not tuned; power-of-two groups use ``_w4_gemv``."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    offs_j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + offs_j
        j_ok = j < K // 2
        ld = n_ok[:, None] & j_ok[None, :]
        pk = tl.load(p_ptr + n64[:, None] * stride_pn + j[None, :], mask=ld, other=0).to(tl.int32)
        x_even = tl.load(x_ptr + 2 * j, mask=j_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + 2 * j + 1, mask=j_ok, other=0.0).to(tl.float32)
        g = (2 * j) // GROUP  # any even group size: both nibbles of a byte share a group
        s = tl.load(s_ptr + n64[:, None] * stride_sn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n64[:, None] * stride_zn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        lo = ((pk & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23
        hi = (((pk >> 4) & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23
        qx = lo * x_even[None, :] + hi * x_odd[None, :]
        acc += tl.sum(s * (qx - z * (x_even + x_odd)[None, :]), 1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# --- GEMM (Tensor Cores) ---------------------------------------------------------------------------------
@triton.jit
def _tile_pids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program order: consecutive programs share weight tiles in L2."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column offsets of this program's output tile (in ``_tile_pids`` order)."""
    pid_m, pid_n = _tile_pids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om):
    """Write a float32 accumulator tile in the output's dtype, inside ``[M, N]``."""
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _w8_gemm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_KEY, N_KEY, K_KEY,
             PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr):
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=(offs_n[:, None] < N) & (k[None, :] < K), other=0)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)  # int8 -> x dtype: exact
    s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    _store_tile(out_ptr, acc * s[None, :], offs_m, offs_n, M, N, stride_om)


@triton.jit
def _w4_gemm(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_zn,
             stride_om, M_KEY, N_KEY, K_KEY, GROUP: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    n64 = offs_n.to(tl.int64)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + offs_j
        j_ok = j < K // 2
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        a_even = tl.load(x_rows + 2 * j[None, :], mask=m_ok[:, None] & j_ok[None, :], other=0.0)
        a_odd = tl.load(x_rows + 2 * j[None, :] + 1, mask=m_ok[:, None] & j_ok[None, :], other=0.0)
        ld = n_ok[:, None] & j_ok[None, :]
        pk = tl.load(p_ptr + n64[:, None] * stride_pn + j[None, :], mask=ld, other=0)
        g = (2 * j) // GROUP
        s = tl.load(s_ptr + n64[:, None] * stride_sn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n64[:, None] * stride_zn + g[None, :], mask=ld, other=0.0).to(tl.float32)
        w_lo = (((pk & 0xF).to(tl.float32) - z) * s).to(a_even.dtype)  # weights of the even k
        w_hi = (((pk >> 4).to(tl.float32) - z) * s).to(a_even.dtype)   # weights of the odd k
        acc = tl.dot(a_even, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(a_odd, tl.trans(w_hi), acc, input_precision=PRECISION)
    _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om)


@triton.jit
def _w4_gemm_grouped(x_ptr, p_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_pn, stride_sn, stride_zn,
                     stride_om, M_KEY, N_KEY, K_KEY, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Power-of-two groups >= 16 with ``BLOCK_K`` dividing ``GROUP``: every K step lies inside one group, so its
    scales and zero-points are one ``[BLOCK_N]`` load per step (not one per weight), the nibbles become floats
    without a conversion instruction (the magic-number trick of the GEMV) and are interleaved back into k order
    for one ``tl.dot`` over the whole step."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    n64 = offs_n.to(tl.int64)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    p_rows = p_ptr + n64[:, None] * stride_pn + tl.arange(0, HALF)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of GROUP, hence of BLOCK_K: no mask along K
        a = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)
        pk = tl.load(p_rows + k0 // 2, mask=n_ok[:, None], other=0).to(tl.int32)
        g = k0 // GROUP
        s = tl.load(s_ptr + n64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + n64 * stride_zn + g, mask=n_ok, other=0.0).to(tl.float32)
        lo = ((pk & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23  # the even k of each byte
        hi = (((pk >> 4) & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - _TWO23  # the odd k
        q = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # [n, j, 2] -> [n, 2j + {0, 1}]
        w = ((q - z[:, None]) * s[:, None]).to(a.dtype)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om)


# --- autotuning (CUDA) and fixed tiles (interpreter) -----------------------------------------------------
# GEMV tiles (BLOCK_N, BLOCK_K, warps): 16 contiguous bytes per thread along K; int4's BLOCK_K counts weights.
# Chosen from `scripts/gemv_study.py` on the H200 (records/gemv_study.json: every candidate timed in CUDA
# graphs over weights that are not in L2, at the 8B decode shapes): the winners are short and wide -- 8-64 rows,
# 256-2048 weights per step, mostly unsplit for int8 -- not the tall tiles tuned before against do_bench's dirty
# L2 flush. The widest (a whole 4096-long row per step) issue every load of a small layer at once.
# Compiled for sm_90 (Triton 3.9, ptxas, `scripts/sass_report.py`): no spills; the K loop issues 3.8-4.1
# instructions per int8 weight (LOP3 + FADD + FFMA, a shift per word, addressing) and 4.1-4.6 per int4 weight.
#   int8 (registers): (16,256,2) 71; (32,256,4) 72; (64,256,4) 127; (16,512,4) 71; (8,1024,4) 67;
#                     (16,1024,4) 119; (8,2048,4) 128; (16,2048,8) 127
#   int4, packed float16 math (registers, instructions per weight): (16,512,2) 72, 3.25; (16,1024,4) 72, 3.27;
#                     (8,2048,4) 80, 3.77; (64,128,2) 96, 3.48; (256,128,4) 128, 2.98 (PREFETCH adds 24-48
#                     registers). Each within 4-20% of the best of 13 tiles at every 8B shape (gemv_study);
#                     ncu: 20-29% occupancy, limited by registers, and about half the issue slots idle
W8_TILES = ((16, 256, 2), (32, 256, 4), (64, 256, 4), (16, 512, 4), (8, 1024, 4), (16, 1024, 4), (8, 2048, 4),
            (16, 2048, 8))
W4_TILES = ((16, 512, 2), (16, 1024, 4), (8, 2048, 4), (64, 128, 2), (256, 128, 4))
# register caps among the int4 autotuner's candidates: none for now. A cap of 96 (ncu: ~128 before, 4 warps per
# scheduler) gave 1-7% at 4 of the 5 8B shapes and lost 4% at 4096 -> 4096, 64 spilled (10-30% slower)
# (records/gemv_study_maxnreg_prep_e66a969.json); with 96 among the candidates, notebooks 03 and 04 spent ~50-60 s
# more autotuning each and ran past their H200 stage limits (logs/2026-12-04_call3_*), so they are unmeasured
W4_MAXNREG: tuple = ()
SPLITS = (1, 2, 4, 8, 16)
LOAD_STAGES = (1, 3)  # 1: plain loads into registers; 3: pipelined through shared memory (cp.async)
MAX_CTAS_PER_SM = 8  # a split is only worth it while the grid is small (the H200's best at 4096 -> 4096: 7.8)


def _gemv_configs(tiles, prefetch: bool = False, maxnreg: tuple = ()) -> list:
    """Every tile x split x load pipeline (with ``prefetch``, also plain loads prefetched a step ahead; each
    register cap in ``maxnreg``, plain loads under it)."""
    pipelines = [({"LOAD_STAGES": st} | ({"PREFETCH": False} if prefetch else {}), None) for st in LOAD_STAGES]
    pipelines += [({"LOAD_STAGES": 1, "PREFETCH": True}, None)] if prefetch else []
    pipelines += [({"LOAD_STAGES": 1} | ({"PREFETCH": False} if prefetch else {}), r) for r in maxnreg]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, **p}, num_warps=w, num_stages=1, maxnreg=r)
            for n, k, w in tiles for s in SPLITS for p, r in pipelines]


def _prune_gemv(configs, named_args, **kwargs):
    """Per shape: splits that keep the grid under ~8 CTAs per SM and give each split >= 2 steps; per tile no
    split plus the two largest that qualify. int4 tiles hold whole groups: a group longer than a tile's step
    widens the step to one group and narrows the tile to keep its bytes."""
    n, k, group = named_args["N"], named_args["K"], kwargs.get("GROUP", named_args.get("GROUP"))
    sms = num_sms(named_args["x_ptr"].device)
    by_tile: dict = {}
    for c in configs:
        bn, bk, s = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if group and bk < group:
            bn, bk = max(8, bn * bk // group), group
            c = triton.Config(dict(c.kwargs, BLOCK_N=bn, BLOCK_K=bk), num_warps=c.num_warps,
                              num_stages=c.num_stages, maxnreg=c.maxnreg)
        if s > 1 and (triton.cdiv(n, bn) * s > MAX_CTAS_PER_SM * sms or triton.cdiv(k, s) < 2 * bk):
            continue
        variant = (s, c.kwargs["LOAD_STAGES"], c.kwargs.get("PREFETCH"), c.maxnreg)
        by_tile.setdefault((bn, bk, c.num_warps), {})[variant] = c
    kept = []
    for cs in by_tile.values():
        splits = sorted({s for s, *_ in cs})
        chosen = {1, *splits[-2:]}
        kept += [c for (s, *_), c in cs.items() if s in chosen]
    return kept or configs[:1]


def _even(args: dict) -> bool:
    """Every program of the GEMV has whole steps and real rows (N a multiple of BLOCK_N, K of BLOCK_K x SPLIT_K,
    whole aligned words), so it runs without masks: at LLM shapes, always."""
    return (args["N"] % args["BLOCK_N"] == 0 and args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0
            and args.get("WORDS_ALIGNED", True))


def _gemm_configs() -> list:
    cfgs = [(16, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for m, n, k, w, s in cfgs]


def _prune_gemm(configs, named_args, **kwargs):
    m = named_args["M_KEY"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)]
    return kept or configs


def _prune_gemm_grouped(configs, named_args, **kwargs):
    """As ``_prune_gemm``, with each step narrowed to divide the group (``BLOCK_K <= GROUP``)."""
    group = kwargs.get("GROUP", named_args.get("GROUP"))
    out = {}
    for c in _prune_gemm(configs, named_args, **kwargs):
        meta = dict(c.kwargs, BLOCK_K=min(c.kwargs["BLOCK_K"], group))
        out.setdefault(tuple(sorted(meta.items())) + (c.num_warps, c.num_stages),
                       triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages))
    return list(out.values())


_w8_gemv_tuned = triton.autotune(_gemv_configs(W8_TILES), key=["N", "K"], do_bench=cold_l2_bench,
                                 prune_configs_by={"early_config_prune": _prune_gemv})(
    triton.heuristics({"EVEN": _even})(_w8_gemv))
_w4_gemv_tuned = triton.autotune(_gemv_configs(W4_TILES, prefetch=True, maxnreg=W4_MAXNREG), key=["N", "K", "GROUP"],
                                 do_bench=cold_l2_bench, prune_configs_by={"early_config_prune": _prune_gemv})(
    triton.heuristics({"EVEN": _even})(_w4_gemv))
_w8_gemm_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY"],
                                 prune_configs_by={"early_config_prune": _prune_gemm})(_w8_gemm)
_w4_gemm_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY", "GROUP"],
                                 prune_configs_by={"early_config_prune": _prune_gemm})(_w4_gemm)
_w4_gemm_grouped_tuned = triton.autotune(_gemm_configs(), key=["M_KEY", "N_KEY", "K_KEY", "GROUP"],
                                         prune_configs_by={"early_config_prune": _prune_gemm_grouped})(
    _w4_gemm_grouped)
# the interpreter's fixed tiles (tests swap in others, split-K included); int4 raises BLOCK_K to the group
CPU_GEMV8 = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, LOAD_STAGES=1)
CPU_GEMV4 = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, LOAD_STAGES=1, PREFETCH=False)
ANY_GROUP_GEMV = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4)
CPU_GEMM = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)

# the stationary-activation int4 GEMV (16-bit activations, whole tiles): one tile, no autotuning. At ded9987 and
# 2748180 (records/gemv_study_xs_2748180.json: 16-32 rows, 512-1024 activations, 1-32 row blocks per program,
# one or two blocks prefetched) 16 rows x 512 activations, 2 warps, one block prefetched won at every 8B shape,
# with the row blocks per program that gave 5.8-7.8 programs per SM; more programs (less reuse of each slice)
# or fewer (less in flight) were slower.
# At 5885d9a (records/gemv_study_xs_tiles_5885d9a.json) 1-warp programs, 1024-2048 activations a slice and
# whole-K programs of 1-2 warps lost; programs that own the whole of K = 4096 (4 rows a step, 4 warps: no partials,
# no arrival counters) won. Every winner had 11-16 warps per SM: the whole grid resident at once, no second wave.
# The cap of 16 warps per SM was registers: 128 a thread (ncu on the H200: "Block Limit Registers 8", theoretical
# occupancy 25%, logs/2026-12-04c_call2_ncu.log). Triton 3.6 (the H200 image's) laid the [rows, groups, words]
# weight tile out with threads across rows, so each thread held the activation pairs of all 4 groups; Triton 3.9
# (this repository's CPU pin, whose offline compiles said 72) spread threads across groups. Since the session of
# 2026-12-05 the weights are loaded as 2-D rows and only viewed as [rows, groups, words] for the math: 68-80
# registers under both (scripts/sass_report.py --kernel xs, results/cpu/records/sass_xs.json), up to ~28 warps
# per SM -- grids with more warps per SM than 16 have not been timed yet.
# With each GEMV after a kernel that writes its activations, as in a decode step (gemv_study_xs_step_7b7213b.json),
# whole-K programs won where N <= 6144 (k/v 1024: 6.16 -> 5.60 us, o 8.24 -> 7.96, qkv 9.83 -> 9.37), tied at
# 28672 and lost at 14336 (14.53 -> 15.13).
# PAIR_WORDS (two words' products in the same float16 lanes, 2.72 -> 2.42 loop instructions per weight): at
# every shape's rule row steps no slower, each GEMV after a kernel that writes its activations
# (records/gemv_study_pairs_f65fe09.json): 14336 x 4096 13.11 -> 12.98 us, gate_up 22.97 -> 22.24, o whole-K
# 7.91 -> 7.37; dropped for groups of 8 (one word), where it cannot apply
XS_TILE = dict(BLOCK_N=16, BLOCK_K=512, PREFETCH=1, WEIGHTS_FIRST=True, num_warps=2, PAIR_WORDS=True)
XS_WHOLE_K_TILE = dict(BLOCK_N=4, PREFETCH=1, WEIGHTS_FIRST=True, num_warps=4, PAIR_WORDS=True)  # BLOCK_K = K
XS_WHOLE_K_MAX = 4096  # K
XS_WHOLE_K_MAX_N = 8192
# int8 (_w8_gemv_xs), not timed yet: the int4 tiles' bytes per row block (a weight is twice the bytes, so half
# the rows); sm_90 loop 3.3-3.7 instructions per weight in packed float16 (results/cpu/records/sass_w8xs.json);
# scripts/gemv_study.py --kinds w8xs times them (and 1-warp tiles: 2.9) against the split-K _w8_gemv
XS8_TILE = dict(BLOCK_N=8, BLOCK_K=512, PREFETCH=1, WEIGHTS_FIRST=True, num_warps=2)
XS8_WHOLE_K_TILE = dict(BLOCK_N=2, PREFETCH=1, WEIGHTS_FIRST=True, num_warps=4)  # BLOCK_K = K
XS8_PLAIN = False  # whether a bare int8 product (nothing fused, no PDL) takes _w8_gemv_xs too
CPU_XS_TILE = dict(BLOCK_N=8, BLOCK_K=128, PREFETCH=1, num_warps=1)  # tests set ROW_STEPS and others
XS_WARPS_PER_SM = 11  # whole-K programs
# programs on slices of K: 22 since the 2-D weight loads let more warps fit. Each GEMV after a kernel that writes
# its activations, H200 (records/gemv_study_step_e38a902.json), half the row steps of the old rule (11):
# gate_up 25.89 -> 22.93 us, down 16.32 -> 13.96, 14336 x 4096 15.82 -> 13.80; a quarter: slower again
XS_SPLIT_WARPS_PER_SM = 22
XS_MAX_SLICES = 256
XS_REDUCE_TILE = 4096  # float32 partials per reduction tile of the last program (64 registers a thread)

_SPLIT_BUFFERS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED_BUFFERS: list = []  # outgrown workspaces stay allocated: a captured CUDA graph may still point at them


def _split_buffers(device: torch.device, n: int, splits: int = MAX_SPLIT_K) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace of ``device``: float32 partials (at least ``[splits * n]``) and int32 arrival counters
    ``[n']``, ``n' >= n`` (zero between launches: each launch's last split resets its own).

    One per device, shared by every GEMV launched on it, so GEMVs must not run concurrently on two streams of
    one device. Made (or grown) on the first call that needs more: make that call before CUDA-graph capture
    (the warm-up that autotunes); an outgrown workspace is kept, since graphs captured earlier still use it.
    """
    key = str(device)
    bufs = _SPLIT_BUFFERS.get(key)
    if bufs is None or bufs[1].numel() < n or bufs[0].numel() < splits * n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the GEMV split-K workspace for N={n} x {splits} splits does not exist yet and "
                               "cannot be allocated during CUDA-graph capture; call the layer once before "
                               "capturing (warm-up)")
        size = next_pow2(max(n, bufs[1].numel() if bufs else 0))
        floats = max(MAX_SPLIT_K * size, next_pow2(splits * n), bufs[0].numel() if bufs else 0)
        if bufs is not None:
            _RETIRED_BUFFERS.append(bufs)
        bufs = (torch.empty(floats, dtype=torch.float32, device=device),
                torch.zeros(size, dtype=torch.int32, device=device))
        _SPLIT_BUFFERS[key] = bufs
    return bufs


def _empty_partials(device: torch.device, size: int) -> torch.Tensor:
    """The workspace of the ``TAGGED`` reduction on ``device``: float32 words, at least ``size``, all empty (bits
    -1) between launches (each launch's reducers empty what they read); see ``kernel_workspace``."""
    return kernel_workspace("tagged GEMV partials", size, device, fill=-1).view(torch.float32)


def xs_tile(n: int, k: int, group: int, device: torch.device, tile: dict | None = None,
            norm: bool = False, bits: int = 4) -> dict | None:
    """The stationary-activation int4 GEMV's launch parameters for ``[N, K]`` weights, or None where its whole
    tiles do not fit (the split-K ``_w4_gemv`` takes those). ``tile``: ``BLOCK_N``, ``BLOCK_K`` (raised to the
    group), ``PREFETCH``, ``num_warps`` and optionally ``ROW_STEPS`` (a power of two); without it, the most row
    blocks per program that still give every SM ``XS_WARPS_PER_SM`` warps (``XS_SPLIT_WARPS_PER_SM`` where K is
    split). Default tile: under the interpreter ``CPU_XS_TILE``; on CUDA ``XS_WHOLE_K_TILE`` where ``K <=
    XS_WHOLE_K_MAX`` is a power-of-two number of groups
    and ``N <= XS_WHOLE_K_MAX_N`` whole steps of it, else ``XS_TILE``; also ``XS_TILE`` with ``norm`` (the RMSNorm
    in the prologue), where a whole-K program holds its row's statistic beside the row (96 registers on sm_90,
    against 72, results/cpu/records/sass_xs.json: fewer warps per SM; qkv 10.6 us against 9.5 split,
    gemv_study_fused_ed2d5a7); the default tiles pair words (``PAIR_WORDS``) where groups hold two or more.
    ``bits=8``: the int8 kernel's tiles (``XS8_TILE``, ``XS8_WHOLE_K_TILE``), where
    ``group`` is ignored and a slice is whole int32 words of weights."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}; allowed: 4, 8")
    unit = group if bits == 4 else 4  # a slice holds a power-of-two number of these
    split_tile, whole_tile = (XS_TILE, XS_WHOLE_K_TILE) if bits == 4 else (XS8_TILE, XS8_WHOLE_K_TILE)
    if tile is None and device.type == "cuda":
        whole = not norm and (k <= XS_WHOLE_K_MAX and k % unit == 0 and (k // unit) & (k // unit - 1) == 0
                 and n <= XS_WHOLE_K_MAX_N and n % whole_tile["BLOCK_N"] == 0)
        tile = dict(whole_tile, BLOCK_K=k) if whole else split_tile
        if bits == 4 and group < 16:  # one word a group: no second word to pair
            tile = dict(tile, PAIR_WORDS=False)
    tile = dict(tile or CPU_XS_TILE)
    bn, bk = tile["BLOCK_N"], max(tile["BLOCK_K"], unit)
    if (bk // unit) & (bk // unit - 1) or bk % unit:
        raise ValueError(f"BLOCK_K={bk} must hold a power-of-two number of {unit}-weight "
                         f"{'groups' if bits == 4 else 'words'}")
    if n % bn or k % bk or k // bk > XS_MAX_SLICES:
        return None
    slices = k // bk
    target = (XS_WARPS_PER_SM if slices == 1 else XS_SPLIT_WARPS_PER_SM) * num_sms(device)
    steps = tile.get("ROW_STEPS") or max([s for s in (1, 2, 4, 8, 16, 32) if n % (bn * s) == 0 and
                                          slices * (n // (bn * s)) * tile["num_warps"] >= target] or [1])
    if steps < 1 or steps & (steps - 1):
        raise ValueError(f"ROW_STEPS={steps} must be a power of two")
    if n % (bn * steps):
        return None
    split_p2 = next_pow2(slices)
    return dict(tile, BLOCK_K=bk, ROW_STEPS=steps, SPLIT_P2=split_p2,
                RED_ROWS=min(bn * steps, max(1, XS_REDUCE_TILE // split_p2)))


def pdl_meta(pdl: str, device: torch.device, tile: dict | None = None) -> dict:
    """Launch options of a stationary GEMV for ``pdl`` (``PDL_MODES``): ``""`` plain (or the tile's ``PDL``
    experiment); ``"release"``: the kernel lets the launch after it start at once (a programmatic dependent launch
    then overlaps this kernel's tail); ``"overlap"``: that, and launched as a programmatic dependent launch itself,
    so its programs start while the kernel ahead finishes and issue their first weight loads before waiting for
    it (``griddepcontrol.wait``, before any activation is read or anything written). Only sm_90 and later have
    it; elsewhere every mode is plain."""
    check_pdl(pdl)
    return pdl_launch("overlap" if tile is not None and tile.get("PDL") else pdl, device)


def w4_gemv_xs(x2: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group: int,
               tile: dict, swiglu: bool = False, norm: tuple[torch.Tensor, float] | None = None,
               residual: torch.Tensor | None = None, rope: dict | None = None, pdl: str = "") -> torch.Tensor:
    """Launch ``_w4_gemv_xs`` on one row ``x2`` ``[1, K]`` (float16/bfloat16) and int4 weights as int32 words
    ``[N, K // 8]`` with scales and zeros ``[N, K // group]``; ``tile`` from ``xs_tile`` (experiments of
    scripts/gemv_study.py: ``PDL``, launched as a programmatic dependent launch, sm_90 and later; ``TAGGED``, the
    slices summed by the last of each row chunk, waiting on tagged partials: ``_xs_reduce``). ``swiglu``: ``x2`` is
    ``[1, 2K]``, ``[gate | up]``, and the GEMV multiplies ``silu(gate) * up``. ``norm``: ``(weight [K], eps)``,
    the GEMV multiplies ``rms_norm(x2)``. ``residual`` ``[1, N]`` (contiguous, ``x2``'s dtype): added to the
    output. ``rope`` (a merged q/k/v projection on a split tile whose row blocks fit its heads: see
    ``w4a16_qkv_rope_cache``): ``cos``, ``sin`` (the token's rows, at least ``head_dim / 2`` values), ``slot``
    (int ``[1]``), ``k_cache``, ``v_cache`` and ``num_heads``. ``pdl``: see ``pdl_meta``. Returns ``[1, N]``."""
    bk = tile["BLOCK_K"]
    if tile.get("PAIR_WORDS") and group < 16:
        raise ValueError(f"PAIR_WORDS needs groups of two int32 words or more (group_size >= 16), got {group}")
    # (slice, row) strides: the kernel also reads weights stored slice after slice (gemv_study_xs_sm_492b4c7)
    strides = (bk // 8, words.stride(0), bk // group, s.stride(0), bk // group, z.stride(0))
    return _xs_launch(_w4_gemv_xs, x2, words.shape[0], (words, s, z), strides, tile, swiglu, norm, residual, rope,
                      pdl, GROUP=group, HALF_MATH=1 if x2.device.type == "cuda" else 2)


def w8_gemv_xs(x2: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, tile: dict, swiglu: bool = False,
               norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
               rope: dict | None = None, pdl: str = "") -> torch.Tensor:
    """``w4_gemv_xs`` for int8 weights: launch ``_w8_gemv_xs`` on one row ``x2`` and the weights as int32 words
    ``[N, K // 4]`` with ``scale`` ``[N]``; ``tile`` from ``xs_tile(..., bits=8)`` (``HALF_MATH``: 0 for the float32
    path; default packed float16, emulated under the interpreter); the other arguments as ``w4_gemv_xs`` takes
    them. Returns ``[1, N]``."""
    strides = (tile["BLOCK_K"] // 4, words.stride(0))
    half = tile.get("HALF_MATH", 1 if x2.device.type == "cuda" else 2)
    return _xs_launch(_w8_gemv_xs, x2, words.shape[0], (words, scale, 0xFF, 0xFF00), strides,
                      {key: val for key, val in tile.items() if key != "HALF_MATH"}, swiglu, norm, residual, rope,
                      pdl, HALF_MATH=half)


def _xs_launch(kernel, x2: torch.Tensor, n: int, weights: tuple, strides: tuple, tile: dict, swiglu: bool,
               norm: tuple[torch.Tensor, float] | None, residual: torch.Tensor | None, rope: dict | None, pdl: str,
               **consts) -> torch.Tensor:
    """Launch a stationary GEMV (``_w4_gemv_xs``, ``_w8_gemv_xs``: ``weights`` and their ``strides`` are what
    each reads) with the neighbours it takes in: one program per (slice, row chunk)."""
    k = x2.shape[1] // (2 if swiglu else 1)
    out = torch.empty(1, n, dtype=x2.dtype, device=x2.device)
    slices, rows = k // tile["BLOCK_K"], tile["BLOCK_N"] * tile["ROW_STEPS"]
    ws, cnt = _split_buffers(x2.device, n, slices)
    if tile.get("TAGGED") and slices > 1:
        if tile.get("REDUCE") is False:  # its words would stay landed, and the next launch would sum them
            raise ValueError("TAGGED needs REDUCE: the reducers are what empty the workspace for the next launch")
        ws = _empty_partials(x2.device, n * slices)
    meta = {key: val for key, val in tile.items() if key != "num_warps"}
    meta.update(pdl_meta(pdl, x2.device, tile))
    nw, eps = norm if norm is not None else (x2, 0.0)
    half, rope_args = 0, (x2,) * 5 + (0, 0, 0)
    if rope is not None:
        kc = rope["k_cache"]
        head_dim, k_rows = kc.shape[-1], kc.shape[-2] * kc.shape[-1]
        half = head_dim // 2
        rope_args = (rope["cos"], rope["sin"], rope["slot"], kc, rope["v_cache"],
                     rope["num_heads"] * head_dim + k_rows, k_rows, kc.shape[0] * kc.shape[1])
    kernel[(slices, n // rows)](x2, *weights, out, ws, cnt, nw, x2 if residual is None else residual, eps, n, k,
                                *strides, *rope_args, **meta, **consts, num_warps=tile["num_warps"], num_stages=1,
                                SWIGLU=swiglu, NORM_CHUNKS=slices if norm is not None else 0,
                                RESIDUAL=residual is not None, ROPE_HALF=half)
    return out


def _check_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    check_tensor("x", x, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must be [..., K] with K={k}, the in-features of {what}")
    return x.reshape(-1, k) if x.stride(-1) == 1 else x.reshape(-1, k).contiguous()


def _gemv(x2: torch.Tensor, n: int, kernel, tuned, cpu_meta: dict, args: tuple, w_strides: tuple,
          meta: dict) -> torch.Tensor:
    """One row of ``x``: the split-K GEMV, autotuned on CUDA, with ``cpu_meta`` under the interpreter."""
    k = x2.shape[1]
    out = torch.empty(1, n, dtype=x2.dtype, device=x2.device)
    ws, cnt = _split_buffers(x2.device, n)
    ptrs = (x2, *args, out, ws, cnt, n, k, *w_strides)
    if x2.device.type == "cuda":
        tuned[lambda c: (triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])](*ptrs, **meta)
    else:
        if not 1 <= cpu_meta["SPLIT_K"] <= MAX_SPLIT_K:
            raise ValueError(f"SPLIT_K={cpu_meta['SPLIT_K']} must be in 1..{MAX_SPLIT_K}")
        even = {"EVEN": _even(dict(meta, **cpu_meta, N=n, K=k))} if "EVEN" in kernel.arg_names else {}
        kernel[(triton.cdiv(n, cpu_meta["BLOCK_N"]), cpu_meta["SPLIT_K"])](*ptrs, **meta, **cpu_meta, **even)
    return out


def _gemm(x2: torch.Tensor, n: int, gemm, gemm_tuned, args: tuple, w_strides: tuple,
          gemm_meta: dict, cpu_meta: dict | None = None) -> torch.Tensor:
    """More than one row of ``x``: the Tensor-Core GEMM (``cpu_meta``: the interpreter's tile, default
    ``CPU_GEMM``)."""
    m, k = x2.shape
    refuse_bf16_dot_on_cpu("x", x2)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    ptrs = (x2, *args, out, m, n, k, x2.stride(0), *w_strides, out.stride(0), next_pow2(m), next_pow2(n),
            next_pow2(k))
    meta = dict(gemm_meta, PRECISION="ieee" if x2.dtype == torch.float32 else "tf32")
    if x2.device.type == "cuda":
        gemm_tuned[lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)](*ptrs, **meta)
    else:
        tile = cpu_meta or CPU_GEMM
        grid = (triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
        gemm[grid](*ptrs, **meta, **tile)
    return out


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, swiglu: bool = False,
                 norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                 residual: torch.Tensor | None = None, pdl: str = "", stationary: bool | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` with the int8 weights dequantised in registers.

    ``x`` ``[..., K]`` float16/bfloat16/float32 (bfloat16 with more than one row needs CUDA); ``qweight`` int8
    ``[N, K]``; ``scale`` ``[N]`` (any float dtype). Returns ``[..., N]`` in ``x``'s dtype, accumulated in
    float32. One row of ``x`` takes the split-K GEMV, more rows the Tensor-Core GEMM. ``swiglu``,
    ``norm_weight``/``norm_eps``, ``residual`` and ``pdl``: a decoder layer's neighbours of the projection, as
    ``w4a16_matmul`` takes them; one 16-bit row with whole words does them inside the stationary int8 GEMV
    (``_w8_gemv_xs``), which a bare product takes only with ``XS8_PLAIN`` (until it is timed against the split-K
    GEMV on a GPU). ``stationary``: True takes the stationary GEMV wherever it applies, False never (neighbours
    then run as separate kernels), None as just described.
    """
    w, s = _check_int8_weights(qweight, scale)
    n, k = w.shape
    check_tensor("x", x, FLOAT_DTYPES, device=qweight.device)
    if stationary not in (None, True, False):
        raise ValueError(f"stationary={stationary!r}; allowed: None, True, False")
    fusing = swiglu or norm_weight is not None or residual is not None or bool(pdl)
    wanted = (fusing or XS8_PLAIN) if stationary is None else stationary
    return _with_neighbours(
        x, n, k, f"qweight {tuple(qweight.shape)}", swiglu, norm_weight, norm_eps, residual, pdl,
        tile=lambda rows, norm: _stationary_tile8(rows, n, k, w, norm, wanted),
        launch=lambda rows, tile, **kw: w8_gemv_xs(rows, w.view(torch.int32), s, tile, **kw),
        product=lambda x_: _w8a16_matmul(x_, w, s))


def _check_int8_weights(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Refuse int8 weights the kernels cannot read; returns them with contiguous rows and scales."""
    check_tensor("qweight", qweight, (torch.int8,), dim=2)
    check_tensor("scale", scale, FLOAT_DTYPES, dim=1, device=qweight.device)
    if scale.shape[0] != qweight.shape[0]:
        raise ValueError(f"scale {tuple(scale.shape)} must be [N] with N={qweight.shape[0]} from qweight "
                         f"{tuple(qweight.shape)}")
    return qweight if qweight.stride(-1) == 1 else qweight.contiguous(), scale.contiguous()


def _w8a16_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The product alone (checked arguments): the split-K GEMV for one row, the GEMM for more."""
    n, k = w.shape
    x2 = _check_x(x, k, f"qweight {tuple(w.shape)}")
    m = x2.shape[0]
    if m == 0 or n == 0:
        out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    elif m == 1:
        aligned = k % 4 == 0 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0
        out = _gemv(x2, n, _w8_gemv, _w8_gemv_tuned, CPU_GEMV8, (w.view(torch.uint8), s),
                    (w.stride(0), 0xFF, 0xFF00), {"WORDS_ALIGNED": aligned})
    else:
        out = _gemm(x2, n, _w8_gemm, _w8_gemm_tuned, (w, s), (w.stride(0),), {})
    return out.view(*x.shape[:-1], n)


def _stationary_tile8(x2: torch.Tensor, n: int, k: int, w: torch.Tensor, norm: bool, wanted: bool) -> dict | None:
    """The stationary int8 GEMV's tile for activation rows ``x2`` and int8 weights ``w``, or None where another
    kernel takes them: not ``wanted``, more than one row, float32 activations, or rows not whole 4-byte words."""
    if not wanted or x2.shape[0] != 1 or x2.dtype == torch.float32 or k % 4 or w.stride(0) % 4 or \
            w.data_ptr() % 4:
        return None
    return xs_tile(n, k, 4, x2.device, norm=norm, bits=8)


def _with_neighbours(x: torch.Tensor, n: int, k: int, what: str, swiglu: bool, norm_weight: torch.Tensor | None,
                     norm_eps: float, residual: torch.Tensor | None, pdl: str, tile, launch, product) -> torch.Tensor:
    """``[residual +] product(act(x))`` for a quantised projection of ``[N, K]`` weights (``what`` names them),
    ``act`` SwiGLU or an RMSNorm (``w4a16_matmul``'s arguments): inside the stationary GEMV where ``tile(rows,
    normed)`` gives one (``launch(rows, tile, **neighbours)``), else the separate kernels around ``product``."""
    width = 2 * k if swiglu else k
    if x.dim() == 0 or x.shape[-1] != width:
        shape = "[..., 2K] = [gate | up] with swiglu=True" if swiglu else "[..., K]"
        raise ValueError(f"x {tuple(x.shape)} must be {shape}, K={k} from {what}")
    norm = _check_norm(norm_weight, norm_eps, k, x, swiglu)
    res = _check_residual(residual, x, n)
    check_pdl(pdl)
    rows = x.reshape(-1, width)
    picked = tile(rows, norm is not None) if n else None
    if picked is not None:
        fused = dict(swiglu=swiglu or None, norm=norm, residual=None if res is None else res.reshape(1, n).contiguous(),
                     pdl=pdl or None)
        out = launch(rows.contiguous(), picked, **{key: val for key, val in fused.items() if val is not None})
        return out.view(*x.shape[:-1], n)
    if swiglu:
        from labkit.kernels.silu_and_mul import silu_and_mul

        x = silu_and_mul(x)
    if norm is not None:
        from labkit.kernels.rms_norm import rms_norm

        x = rms_norm(x, *norm)
    out = product(x)
    return out if res is None else out + res


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, swiglu: bool = False, norm_weight: torch.Tensor | None = None,
                 norm_eps: float = 1e-6, residual: torch.Tensor | None = None, pdl: str = "") -> torch.Tensor:
    """``x @ W.T`` with ``W = (q - zeros) * scales`` per group, unpacked from int4 in registers.

    ``x`` ``[..., K]`` float16/bfloat16/float32 (bfloat16 with more than one row needs CUDA); ``packed`` uint8
    ``[N, K // 2]`` (low nibble = even ``k``); ``scales``, ``zeros`` ``[N, K // group_size]`` (any float dtype);
    ``group_size`` an even divisor of ``K`` (powers of two from 8 to 1024 take the split-K GEMV at batch 1,
    other sizes a plain per-weight one). Returns ``[..., N]`` in ``x``'s dtype, accumulated in float32.

    What a decoder layer does around its projections can come in too; one 16-bit row on the stationary GEMV does
    it inside the kernel (no launch of its own, no round trip through memory), any other case with the separate
    kernels first (or last), as the model rounds:

    * ``swiglu``: ``x`` is ``[..., 2K]``, a merged gate/up projection's output ``[gate | up]``, and the product is
      ``silu_and_mul(x) @ W.T`` (an MLP's down projection), with the same bits as ``silu_and_mul`` first.
    * ``norm_weight`` ``[K]`` (and ``norm_eps``): the product is ``rms_norm(x, norm_weight, norm_eps) @ W.T``
      (the projections after a layer's RMSNorm), within a rounding of the separate kernel (the row statistic is
      summed in another order).
    * ``residual`` ``[..., N]`` in ``x``'s dtype: returns ``residual + x @ W.T``, the product rounded first (the
      o and down projections, which end in the residual add).

    ``pdl`` (``"release"``, ``"overlap"``; sm_90, the stationary GEMV only): programmatic dependent launch, so
    that a chain of GEMVs streams weights through each launch's tail (``pdl_meta``).
    """
    p, s, z = _check_int4_weights(packed, scales, zeros, group_size)
    n, k = p.shape[0], 2 * p.shape[1]
    check_tensor("x", x, FLOAT_DTYPES, device=packed.device)
    return _with_neighbours(
        x, n, k, f"packed {tuple(packed.shape)} (K = 2 * packed.shape[1])", swiglu, norm_weight, norm_eps,
        residual, pdl, tile=lambda rows, norm: _stationary_tile(rows, n, k, group_size, p, norm),
        launch=lambda rows, tile, **kw: w4_gemv_xs(rows, p.view(torch.int32), s, z, group_size, tile, **kw),
        product=lambda x_: _w4a16_matmul(x_, p, s, z, group_size))


def _check_int4_weights(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refuse int4 weights the kernels cannot read; returns them with contiguous rows, scales and zeros."""
    check_tensor("packed", packed, (torch.uint8,), dim=2)
    check_tensor("scales", scales, FLOAT_DTYPES, dim=2, device=packed.device)
    check_tensor("zeros", zeros, FLOAT_DTYPES, dim=2, device=packed.device)
    n, k = packed.shape[0], 2 * packed.shape[1]
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be an even integer dividing K={k} (e.g. 32, 64, 128)")
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must be "
                         f"[N, K // group_size] = [{n}, {k // group_size}]")
    return packed if packed.stride(-1) == 1 else packed.contiguous(), scales.contiguous(), zeros.contiguous()


def w4a16_qkv_rope_cache(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         norm_weight: torch.Tensor | None = None,
                         norm_eps: float = 1e-6, pdl: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """A merged q/k/v projection in int4, then RoPE on q and k and the paged-cache write of k and v: what
    ``labkit.kernels.rope.apply_rope_and_cache`` does to ``w4a16_matmul(x, ..., norm_weight=, norm_eps=)`` split
    into heads. ``x`` ``[T, K]``; ``packed`` ``[(num_heads + 2 * num_kv_heads) * head_dim, K // 2]`` with
    ``num_kv_heads`` and ``head_dim`` from ``k_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``cos``/``sin``, caches and ``slot_mapping`` as ``apply_rope_and_cache`` takes them. Returns ``(q_rot [T,
    num_heads, head_dim], k_rot [T, num_kv_heads, head_dim])``.

    One 16-bit row on a split stationary tile whose row blocks fit the heads does it in the GEMV: its programs
    walk each head's rows in rotary pairs (``_rope_rows``), and the last program of a row chunk rotates and stores
    them and writes the cache rows -- one launch for the projection, RoPE and the cache write. Anything else runs
    ``w4a16_matmul`` then ``apply_rope_and_cache``. ``pdl``: as ``w4a16_matmul`` takes it.
    """
    p, s, z = _check_int4_weights(packed, scales, zeros, group_size)
    check_tensor("x", x, FLOAT_DTYPES, device=packed.device)
    n, k = p.shape[0], 2 * p.shape[1]
    return _qkv_rope_cache(
        x, n, k, f"packed {tuple(packed.shape)}", num_heads, cos, sin, k_cache, v_cache, slot_mapping, norm_weight,
        norm_eps, pdl, tile=lambda rows: _stationary_tile(rows, n, k, group_size, p, norm=True),
        launch=lambda rows, tile, **kw: w4_gemv_xs(rows, p.view(torch.int32), s, z, group_size, tile, **kw),
        matmul=lambda **kw: w4a16_matmul(x, p, s, z, group_size, **kw))


def w8a16_qkv_rope_cache(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, num_heads: int,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                         pdl: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """``w4a16_qkv_rope_cache`` for a merged int8 q/k/v projection (``qweight`` int8 ``[(num_heads + 2 *
    num_kv_heads) * head_dim, K]``, ``scale`` ``[N]``): on one 16-bit row the stationary int8 GEMV rotates and
    caches in its store, else ``w8a16_matmul`` then ``apply_rope_and_cache``."""
    w, s = _check_int8_weights(qweight, scale)
    check_tensor("x", x, FLOAT_DTYPES, device=qweight.device)
    n, k = w.shape
    return _qkv_rope_cache(
        x, n, k, f"qweight {tuple(qweight.shape)}", num_heads, cos, sin, k_cache, v_cache, slot_mapping,
        norm_weight, norm_eps, pdl, tile=lambda rows: _stationary_tile8(rows, n, k, w, True, True),
        launch=lambda rows, tile, **kw: w8_gemv_xs(rows, w.view(torch.int32), s, tile, **kw),
        matmul=lambda **kw: w8a16_matmul(x, w, s, **kw))


def _qkv_rope_cache(x: torch.Tensor, n: int, k: int, what: str, num_heads: int, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    norm_weight: torch.Tensor | None, norm_eps: float, pdl: str, tile, launch,
                    matmul) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k/v projection, RoPE and the cache write of ``w4a16_qkv_rope_cache`` for weights of ``n`` rows
    (``what`` names them): in the stationary GEMV's store where ``tile(rows)`` gives a split tile that fits the
    heads (``launch(rows, tile, **neighbours)``), else ``matmul(norm_weight=, norm_eps=, pdl=)`` then
    ``apply_rope_and_cache``."""
    check_tensor("x", x, FLOAT_DTYPES, device=k_cache.device)
    check_tensor("k_cache", k_cache, FLOAT_DTYPES, dim=4)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not isinstance(num_heads, int) or num_heads < 1 or n != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"{what} must hold (num_heads={num_heads!r} + 2 * {kv_heads}) * {head_dim} rows: q, k "
                         f"and v of k_cache {tuple(k_cache.shape)}'s heads")
    rows = x.reshape(-1, k) if x.dim() and x.shape[-1] == k else None
    fused = _qkv_rope_tile(rows, tile, head_dim, (k_cache, v_cache), cos, sin, slot_mapping)
    if fused is None:
        from labkit.kernels.rope import apply_rope_and_cache

        qkv = matmul(norm_weight=norm_weight, norm_eps=norm_eps, pdl=pdl)
        q, kk, v = qkv.reshape(-1, n).split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        t = q.shape[0]
        return apply_rope_and_cache(q.view(t, num_heads, head_dim), kk.view(t, kv_heads, head_dim),
                                    v.view(t, kv_heads, head_dim), cos, sin, k_cache, v_cache, slot_mapping)
    norm = _check_norm(norm_weight, norm_eps, k, x, False)
    check_pdl(pdl)
    rope = dict(cos=cos.reshape(-1), sin=sin.reshape(-1), slot=slot_mapping.reshape(1), k_cache=k_cache,
                v_cache=v_cache, num_heads=num_heads)  # the kernel reads the tables' first head_dim / 2 values
    out = launch(rows.contiguous(), fused, rope=rope, **({"norm": norm} if norm is not None else {}),
                 **({"pdl": pdl} if pdl else {}))
    q_rows = num_heads * head_dim
    return (out[:, :q_rows].view(1, num_heads, head_dim),
            out[:, q_rows:q_rows + kv_heads * head_dim].view(1, kv_heads, head_dim))


def _qkv_rope_tile(rows: torch.Tensor | None, tile, head_dim: int, caches: tuple, cos: torch.Tensor,
                   sin: torch.Tensor, slot_mapping: torch.Tensor) -> dict | None:
    """The split stationary tile (``tile(rows)``, as a normed GEMV takes it) for ``_qkv_rope_cache``'s fused path,
    or None where it does not apply (more than one row, float32, row blocks that do not fit the heads, caches not
    of ``rows``' dtype and layout, tables or slots not of one token)."""
    if rows is None or rows.shape[0] != 1 or head_dim % 2:
        return None
    if any(c.dtype != rows.dtype or not c.is_contiguous() or c.device != rows.device or c.shape != caches[0].shape
           for c in caches):
        return None
    if any(t.numel() not in (head_dim // 2, head_dim) or t.device != rows.device for t in (cos, sin)) or \
            slot_mapping.numel() != 1 or slot_mapping.dtype.is_floating_point:
        return None
    picked = tile(rows)
    if picked is None or picked["SPLIT_P2"] == 1 or picked["BLOCK_N"] % 2 or head_dim % picked["BLOCK_N"] or \
            picked["RED_ROWS"] % picked["BLOCK_N"]:
        return None
    return picked


def _check_norm(weight: torch.Tensor | None, eps: float, k: int, x: torch.Tensor,
                swiglu: bool) -> tuple[torch.Tensor, float] | None:
    if weight is None:
        return None
    if swiglu:
        raise ValueError("norm_weight and swiglu=True cannot be combined: an RMSNorm precedes the q/k/v and "
                         "gate/up projections, SwiGLU the down projection")
    check_tensor("norm_weight", weight, FLOAT_DTYPES, dim=1, device=x.device)
    if weight.shape[0] != k:
        raise ValueError(f"norm_weight {tuple(weight.shape)} must be [K] = [{k}]")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"norm_eps={eps!r} must be a non-negative float")
    return weight.contiguous(), float(eps)


def _check_residual(residual: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor | None:
    if residual is None:
        return None
    check_tensor("residual", residual, (x.dtype,), device=x.device)
    if tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"residual {tuple(residual.shape)} must be the output's shape {(*x.shape[:-1], n)}")
    return residual


def _w4a16_matmul(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, z: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """The product alone (checked arguments): the stationary or split-K GEMV for one row, the GEMM for more."""
    n, k = p.shape[0], 2 * p.shape[1]
    x2 = _check_x(x, k, f"packed {tuple(p.shape)} (K = 2 * packed.shape[1])")
    args, strides = (p, s, z), (p.stride(0), s.stride(0), z.stride(0))
    m = x2.shape[0]
    if m == 0 or n == 0:
        out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    elif m == 1 and _word_gemv(group_size, p):
        words = p.view(torch.int32)  # K % 8 == 0 here: whole 4-byte words per row
        half = 0 if x2.dtype == torch.float32 else (1 if x2.device.type == "cuda" else 2)
        tile = _stationary_tile(x2, n, k, group_size, p)
        if tile is not None:
            return w4_gemv_xs(x2, words, s, z, group_size, tile).view(*x.shape[:-1], n)
        cpu = dict(CPU_GEMV4, BLOCK_K=max(CPU_GEMV4["BLOCK_K"], group_size))
        out = _gemv(x2, n, _w4_gemv, _w4_gemv_tuned, cpu, (words, s, z), (words.stride(0), s.stride(0), z.stride(0),
                    0x4F000000), {"GROUP": group_size, "HALF_MATH": half})
    elif m == 1:
        out = torch.empty(1, n, dtype=x2.dtype, device=x2.device)
        meta = dict(ANY_GROUP_GEMV)
        _w4_gemv_any_group[(triton.cdiv(n, meta["BLOCK_N"]),)](x2, *args, out, n, k, *strides, GROUP=group_size,
                                                              **meta)
    elif group_size >= 16 and group_size & (group_size - 1) == 0:
        out = _gemm(x2, n, _w4_gemm_grouped, _w4_gemm_grouped_tuned, args, strides, {"GROUP": group_size},
                    cpu_meta=dict(CPU_GEMM, BLOCK_K=min(CPU_GEMM["BLOCK_K"], group_size)))
    else:
        out = _gemm(x2, n, _w4_gemm, _w4_gemm_tuned, args, strides, {"GROUP": group_size})
    return out.view(*x.shape[:-1], n)


def _word_gemv(group_size: int, p: torch.Tensor) -> bool:
    """Whether the int4 GEMVs that read int32 words take these weights: power-of-two groups of 8-1024, rows on
    4-byte boundaries."""
    return 8 <= group_size <= 1024 and group_size & (group_size - 1) == 0 and p.data_ptr() % 4 == 0


def _stationary_tile(x2: torch.Tensor, n: int, k: int, group_size: int, p: torch.Tensor,
                     norm: bool = False) -> dict | None:
    """The stationary GEMV's tile (``xs_tile``) for activation rows ``x2`` and packed weights ``p``, or None where
    another kernel takes them: more than one row, float32 activations, or groups or rows it cannot read as words."""
    if x2.shape[0] != 1 or x2.dtype == torch.float32 or not _word_gemv(group_size, p):
        return None
    return xs_tile(n, k, group_size, x2.device, norm=norm)
