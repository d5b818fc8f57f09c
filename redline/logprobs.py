"""Log-probabilities of emitted tokens, computed on the device inside the step and read with its output.

The step returns one int64 tensor to the host. With the logits path it appends, per emitted position, the
target's log-probability of the emitted token and its MAX_LOGPROBS most likely tokens: floats travel as
their fp32 bits (sign-extended into int64), ids as they are, so the host still reads one tensor per step.
Values are the model's raw log-probabilities (log_softmax of the logits, before temperature, penalties
and filters), as vLLM reports by default; a verified position's logits are the ones plain decoding
computes, so the values do not depend on speculation.

Layout per position, W = 1 + 2 * top values: [chosen, top logprobs (top of them), top ids (top of them)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.sampling import MAX_LOGPROBS

FLOOR = -9999.0  # in place of -inf (JSON has no infinities), as vLLM reports it


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely tokens and their log-probabilities, most likely first


def top_count(vocab: int) -> int:
    return min(MAX_LOGPROBS, vocab)


def width(vocab: int) -> int:
    """Packed values per position."""
    return 1 + 2 * top_count(vocab)


def pack(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V], tokens [B, T] -> [B, T * width] int64 (the layout above)."""
    logp = logits.float().log_softmax(dim=-1).clamp_min(FLOOR)
    chosen = logp.gather(-1, tokens[..., None])  # [B, T, 1]
    top_logp, top_ids = logp.topk(top_count(logits.shape[-1]), dim=-1)  # [B, T, top]
    bits = torch.cat((chosen, top_logp), dim=-1).view(torch.int32).to(torch.int64)
    return torch.cat((bits, top_ids), dim=-1).flatten(1)


def unpack(packed: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
    """One row's packed values [T, width] int64 (on the host) and its first len(tokens) tokens -> their
    logprobs with the top n alternatives."""
    top = (packed.shape[1] - 1) // 2
    rows = packed[: len(tokens)]
    floats = rows[:, : 1 + top].to(torch.int32).view(torch.float32).tolist()
    ids = rows[:, 1 + top : 1 + top + n].tolist()
    return [
        TokenLogprob(token, f[0], list(zip(i, f[1 : 1 + n], strict=True)))
        for token, f, i in zip(tokens, floats, ids, strict=True)
    ]
