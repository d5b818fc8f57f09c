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
    tokens 50 .. 99 (N = 50), token 50 in word 1, bit 18. A last block's padding rows (ids past the
    words) read the last word: the argmax leaves them out anyway (parallel/vocab.py)."""
    n, words = logits.shape[-1], bits.shape[-1]
    ids = torch.arange(first, first + n, dtype=torch.int32, device=logits.device)
    word = bits.index_select(-1, (ids >> 5).clamp(max=words - 1))  # [B, T, N]: each token's word
    allowed = (word >> (ids & 31)) & 1  # an arithmetic shift: bit 31 reads as 1 or 0 alike after the & 1
    return logits.masked_fill(allowed == 0, float("-inf"))
