"""KV cache in fixed-size blocks, addressed through block tables.

Each layer keeps keys and values as [num_blocks, kv_heads, BLOCK, head_dim]; a sequence's position p sits
in block table[p // BLOCK] at row p % BLOCK (BLOCK = 16: position 37 is row 5 of the table's third
block). Every forward takes its rows' block tables ([B, blocks per sequence] int32) instead of slot
numbers: writes and reads go through them, so which blocks a sequence holds is the caller's choice.
Without num_blocks each slot owns a fixed run of blocks: slot s holds blocks [s M, (s + 1) M),
M = max_len // BLOCK + 1. With it (the engine's runner: a pool sized from a KV budget) the last block is
a scratch block, every table entry starts pointing at it (free rows' writes land nowhere anyone reads),
and the runner fills each slot's row from its block pool (engine/blocks.py).
"""

import torch

from redline.config import ModelConfig

BLOCK = 16  # token positions per block


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,  # None: a fixed run of blocks per slot
    ):
        self.slots, self.max_len = slots, max_len
        per_slot = max_len // BLOCK + 1  # what gather_blocks reads at kv_len = max_len
        shape = (num_blocks or slots * per_slot, config.num_kv_heads, BLOCK, config.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        if num_blocks is None:  # slot s -> its blocks, e.g. 2 slots of 3 blocks: [[0, 1, 2], [3, 4, 5]]
            self.table = torch.arange(slots * per_slot, dtype=torch.int32, device=device).view(slots, -1)
        else:
            self.scratch_block = num_blocks - 1
            self.table = torch.full((slots, per_slot), num_blocks - 1, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def tables(self, first_slot: int, rows: int) -> torch.Tensor:  # [rows, blocks per slot] int32
        """The block tables of slots first_slot .. first_slot + rows - 1."""
        return self.table[first_slot : first_slot + rows]

    def kv_len_for(self, tokens_needed: int) -> int:
        """Keys to attend for a forward reaching `tokens_needed` positions (kv_bucket), so CUDA graphs see
        few distinct shapes."""
        return kv_bucket(tokens_needed, self.max_len)


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
