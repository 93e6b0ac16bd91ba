# %% [markdown]
# ## Exercises
#
# Write two of this notebook's kernels yourself, in the style of Triton-Puzzles. The check launches your kernel on
# irregular sizes (rows and lengths that are not powers of two), with the output filled with NaN first, and
# compares with labkit's kernel: it prints how many elements differ, where, and the largest error (an element that
# stays NaN was never written). On a CPU the kernels run through Triton's interpreter, in seconds.
# `python -m labkit exercises` lists your progress.
#
# ### Exercise 03.rms_norm (25 minutes)
# One program per row of `x` `[n_rows, n_cols]` (contiguous, float32): load the row, compute
# `out = x / sqrt(mean(x^2) + eps) * w` with the mean over the `n_cols` real columns, store it. `BLOCK` is the next
# power of two at or above `n_cols`, so mask the columns past `n_cols` on every load and store.
#
# Useful: `tl.program_id(0)`, `tl.arange(0, BLOCK)`, `tl.load(ptr + offsets, mask=..., other=0.0)`,
# `tl.sum(v, axis=0)`, `tl.sqrt`, `tl.store(ptr + offsets, v, mask=...)`.

# %%
import labkit  # noqa: F401  (sets TRITON_INTERPRET=1 on a CPU-only machine, before triton is imported)
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    # TODO: load the row (masked), its mean square, normalise, multiply by w, store (masked)
    raise NotImplementedError("fill in rms_norm_kernel")


# %%
from labkit.exercises import check

check("03.rms_norm", rms_norm_kernel)

# %% [markdown]
# ### Exercise 03.silu_and_mul (15 minutes)
# SwiGLU's activation, elementwise over `n_elements` values: `out = silu(gate) * up`, with
# `silu(g) = g * sigmoid(g) = g / (1 + exp(-g))`. The grid has `ceil(n_elements / BLOCK)` programs; program `p`
# handles elements `p * BLOCK .. p * BLOCK + BLOCK - 1` of the flattened tensors, and the last block is partial.

# %%
@triton.jit
def silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    # TODO: offsets of this block, a mask, load gate and up, compute, store
    raise NotImplementedError("fill in silu_and_mul_kernel")


# %%
check("03.silu_and_mul", silu_and_mul_kernel)

# %% [markdown]
# ### Exercise 03.softmax (20 minutes)
# Softmax over each row of `x` `[n_rows, n_cols]` (contiguous, float32), one program per row, `BLOCK` the next
# power of two at or above `n_cols`. Two traps the check looks for: the padding columns past `n_cols` must not
# count in the sum (what should a masked load return for them?), and some rows hold large values: `exp` of them
# overflows unless you subtract the row's maximum first.

# %%
@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    # TODO: load the row (masked), subtract its maximum, exp, divide by the sum, store (masked)
    raise NotImplementedError("fill in softmax_kernel")


# %%
check("03.softmax", softmax_kernel)

# %% [markdown]
# ### Exercise 03.int8_kv_speedup (predict, then measure; 15 minutes)
# Decode attention reads the whole KV cache once per step, so an int8 cache should be about twice as fast as a bf16
# one. Predict exactly how much, from bytes: write `int8_kv_attention(seqs, heads, kv_heads, head_dim, context,
# scale_bytes=4)` returning `{"bf16_bytes", "int8_bytes", "speedup"}` for one step:
#
# * K and V each hold `seqs x context x kv_heads x head_dim` elements: 2 bytes each in bf16, 1 in int8;
# * int8 adds one scale of `scale_bytes` per token and KV head, for K and for V;
# * both read the bf16 query and write the bf16 output, `seqs x heads x head_dim` elements each;
# * `speedup = bf16_bytes / int8_bytes`: what a kernel that stays bandwidth-bound would gain.
#
# The check then compares your prediction with the measured int8-in-kernel speed-up at the GPU shape (this run's,
# under the `gpu` profile; otherwise the committed H200 record) and prints how fast each kernel read its bytes.
# Decide before running it: what would it mean if the measurement fell far short of the bytes?

# %%
def int8_kv_attention(seqs, heads, kv_heads, head_dim, context, scale_bytes=4):
    # TODO: bytes of each cache format, plus the query and the output
    raise NotImplementedError("fill in int8_kv_attention")


# %%
check("03.int8_kv_speedup", int8_kv_attention)
