"""The per-slot state on the device, and how a plan's first part changes it: slots released, block-table
rows written, slots set up for new requests. Everything a captured step reads lives here, in tensors
allocated once; a plan only writes into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redline.models.kv_cache import KVCache
from redline.runner.plan import SlotSetup, StepPlan, TableUpdate
from redline.sampling import SamplingTensors
from redline.speculative.step import DecodeState
from redline.structured.bitmask import ALL_ALLOWED


@dataclass
class DeviceSlots:
    cache: KVCache  # the target's layers, and the block table of every slot (the draft's cache shares it)
    draft_cache: KVCache | None
    state: DecodeState
    sampling: SamplingTensors

    @property
    def device(self) -> torch.device:
        return self.state.pos.device

    def apply(self, plan: StepPlan) -> None:
        """Releases, then table rows, then set-ups, then structured outputs' masks: a slot freed and taken
        again in one plan ends up set for its new request."""
        for slot in plan.released:
            self.release(slot)
        for update in plan.tables:
            self.write_table(update)
        for setup in plan.admitted:
            self.set_up(setup)
        for mask in plan.masks:
            self.sampling.allowed[mask.slot, : mask.rows] = mask.tensor().to(self.device)
            if mask.decodes:  # its final chunk left it waiting for this mask (plan.TokenMask)
                self.state.active[mask.slot] = True

    def pending(self, slots: tuple[int, ...]) -> dict[int, tuple[list[int], list[int] | None]]:
        """The slots' pending tokens (the bonus, then the drafts) and a draft tree's parents, on the host."""
        index = torch.tensor(slots, device=self.device)
        tokens = self.state.pending[index].tolist()
        parents = None if self.state.parents is None else self.state.parents[index].tolist()
        return {s: (tokens[i], None if parents is None else parents[i]) for i, s in enumerate(slots)}

    def copy_from(self, other: DeviceSlots) -> None:
        """Takes over another runner's per-slot state (block tables, decode state, sampling) in place; the
        KV blocks themselves are shared (ModelRunner's kv_of)."""
        mine = [self.cache.table, *vars(self.state).values(), *vars(self.sampling).values()]
        theirs = [other.cache.table, *vars(other.state).values(), *vars(other.sampling).values()]
        for to, source in zip(mine, theirs, strict=True):
            if to is not None:
                to.copy_(source)

    def release(self, slot: int) -> None:
        """The slot stops decoding; its table row points at the scratch block again."""
        self.state.active[slot] = False
        self.cache.table[slot] = self.cache.scratch_block

    def write_table(self, update: TableUpdate) -> None:
        if update.blocks:
            end = update.start + len(update.blocks)
            blocks = torch.tensor(update.blocks, dtype=torch.int32)
            self.cache.table[update.slot, update.start : end] = blocks.to(self.device)

    def set_up(self, setup: SlotSetup) -> None:
        """Sampling parameters; given the sequence so far, the prompt-token mask and the generated-token
        counts (after a preemption, of the outputs so far: penalties.py) and the n-gram history."""
        s, slot = self.sampling, setup.slot
        for tensor, value in zip(
            (s.temperature, s.top_k, s.top_p, s.min_p, s.presence, s.frequency, s.repetition, s.seed),
            setup.sampling,
            strict=True,
        ):
            tensor[slot] = value
        s.allowed[slot] = ALL_ALLOWED  # a grammar's masks come with each plan (apply)
        s.bias[slot] = 0.0 if setup.bias is None else setup.bias.dense(s.bias.shape[1]).to(self.device)
        if setup.tokens is not None:
            ids = torch.tensor(setup.tokens, dtype=torch.int64, device=self.device)
            state = self.state
            state.seen[slot] = False
            state.seen[slot, ids[: setup.prompt_len]] = True
            state.counts[slot] = torch.bincount(ids[setup.prompt_len :], minlength=state.counts.shape[1])
            if state.history is not None:
                state.history[slot, : len(ids)] = ids
