"""Row rules on the draft's proposals: a host callback inside the step.

Verification obeys a request's rules through masks computed before the step (structured/matcher.py). The
draft's proposals come after the step's bonus token, which the step itself samples, so their masks cannot
be step inputs: the step calls back to the host between the draft's passes, as TensorRT-LLM's one-model
EAGLE does. The callback (`rule_masked`, a custom op: torch.compile keeps it as one opaque call in the
graph) takes each row's emitted tokens and the proposals so far, advances the slot's matcher over them
without committing, fills the mask of what may come next, rolls back, and masks the draft's logits. A
step whose rows have no rules gets its logits back copied. Proposals only steer acceptance, so the output
is the same either way; masked, the proposals the grammar would refuse are no longer made, and
acceptance rises.

The rules are the ones the scheduler installed on the engine's thread for the plan it runs (`install`):
another thread's steps (a compile thread's warm-up) see none. A CUDA graph replays without calling Python,
and tensor-parallel ranks hold no matchers: there the draft proposes unmasked (ModelRunner).

Example, a chain K = 3 under root ::= "ab" | "ac", a step that emits ['a'] (the bonus): proposal 1 is
masked by what may follow 'a' ({'b', 'c'}), proposal 2 by what may follow 'a' then proposal 1, and so on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from redline.structured.bitmask import ALL_ALLOWED
from redline.structured.rules import TokenRules

_INSTALLED = threading.local()


def install(by_slot: dict[int, TokenRules]) -> None:
    """The rules of the slots the next plan runs under rules, for this thread's steps until the next call.
    Their matchers' committed state sits just before the tokens the plan emits."""
    _INSTALLED.by_slot = by_slot


def _installed() -> dict[int, TokenRules]:
    return {slot: rules for slot, rules in getattr(_INSTALLED, "by_slot", {}).items() if not rules.done}


@dataclass(frozen=True)
class DraftVocabulary:
    """Where each draft token's bit sits in a mask over the target's vocabulary: draft id d is target id
    t = to_target[d], bit t % 32 of word t // 32 (draft id 2 with target id 37: word 1, bit 5)."""

    word: torch.Tensor  # [V_draft] int64
    bit: torch.Tensor  # [V_draft] int32
    words: int  # of a mask over the target's vocabulary

    @classmethod
    def of(cls, to_target: torch.Tensor, vocab_size: int) -> DraftVocabulary:  # to_target [V_draft]
        return cls(to_target // 32, (to_target % 32).to(torch.int32), -(-vocab_size // 32))


def rule_bits(
    slots: list[int],  # [B] each row's slot
    emitted: list[list[int]],  # [B, T] the step's tokens: the first accepted + 1 of each row are new
    accepted: list[int],  # [B]
    paths: list[list[list[int]]],  # [B, F, D] F proposal paths per row, D tokens each (target ids)
    ruled: dict[int, TokenRules],
    words: int,
) -> torch.Tensor:  # [B, F, words] int32, all-allowed for rows without rules
    out = torch.full((len(paths), len(paths[0]), words), ALL_ALLOWED, dtype=torch.int32)
    for b, slot in enumerate(slots):
        if slot in ruled:
            ruled[slot].proposal_masks(emitted[b][: accepted[b] + 1], paths[b], out[b])
    return out


@torch.library.custom_op("redline::rule_masked", mutates_args=())
def rule_masked(
    logits: torch.Tensor,  # [B, F, V_draft] the draft's, at F proposal paths per row
    slots: torch.Tensor,  # [B] each row's slot (-1: a row that emits nothing)
    tokens: torch.Tensor,  # [B, T] emitted: the first accepted + 1 are new
    accepted: torch.Tensor,  # [B]
    paths: torch.Tensor,  # [B, F, D] the proposals on each path so far (target ids)
    word: torch.Tensor,  # [V_draft] DraftVocabulary's
    bit: torch.Tensor,  # [V_draft]
    words: int,
) -> torch.Tensor:  # [B, F, V_draft]: -inf where the installed rules refuse the draft token
    """The logits masked by the rules installed on this thread (a copy of them when no row has any). A
    row whose mask allows no draft token (say only the end of the output, outside the draft's
    vocabulary) stays unmasked: its proposals are refused by verification anyway."""
    ruled = _installed()
    row_slots = slots.tolist() if ruled else []
    if not any(slot in ruled for slot in row_slots):
        return logits.clone()
    host = rule_bits(row_slots, tokens.tolist(), accepted.tolist(), paths.tolist(), ruled, words)
    return draft_allowed(logits, host.to(logits.device), word, bit)


@rule_masked.register_fake
def _(logits, slots, tokens, accepted, paths, word, bit, words):
    return torch.empty_like(logits)


def draft_allowed(
    logits: torch.Tensor,  # [B, F, V_draft]
    bits: torch.Tensor,  # [B, F, W] int32 masks on the target's vocabulary
    word: torch.Tensor,  # [V_draft] int64
    bit: torch.Tensor,  # [V_draft] int32
) -> torch.Tensor:  # [B, F, V_draft], -inf where the target token's bit is 0
    """Each draft token reads its target token's bit (DraftVocabulary); a row allowing none is left as it
    was."""
    allowed = ((bits[..., word] >> bit) & 1) == 1  # [B, F, V_draft]
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))


@dataclass
class ProposalRules:
    """What a step's draft masks its proposals with: each row's slot and the tokens it emitted."""

    vocabulary: DraftVocabulary
    slots: torch.Tensor  # [B] (-1 for a row that emits nothing)
    tokens: torch.Tensor  # [B, T] emitted: the first accepted + 1 are new
    accepted: torch.Tensor  # [B]

    def mask(
        self,
        logits: torch.Tensor,  # [B, F, V_draft] the draft's, at F proposal paths per row
        paths: torch.Tensor,  # [B, F, D] the proposals on each path so far (target ids)
    ) -> torch.Tensor:  # [B, F, V_draft]
        v = self.vocabulary
        return rule_masked(logits, self.slots, self.tokens, self.accepted, paths, v.word, v.bit, v.words)
