# %% [markdown]
# ## Exercises
#
# Fill in each skeleton and run the check cell after it: it prints which cases passed and, for the first that failed,
# the step where your code and labkit's differ. Block ids may differ from labkit's: only which blocks are shared
# by which sequences, the free count and the copies are compared. `python -m labkit exercises` lists your progress.
#
# ### Exercise 02.allocator (20 minutes)
# Write the block allocator of a paged KV cache: `num_blocks` blocks with ids `0 .. num_blocks - 1` and a
# reference count each.
#
# * `allocate(n)`: take `n` free blocks and return their ids (a list); each now has one reference. If fewer than
#   `n` are free, raise `CacheFullError` (imported below) and change nothing.
# * `incref(block)`: one more sequence shares an in-use block (fork). Raise `ValueError` if the block is free.
# * `free(block)`: drop one reference; the last one returns the block to the free list. Raise `ValueError` on a
#   free block (a double free).
# * `num_free`: how many blocks are free.

# %%
from labkit.kvcache import CacheFullError


class MyAllocator:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        # TODO: the free blocks, and a reference count per block

    def allocate(self, n):
        raise NotImplementedError("fill in allocate")

    def incref(self, block):
        raise NotImplementedError("fill in incref")

    def free(self, block):
        raise NotImplementedError("fill in free")

    @property
    def num_free(self):
        raise NotImplementedError("fill in num_free")


# %%
from labkit.exercises import check

check("02.allocator", MyAllocator)

# %% [markdown]
# ### Exercise 02.cow (25 minutes)
# Now the block tables on top of an allocator (use labkit's `BlockAllocator`, which passed the check above, or your
# own). A sequence of `n` tokens holds `ceil(n / block_size)` blocks, listed in its block table.
#
# * `allocate(seq_id, num_tokens)`: a new sequence with room for its prompt (all blocks or `CacheFullError`).
# * `append(seq_id)`: room for one more token. If the last block is full, take a new block. If the last block is
#   partly full *and shared* with another sequence (after a fork), first copy it to a private block: take a
#   block, record the copy with `self.copies.append((src, dst))`, drop the reference to the shared one, and put the
#   private block in the table (copy on write). Check that the blocks it needs are free before changing anything.
# * `fork(parent_id, child_id)`: the child shares every block of the parent (one more reference each) and has the
#   same length.
# * `free(seq_id)`: drop the sequence's reference to each of its blocks.
# * `block_table(seq_id)` returns the list of block ids; `num_free` the free blocks. An unknown `seq_id` raises
#   `KeyError`.

# %%
from labkit.kvcache.block_allocator import BlockAllocator


class MyBlockTables:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables = {}   # seq_id -> list of block ids
        self.lengths = {}  # seq_id -> number of tokens
        self.copies = []   # (src, dst) of every copy on write

    def allocate(self, seq_id, num_tokens):
        raise NotImplementedError("fill in allocate")

    def append(self, seq_id):
        raise NotImplementedError("fill in append")

    def fork(self, parent_id, child_id):
        raise NotImplementedError("fill in fork")

    def free(self, seq_id):
        raise NotImplementedError("fill in free")

    def block_table(self, seq_id):
        return self.tables[seq_id]

    @property
    def num_free(self):
        return self.allocator.num_free


# %%
check("02.cow", MyBlockTables)

# %% [markdown]
# ### Exercise 02.paged_capacity (predict, then measure; 20 minutes)
# The simulation above ran a request mix through the same KV memory twice: contiguous slabs and paged blocks.
# Predict the ratio before reading it: write `paged_capacity(prompt_lens, output_lens, budget_tokens, slab_tokens,
# block_size)` returning `{"contiguous_seqs", "paged_seqs", "ratio"}`:
#
# * contiguous: every running sequence holds a slab of `slab_tokens`, so `budget_tokens // slab_tokens` run at once;
# * paged: a request with prompt `p` and output `o` decodes for `o` steps; at its step `t` (1 to `o`) it holds
#   `p + t` token slots, rounded up to whole blocks of `block_size`. Average what a running sequence holds **over
#   steps** (every step of every request counts once: sum the slots held at each step, divide by the number of
#   steps, `sum(output_lens)`), then `paged_seqs = budget_tokens / that average`;
# * `ratio = paged_seqs / contiguous_seqs`.
#
# Why over steps and not over requests? The check prints what the per-request average would have predicted, beside
# the simulation's measured ratio.

# %%
def paged_capacity(prompt_lens, output_lens, budget_tokens, slab_tokens, block_size):
    # TODO: slabs; then the step-weighted average of the slots a running sequence holds
    raise NotImplementedError("fill in paged_capacity")


# %%
check("02.paged_capacity", paged_capacity)
