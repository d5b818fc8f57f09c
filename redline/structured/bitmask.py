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
    logits: torch.Tensor,  # [B, T, V] fp32
    bits: torch.Tensor,  # [B, T, W] int32, W = ceil(V / 32)
) -> torch.Tensor:  # [B, T, V] fp32, -inf where a token's bit is 0
    vocab = logits.shape[-1]
    word = bits.repeat_interleave(32, dim=-1)[..., :vocab]  # [B, T, V]: each token's word
    shift = torch.arange(vocab, dtype=torch.int32, device=logits.device) & 31  # int32 throughout
    allowed = (word >> shift) & 1  # an arithmetic shift: bit 31 reads as 1 or 0 alike after the & 1
    return logits.masked_fill(allowed == 0, float("-inf"))
