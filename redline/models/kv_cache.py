"""The KV cache's device tensors: per layer, keys and values in blocks (kernels/paged_kv.py), and the
block table of every slot.

With num_blocks (the engine: a pool sized from a KV budget) the last block is a scratch block: every
table entry starts pointing at it, so the writes of free rows (and of rows still prefilling, in a decode
step) land where nobody reads; the runner writes each slot's row of the table from the step plan
(runner/plan.py), and the scheduler decides which blocks those are. Without it each slot owns a fixed run
of blocks: slot s holds blocks [s M, (s + 1) M), M = max_len // BLOCK + 1 (models driven directly).
"""

from __future__ import annotations

import torch

from redline.config import ModelConfig
from redline.kernels.paged_kv import BLOCK
from redline.models.huge_pages import huge_page_zeros


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        max_len: int,  # positions one sequence may reach: the table has max_len // BLOCK + 1 entries
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,  # blocks of the pool plus the scratch block; None: fixed runs
        layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,  # another cache's, shared (no copy)
    ):
        self.slots, self.max_len = slots, max_len
        per_slot = max_len // BLOCK + 1  # what gather_blocks reads at kv_len = max_len
        shape = (num_blocks or slots * per_slot, config.num_kv_heads, BLOCK, config.head_dim)
        if layers is None:  # a CPU decode step streams the cache as it streams the weights: huge pages too
            layers = [
                (huge_page_zeros(shape, dtype, device), huge_page_zeros(shape, dtype, device))
                for _ in range(config.num_layers)
            ]
        self.layers = layers
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
