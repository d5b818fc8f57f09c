"""Batched, chunked prefill: pieces of several requests' prompts as the rows of one forward.

A chunk is positions [start, end) of one slot's sequence (its prompt, or prompt + outputs when a
preempted request comes back). The chunks of one prefill forward are the rows of a padded batch
[B, L], L the longest chunk rounded up to 16. Each row reads and writes the KV cache only through its
own block table, so it attends only to itself. A row's padding takes the positions after its chunk
(capped at the cache's last position). What it writes there is rewritten before anything reads it, by
the row's next chunk or its first decode step: the cache's rule (layers/attention.py).

Example: chunks (slot 3, positions 0..19 of a 50-token prompt) and (slot 5, positions 112..119 of a
120-token prompt) -> L = 32; row 0 computes positions 0..31, row 1 positions 112..143. Row 1's chunk is
final: its last real row (index 7) gives slot 5's first new token.

EAGLE-3: the draft's row at position p reads the token at p + 1. For every row of a chunk that token is
known (the next token of the sequence, and for the last row of a final chunk the first new token), so
every chunk also runs the draft over its rows, and a final chunk continues into the K proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.engine.compiled_prefill import padded_prompt_len
from redline.logprobs import TokenLogprob


@dataclass(frozen=True)
class PrefillChunk:
    slot: int
    tokens: list[int]  # the whole sequence being prefilled
    start: int  # positions [start, end) run in this chunk
    end: int

    @property
    def final(self) -> bool:
        """The chunk that ends the sequence: its last row gives the first new token."""
        return self.end == len(self.tokens)


@dataclass
class PrefillResult:
    """What one chunk's prefill gives the host."""

    first: int | None  # a final chunk's first generated token
    logprob: TokenLogprob | None = None  # its log-probability, for requests asking for logprobs
    # requests asking for prompt logprobs: those of the prompt tokens after each of the chunk's rows
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class PaddedChunks:
    tokens: torch.Tensor  # [B, L] token ids, 0 past each chunk
    positions: torch.Tensor  # [B, L] absolute positions, continuing past each chunk
    next_tokens: torch.Tensor  # [B, L] the token at position + 1 (0 where it is not known yet)
    last: torch.Tensor  # [B] index of each chunk's last real row
    kv_len: int  # cache positions the forward attends: past every row's last position


def pad_chunks(chunks: list[PrefillChunk], cache_len: int, device: torch.device) -> PaddedChunks:
    """The chunks as a padded batch: built as lists on the host, each copied to the device once."""
    length = padded_prompt_len(max(c.end - c.start for c in chunks), cache_len)
    tokens, positions, next_tokens = [], [], []
    for c in chunks:
        pad = [0] * (length - (c.end - c.start))
        tokens.append(c.tokens[c.start : c.end] + pad)
        positions.append([min(p, cache_len - 1) for p in range(c.start, c.start + length)])
        following = c.tokens[c.start + 1 : c.end + 1]  # one short for a final chunk: the first new token
        next_tokens.append(following + [0] * (length - len(following)))
    kv_len = min(max(c.start for c in chunks) + length, cache_len)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int64, device=device)
    last = [c.end - c.start - 1 for c in chunks]
    return PaddedChunks(
        as_tensor(tokens), as_tensor(positions), as_tensor(next_tokens), as_tensor(last), kv_len
    )
