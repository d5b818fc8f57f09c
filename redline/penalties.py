"""Presence, frequency and repetition penalties on the device, per slot, as vLLM and HF apply them.

Each slot keeps counts [V] of the tokens its request has generated and a mask seen [V] of its prompt's
tokens (runner/slots.py sets them when the request is admitted; every step with the logits path adds its
emitted tokens). A logit l of token t becomes

    l' = (l / r if l > 0 else l * r)  if t is in the prompt or was generated   (repetition r)
    l'' = l' - frequency * counts[t] - presence * (counts[t] > 0)

before temperature and the top-k / top-p / min-p filters. In a speculative step the row after draft j
counts drafts 1 .. j as generated (they are, if accepted), so each verified position sees exactly the
context plain decoding would, and speculation stays lossless; the draft's proposals are penalized alike.
"""

from __future__ import annotations

import torch

from redline.sampling import SamplingTensors


def penalize(
    logits: torch.Tensor,  # [B, T, V] fp32
    t: SamplingTensors,  # rows B
    counts: torch.Tensor,  # [B, T, V] (or [B, 1, V]) generated-token counts each row's position sees
    seen: torch.Tensor,  # [B, V] bool, the prompt's tokens
) -> torch.Tensor:  # [B, T, V] fp32
    """Rows with neutral parameters (presence 0, frequency 0, repetition 1) come back unchanged."""
    occurred = (counts > 0) | seen[:, None]
    rep = t.repetition[:, None, None]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(occurred, repeated, logits)
    counts = counts.to(logits.dtype)
    return logits - t.frequency[:, None, None] * counts - t.presence[:, None, None] * (counts > 0)


def counts_after_drafts(counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """counts [B, V] int32, drafts [B, K] -> [B, K + 1, V]: row j adds drafts 0 .. j - 1 to the counts.

    Row j is the position after draft j - 1, so its context holds the drafts before it. With drafts
    [5, 7] and no counts: row 0 counts nothing, row 1 counts token 5 once, row 2 tokens 5 and 7 once each.
    The scatter adds draft i into every row j > i (mask[j, i] = i < j).
    """
    b, k = drafts.shape
    if k == 0:  # plain decoding, a prefill's first token
        return counts[:, None]
    out = counts[:, None].expand(b, k + 1, counts.shape[-1]).clone()
    rows = torch.arange(k + 1, device=drafts.device)[:, None]
    mask = (torch.arange(k, device=drafts.device) < rows).to(out.dtype)  # [K + 1, K]
    return out.scatter_add_(2, drafts[:, None, :].expand(b, k + 1, k), mask.expand(b, k + 1, k))


def count_emitted(counts: torch.Tensor, emitted: torch.Tensor, new: torch.Tensor) -> None:
    """Adds the new tokens to the counts, in place: counts [B, V] int32, emitted [B, T], new [B, T] bool
    (the tokens a step really emitted: emitted [5, 9, 9], new [T, T, F] adds 5 and 9 once each)."""
    counts.scatter_add_(1, emitted, new.to(counts.dtype))


def with_bias(
    logits: torch.Tensor,  # [B, T, V] fp32 (a grammar's or bad words' mask applied)
    bias: torch.Tensor,  # [B, 1, V] the slots' bias rows (structured/token_controls.py)
) -> torch.Tensor:  # [B, T, V]
    """logits + bias, but a row the bias leaves without a finite logit (allowed_token_ids none of which
    a grammar allows there) keeps its logits: the mask wins, so a grammar is never broken and a row
    never samples from nothing (a NaN)."""
    shaped = logits + bias
    return torch.where(shaped.amax(dim=-1, keepdim=True) == float("-inf"), logits, shaped)
