"""A token tree's mask inside the Triton attention kernels (decode_attention.py, prefill_attention.py): the
function attention_core.tree_visible computes, over its 63 slots (draft_tree.TREE_SLOTS)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tree_seen(n, tree_base, tree_bits, chunk):
    """n [BLOCK_N] key positions, tree_base the tree's first slot, tree_bits [BLOCK_M] int64 ancestor bits
    of the tile's rows, chunk Llama 4's (0: none) -> [BLOCK_M, BLOCK_N] bool: every key before the base
    (from the start of the root's chunk), then the slots base + j whose bit j is set. Base 40, bits 0b101:
    keys 0..39, 40 and 42; chunk 32: keys 32..39, 40 and 42."""
    past_base = n[None, :] - tree_base  # [1, BLOCK_N]
    bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(past_base, 0), 62).to(tl.int64)) & 1
    seen = (past_base < 0) | ((past_base < 63) & (bit == 1))
    return seen & (n[None, :] >= tree_lowest(tree_base, chunk))


@triton.jit
def tree_lowest(tree_base, chunk):
    """The first key a tree's rows see: the start of its root's chunk, or 0 without chunks. Base 40: chunk
    32 -> 32, chunk 0 -> 0."""
    return tl.where(chunk > 0, tree_base - tree_base % tl.maximum(chunk, 1), 0)
