"""The target's prefill forward through torch.compile, with the prompt length a dynamic dimension.

A prompt of n tokens runs padded to L = padded_prompt_len(n): a multiple of 16 (at least 16, at most
the cache length), so lengths 0 and 1, which dynamo would specialize on, never reach the graph. The
length is marked dynamic, so one graph serves every L; a model whose forward branches on the token
count (a Llama 4 MoE layer takes its few-token path up to num_experts / top_k tokens:
LlamaForCausalLM.token_count_branches) gets one graph per side of that branch. ModelRunner.warm_up
compiles them all at start-up (warm_up_lengths). After `freeze()` a length that would still compile
(a branch no model declared) runs the same forward eagerly, with a warning, instead of failing.

The padding is harmless by the cache's own rule (layers/attention.py): the padded tokens take
positions n .. L - 1, each real query attends only keys at or before its position, and every cache
position >= n is written again (by the decode step, before any query reads it).
Example: n = 20 -> L = 32; tokens [t0 .. t19, 0 x 12] at positions 0 .. 31; hidden[:, :20] is kept.

The slot enters as its block table (a [1, blocks] tensor, engine/kv_cache.py), so one graph serves
every slot.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from redline.engine.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM

ALIGN = 16


def padded_prompt_len(n: int, cache_len: int) -> int:
    """5 -> 16, 20 -> 32, 33 -> 48; capped at cache_len (n <= cache_len)."""
    return min(max(ALIGN, -(-n // ALIGN) * ALIGN), cache_len)


def warm_up_lengths(cache_len: int, branches: Iterable[int] = ()) -> list[int]:
    """Padded lengths that compile every prefill graph: 16 (the first call compiles the dynamic graph),
    32 (a second length: nothing specialized on the first), and for each token count t at which the
    forward branches (it takes one path up to t tokens, another above), the longest padded length up
    to t and the shortest above it, within the cache: t = 128 -> 128 and 144; t = 8 -> only 16 (no
    padded length is <= 8). Long prompts are not run: a 4,097-token warm-up prompt cost SmolLM2 5 s."""
    lengths = {min(ALIGN, cache_len), min(2 * ALIGN, cache_len)}
    for t in branches:
        if t >= ALIGN:
            lengths.add(min(t // ALIGN * ALIGN, cache_len))
        lengths.add(padded_prompt_len(t + 1, cache_len))
    return sorted(lengths)


class CompiledPrefill:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache):
        self.model, self.cache = model, cache
        self.compiled = torch.compile(self._forward, fullgraph=True, dynamic=False)
        self.frozen = False

    def _forward(
        self, tokens: torch.Tensor, tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)[None]
        return self.model(tokens, positions, self.cache.layers, tables, length)

    def freeze(self) -> None:
        """From now on a call that would compile raises instead."""
        self.frozen = True

    def __call__(
        self,
        tokens: torch.Tensor,  # [1, n] prompt ids
        slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's (hidden [1, n, H], aux [1, n, A] or None) for the prompt, its keys and values
        written into `slot` at positions 0 .. n - 1 (and padding beyond)."""
        n = tokens.shape[1]
        padded = F.pad(tokens, (0, padded_prompt_len(n, self.cache.max_len) - n))  # [1, L], token 0
        # maybe_: a forward may branch on the length (a Llama 4 MoE layer's few-token path while n * top_k
        # <= experts), which narrows the range; each side then gets its own graph (warm_up_lengths visits
        # both), where mark_dynamic(min=16) would raise ConstraintViolationError
        torch._dynamo.maybe_mark_dynamic(padded, 1)
        try:
            with torch.compiler.set_stance("fail_on_recompile" if self.frozen else "default"):
                hidden, aux = self.compiled(padded, self.cache.tables(slot, 1))
        except RuntimeError as error:  # torch raises a plain RuntimeError for the stance
            if not (self.frozen and "fail_on_recompile" in str(error)):
                raise
            length = padded.shape[1]
            message = f"a {length}-token prefill needs a graph the warm-up did not compile; it runs eagerly"
            warnings.warn(message, stacklevel=2)
            hidden, aux = self._forward(padded, self.cache.tables(slot, 1))
        return hidden[:, :n], None if aux is None else aux[:, :n]
