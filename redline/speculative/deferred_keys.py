"""The draft's keys of steps that draft nothing, written DEFERRED steps at a time.

A step that verifies no drafts (adaptive draft length, engine/draft_length.py) must still leave the draft's
KV cache whole, or the next drafting step attends to holes. Writing the draft's keys at each such step's
position costs its fc and k/v products (2.9 MB of weights for SmolLM2's draft) and some twenty small ops:
about 0.2 ms of a 7.4 ms step at batch 1 (2-3%), on every step, for a draft that may never be accepted.
What a key needs is known at the step: the target's aux hidden states at the position and the token
emitted after it. So the step keeps those in a ring of DEFERRED entries per slot, and the runner writes the
keys of every entry in one pass (`flush`, runner/model_runner.py): after DEFERRED steps without drafts,
before a step that drafts (its draft attends to every earlier position), and before a compiled twin takes
over (runner/background_compile.py). One pass over 16 positions reads the weights once rather than 16 times.
A released slot's entries are dropped (`drop`): its request's keys are never read again, and a later pass
would write them through the table of the slot's next request. Only decode positions are deferred, and a
running slot's table is only ever extended (engine/scheduler.py), so at a flush each entry's position still
maps to the block it was recorded for; the prompt's keys, which prefix caching shares, are written by the
prefill itself.

An entry's place in the ring is its position modulo DEFERRED: steps without drafts advance each slot by one
position, so the DEFERRED steps between two flushes fill distinct entries. Slot 2 at positions 37, 38, 39
fills entries 5, 6, 7 (DEFERRED 16); `positions` marks the filled entries (-1: empty), and a flush writes
those and empties the ring. Empty entries, and free rows of the step's batch, write the scratch block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import KVLayer

DEFERRED = 16  # steps without drafts whose draft keys wait for one pass


@dataclass
class DeferredKeys:
    aux: torch.Tensor  # [S, DEFERRED, 3 * H_target] the target's aux hidden states at the entry's position
    tokens: torch.Tensor  # [S, DEFERRED] int64: the token emitted after it
    positions: torch.Tensor  # [S, DEFERRED] int64: the entry's position, -1 where empty

    @classmethod
    def for_draft(cls, draft: Eagle3Draft | None, slots: int, steps_without_drafts: bool,
                  device: torch.device) -> DeferredKeys | None:  # fmt: skip
        """An empty ring for a draft whose steps may verify no drafts (else None): entries of what its fc
        reads, in its dtype."""
        if draft is None or not steps_without_drafts:
            return None
        fc = draft.fc
        return cls(
            aux=torch.zeros(slots, DEFERRED, fc.in_features, dtype=draft.dtype, device=device),
            tokens=torch.zeros(slots, DEFERRED, dtype=torch.int64, device=device),
            positions=torch.full((slots, DEFERRED), -1, dtype=torch.int64, device=device),
        )

    def drop(self, slots: tuple[int, ...]) -> None:
        """Empties the released slots' entries."""
        self.positions[list(slots)] = -1

    def record(
        self,
        aux: torch.Tensor,  # [B, 1, 3 * H_target] at each row's position
        next_tokens: torch.Tensor,  # [B, 1] the token emitted there
        positions: torch.Tensor,  # [B, 1]
        emitting: torch.Tensor,  # [B] bool: rows of free slots record nothing
    ) -> None:
        """Slots [0, B) keep one step's entries (inside the compiled step: in place, no host sync)."""
        b = aux.shape[0]
        rows = torch.arange(b, device=aux.device)
        entry = positions[:, 0] % DEFERRED
        self.aux[rows, entry] = aux[:, 0].to(self.aux.dtype)
        self.tokens[rows, entry] = next_tokens[:, 0]
        self.positions[rows, entry] = torch.where(emitting, positions[:, 0], -1)

    def flush(
        self,
        draft: Eagle3Draft,
        cache: KVLayer,
        tables: torch.Tensor,  # [S, blocks per sequence] int32: every slot's block table
        scratch_block: int,
        rows: int,  # slots [0, rows) hold entries
    ) -> None:
        """The draft's keys and values of every filled entry of slots [0, rows), as the steps would have
        written them, as rows x DEFERRED one-position rows of one pass; the ring is empty afterwards."""
        positions = self.positions[:rows].reshape(rows * DEFERRED, 1)
        # slot s's table for its DEFERRED entries: rows s * DEFERRED .. (s + 1) * DEFERRED - 1
        entry_tables = tables[:rows].repeat_interleave(DEFERRED, dim=0)  # [rows * DEFERRED, blocks]
        entry_tables = torch.where(positions >= 0, entry_tables, scratch_block)
        hidden = draft.fuse(self.aux[:rows].reshape(rows * DEFERRED, 1, -1))
        tokens = self.tokens[:rows].reshape(rows * DEFERRED, 1)
        draft.write_keys(tokens, hidden, positions.clamp(min=0), cache, entry_tables)
        self.positions[:rows] = -1
