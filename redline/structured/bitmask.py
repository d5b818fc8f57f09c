"""Token bitmasks on the device: a structured-output row's allowed tokens as int32 words, applied to its
logits inside the step (a pure tensor function: it compiles into the step's graph).

Bit t % 32 of word t // 32 allows token t (xgrammar's layout). Token 37 lives in word 1, bit 5: a word
1 of 0b100000 (32) allows token 37 alone among 32 .. 63. Rows without a grammar hold -1 (every bit set):
their logits pass unchanged.
"""

from __future__ import annotations

import torch

ALL_ALLOWED = -1  # an int32 word with every bit set


def allowed_logits(
    logits: torch.Tensor,  # [B, T, N] fp32: tokens first .. first + N - 1
    bits: torch.Tensor,  # [B, T, W] int32, W = ceil(V / 32)
    first: int = 0,  # a tensor-parallel rank's block of the vocabulary starts here
) -> torch.Tensor:  # [B, T, N] fp32, -inf where a token's bit is 0
    """The whole vocabulary (first 0, N = V) or one rank's block of it: rank 1 of 2 over 100 tokens holds
    tokens 50 .. 99 (N = 50): words 1 .. 3 cover them, token 50 is bit 18 of word 1. Each covering word's
    32 bits are spread along a new last dimension and flattened (no gather: the cheapest form once
    compiled); a last block's padding rows (past the words) read as allowed: the argmax leaves them out
    anyway (parallel/vocab.py)."""
    n, words = logits.shape[-1], bits.shape[-1]
    low, high = first // 32, min(-(-(first + n) // 32), words)  # the words covering the block
    bit = torch.arange(32, dtype=torch.int32, device=logits.device)
    spread = ((bits[..., low:high, None] >> bit) & 1).flatten(-2)  # [B, T, 32 (high - low)], an
    # arithmetic shift: bit 31 reads as 1 or 0 alike after the & 1
    allowed = spread[..., first - 32 * low :][..., :n]
    allowed = torch.nn.functional.pad(allowed, (0, n - allowed.shape[-1]), value=1)
    return logits.masked_fill(allowed == 0, float("-inf"))
