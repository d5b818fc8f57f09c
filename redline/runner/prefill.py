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
every chunk also writes the draft's keys at its rows, and a final chunk runs the draft's layer over its
last row and continues into the K proposals.
The first tokens and proposals come from the same Emitter as every decode step (speculative/emit.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from redline import logprobs
from redline.runner.plan import ChunkResult, PrefillBatch, PrefillChunk, Shapes
from redline.runner.slots import DeviceSlots
from redline.speculative.emit import Emitter
from redline.speculative.propose import DraftInputs

PROMPT_LOGPROB_ROWS = 512  # prompt logprobs: rows of logits computed at a time ([512, V] fp32)
# (tokens [B, L], positions [B, L], tables [B, n], kv_len) -> (hidden [B, L, H], aux [B, L, A] or None)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class PaddedChunks:
    tokens: torch.Tensor  # [B, L] token ids, 0 past each chunk
    positions: torch.Tensor  # [B, L] absolute positions, continuing past each chunk
    next_tokens: torch.Tensor  # [B, L] the token at position + 1 (0 where it is not known yet)
    last: torch.Tensor  # [B] index of each chunk's last real row
    kv_len: int  # cache positions the forward attends: past every row's last position


def pad_chunks(chunks: tuple[PrefillChunk, ...], shapes: Shapes, device: torch.device) -> PaddedChunks:
    """The chunks as a padded batch: built as lists on the host, each copied to the device once."""
    length = shapes.prefill_len(max(len(c.tokens) for c in chunks))
    cache_len = shapes.cache_len
    tokens, positions, next_tokens = [], [], []
    for c in chunks:
        n = len(c.tokens)
        tokens.append([*c.tokens, *[0] * (length - n)])
        positions.append([min(p, cache_len - 1) for p in range(c.start, c.start + length)])
        following = [*c.tokens[1:], *(() if c.final else (c.next_token,))]  # a final chunk: one short
        next_tokens.append(following + [0] * (length - len(following)))
    kv_len = min(max(c.start for c in chunks) + length, cache_len)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int64, device=device)
    last = [len(c.tokens) - 1 for c in chunks]
    return PaddedChunks(
        as_tensor(tokens), as_tensor(positions), as_tensor(next_tokens), as_tensor(last), kv_len
    )


@dataclass
class DevicePrefill:
    """A prefill forward's results, still on the device."""

    first: torch.Tensor | None  # [B] each chunk's first new token (meaningful for final chunks)
    packed: torch.Tensor | None  # [B, W] on the logits path: the first tokens' packed logprobs
    prompt_logprobs: dict[int, tuple[torch.Tensor, list[int]]]  # chunk index -> packed [n, W], tokens [n]


class Prefill:
    def __init__(self, emitter: Emitter, forward: Forward, slots: DeviceSlots, shapes: Shapes):
        self.emit, self.forward, self.slots, self.shapes = emitter, forward, slots, shapes

    def run(self, batch: PrefillBatch) -> DevicePrefill:
        """The batch's forward and, for final chunks, their first tokens and the draft's proposals, written
        into their slots, which decode from now on. No host sync."""
        chunks, slots = batch.chunks, self.slots
        padded = pad_chunks(chunks, self.shapes, slots.device)
        rows = torch.tensor([c.slot for c in chunks], device=slots.device)
        tables = slots.cache.table[rows]  # [B, blocks per sequence]
        hidden, aux = self.forward(padded.tokens, padded.positions, tables, padded.kv_len)
        prompt = {
            i: self._prompt_logprobs(c, hidden[i], padded.next_tokens[i])
            for i, c in enumerate(chunks)
            if c.prompt_logprobs is not None
        }
        draft = self.emit.draft
        if not any(c.final for c in chunks):  # keys and values only: no first token, no proposals yet
            if draft is not None and slots.draft_cache is not None and aux is not None:
                layer = slots.draft_cache.layers[0]
                draft.write_keys(padded.next_tokens, draft.fuse(aux), padded.positions, layer, tables)
            return DevicePrefill(None, None, prompt)
        return self._first_tokens(batch, padded, rows, tables, hidden, aux, prompt)

    def _first_tokens(
        self,
        batch: PrefillBatch,
        padded: PaddedChunks,
        rows: torch.Tensor,  # [B] the chunks' slots
        tables: torch.Tensor,  # [B, blocks per sequence]
        hidden: torch.Tensor,  # [B, L, H]
        aux: torch.Tensor | None,  # [B, L, 3 * H] with a draft
        prompt: dict[int, tuple[torch.Tensor, list[int]]],
    ) -> DevicePrefill:
        chunks, slots, state = batch.chunks, self.slots, self.slots.state
        last = padded.last
        h_last = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))  # [B, 1, H]
        position = padded.positions.gather(1, last[:, None])  # [B, 1]: the first new token goes after it
        final = torch.tensor([c.final for c in chunks], device=slots.device)
        counts = state.counts[rows] if batch.logits else None  # [B, V], a copy: written back below
        seen = state.seen[rows] if batch.logits else None
        draft_inputs = None
        if slots.draft_cache is not None:
            assert aux is not None
            # the proposals run past the last row (a chain K - 1 positions, a tree its frontier's slots)
            reach = max(c.end for c in chunks) + self.shapes.reach + 2
            kv_len = min(max(padded.kv_len, reach), self.shapes.cache_len)
            draft_inputs = DraftInputs(aux, padded.next_tokens, padded.positions, last,
                                       slots.draft_cache.layers[0], tables, kv_len, one_row=True,
                                       slots=rows)  # fmt: skip
        no_drafts = torch.zeros((len(chunks), 0), dtype=torch.int64, device=slots.device)
        history = None if state.history is None else state.history[rows]  # [B, L], a copy: written back
        e = self.emit(h_last, no_drafts, None, position, slots.sampling.take(rows), counts, seen, final,
                      batch.logits, draft_inputs, history)  # fmt: skip
        index = torch.tensor([i for i, c in enumerate(chunks) if c.final], device=slots.device)
        done = rows[index]  # these slots have their first token (and decode from now on, unless it ends them)
        state.pending[done] = e.pending[index]
        state.pos[done] = torch.tensor([c.end for c in chunks if c.final], device=slots.device)
        state.active[done] = torch.tensor([c.decodes for c in chunks if c.final], device=slots.device)
        if e.draft_probs is not None and state.draft_probs is not None:
            state.draft_probs[done] = e.draft_probs[index]
        if history is not None and state.history is not None:
            state.history[done] = history[index]
        if e.parents is not None and state.parents is not None:
            state.parents[done] = e.parents[index]
        if counts is not None:  # last: a prefill that raises before here leaves the counts as they were
            state.counts[rows] = counts
        return DevicePrefill(e.tokens[:, 0], e.packed, prompt)

    def _prompt_logprobs(
        self, chunk: PrefillChunk, hidden: torch.Tensor, next_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """One chunk's prompt log-probabilities, packed [n, W] on the device, and the n tokens they are of:
        the prompt tokens at positions [start + 1, min(end + 1, prompt length)). Row i predicts the token at
        start + i + 1; the last row of a final chunk predicts the first generated token, not a prompt token.
        hidden [L, H], next_tokens [L]; logits are computed PROMPT_LOGPROB_ROWS rows at a time."""
        count = max(min(chunk.end + 1, chunk.prompt_len) - (chunk.start + 1), 0)
        model, pieces = self.emit.target, []
        for start in range(0, count, PROMPT_LOGPROB_ROWS):
            rows = slice(start, min(start + PROMPT_LOGPROB_ROWS, count))
            logits = model.logits(hidden[None, rows])  # [1, n, V]
            pieces.append(logprobs.pack(logits, next_tokens[None, rows]).view(logits.shape[1], -1))
        width = logprobs.width(model.config.vocab_size)
        packed = torch.cat(pieces) if pieces else torch.zeros((0, width), dtype=torch.int64)
        return packed, [*chunk.tokens[1:], chunk.next_token][:count]

    @staticmethod
    def read(batch: PrefillBatch, out: DevicePrefill) -> list[ChunkResult]:
        """The host's copy: per chunk the first token of a final chunk, with the log-probabilities its
        request asks for."""
        chunks = batch.chunks
        firsts = out.first.tolist() if out.first is not None else [None] * len(chunks)
        wanted = out.packed is not None and any(c.final and c.logprobs is not None for c in chunks)
        packed = out.packed.cpu() if wanted and out.packed is not None else None
        results = []
        for i, (chunk, first) in enumerate(zip(chunks, firsts, strict=True)):
            result = ChunkResult(first if chunk.final else None)
            if chunk.final and chunk.logprobs is not None and packed is not None:
                result.logprob = logprobs.unpack(packed[i].view(1, -1), [first], chunk.logprobs)[0]
            if i in out.prompt_logprobs:
                rows, tokens = out.prompt_logprobs[i]
                assert chunk.prompt_logprobs is not None
                result.prompt_logprobs = logprobs.unpack(rows.cpu(), tokens, chunk.prompt_logprobs)
            results.append(result)
        return results
