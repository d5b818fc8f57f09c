"""The paged KV layout every attention path reads: blocks of BLOCK positions through block tables.

Each layer keeps keys and values as [num_blocks, kv_heads, BLOCK, head_dim]; a sequence's position p sits
in block table[p // BLOCK] at row p % BLOCK (BLOCK = 16: position 37 is row 5 of the table's third
block). A forward takes its rows' block tables ([B, blocks per sequence] int32): writes and reads go
through them, so which blocks a sequence holds is the scheduler's choice (engine/blocks.py).
"""

from __future__ import annotations

import torch

BLOCK = 16  # token positions per block


def kv_bucket(tokens_needed: int, limit: int) -> int:
    """A power-of-two bucket (>= 64) of keys for `tokens_needed` positions: 70 -> 128, 129 -> 256, capped
    at limit."""
    bucket = 64
    while bucket < tokens_needed:
        bucket *= 2
    return min(bucket, limit)


def gather_blocks(
    store: torch.Tensor,  # [num_blocks, kv_heads, BLOCK, head_dim]
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
) -> torch.Tensor:  # [B, kv_heads, kv_len, head_dim]: positions 0 .. kv_len - 1 of each row
    """Each row's first kv_len positions, contiguous: kv_len 40 reads blocks table[:, 0:3] and keeps 40 of
    their 48 rows; kv_len 48 reads table[:, 0:4]."""
    # kv_len // BLOCK + 1 blocks, one more than needed when BLOCK divides kv_len: n >= 2 for every
    # kv_len >= 16, so torch.compile never specializes a graph on n == 1 (a size-1 dimension)
    used = tables[:, : kv_len // BLOCK + 1]  # [B, n]
    b, n = used.shape
    blocks = store[used]  # [B, n, kv_heads, BLOCK, head_dim]
    return blocks.transpose(1, 2).reshape(b, store.shape[1], n * BLOCK, store.shape[3])[:, :, :kv_len]
