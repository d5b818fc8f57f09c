"""The target's prefill forward through torch.compile, at a few bucketed prompt lengths.

A prompt of n tokens runs padded to L = prompt_bucket(n): the next power of two >= 16, at most the
cache length. So one graph serves every prompt length in (L / 2, L], and a server meets about
log2(max_len) of them. The padding is harmless by the cache's own rule (layers/attention.py): the
padded tokens take positions n .. L - 1, each real query attends only keys at or before its position,
and every cache position >= n is written again (by the decode step, before any query reads it).
Example: n = 20 -> L = 32; tokens [t0 .. t19, 0 x 12] at positions 0 .. 31; hidden[:, :20] is kept.

The slot is not a graph input: each slot has its own views of the cache, `k[s : s + 1]`, which the
graph sees at slot 0. Views of different slots share shapes and strides, so one graph serves them all,
and the cache writes land in the real cache through the views.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from redline.engine.kv_cache import KVCache
from redline.models.llama import KVLayer, LlamaForCausalLM

MIN_BUCKET = 16


def prompt_bucket(n: int, cache_len: int) -> int:
    """Padded prompt length: 5 -> 16, 20 -> 32, 33 -> 64; capped at cache_len (n <= cache_len)."""
    bucket = MIN_BUCKET
    while bucket < n:
        bucket *= 2
    return min(bucket, cache_len)


class CompiledPrefill:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache):
        self.model, self.cache = model, cache
        self.slot_views: list[list[KVLayer]] = [
            [(k[s : s + 1], v[s : s + 1]) for k, v in cache.layers] for s in range(cache.slots)
        ]
        self.compiled = torch.compile(self._forward, fullgraph=True, dynamic=False)

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: list[KVLayer], kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(tokens, positions, cache, 0, kv_len)

    def __call__(
        self,
        tokens: torch.Tensor,  # [1, n] prompt ids
        slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's (hidden [1, n, H], aux [1, n, A] or None) for the prompt, its keys and values
        written into `slot`. One graph per padded length (its kv bucket follows from it)."""
        n = tokens.shape[1]
        padded_len = prompt_bucket(n, self.cache.max_len)
        padded = F.pad(tokens, (0, padded_len - n))  # [1, L], padded with token 0
        positions = torch.arange(padded_len, device=tokens.device)[None]
        kv_len = self.cache.kv_len_for(padded_len)
        hidden, aux = self.compiled(padded, positions, self.slot_views[slot], kv_len)
        return hidden[:, :n], None if aux is None else aux[:, :n]
