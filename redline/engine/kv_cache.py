"""Preallocated KV cache: one slot per sequence, indexed by absolute position."""

import torch

from redline.config import ModelConfig

# Positions stored past max_len, never attended: a forward attends a slice [:kv_len], kv_len <= max_len, so
# the slice is never the whole dimension. A whole-dimension slice is contiguous where the others are not, and
# the compiled step and prefill (whose kv_len is a dynamic dimension) would specialize a second graph on it.
UNATTENDED_TAIL = 1


class KVCache:
    def __init__(
        self, config: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device
    ):
        self.slots, self.max_len = slots, max_len
        shape = (slots, config.num_kv_heads, max_len + UNATTENDED_TAIL, config.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def kv_len_for(self, tokens_needed: int) -> int:
        """Keys to attend for a forward reaching `tokens_needed` positions: a power-of-two bucket (>= 64),
        so CUDA graphs see few distinct shapes. 70 -> 128, 129 -> 256, capped at max_len."""
        bucket = 64
        while bucket < tokens_needed:
            bucket *= 2
        return min(bucket, self.max_len)
