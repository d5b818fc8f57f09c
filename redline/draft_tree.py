"""The shape of an EAGLE-2-style draft tree, fixed per engine so that every tensor of a step keeps a static
shape (the tree itself: speculative/tree.py)."""

from __future__ import annotations

from dataclasses import dataclass

TREE_SLOTS = 63  # a TreeMask's bits address 63 slots past its base


@dataclass(frozen=True)
class TreeShape:
    topk: int  # children of each expanded node
    steps: int  # levels: the longest path a step can accept
    nodes: int  # rows verified: the root and nodes - 1 drafted tokens

    def __post_init__(self) -> None:
        if self.topk < 2:
            raise ValueError(f"a draft tree needs topk >= 2 (got {self.topk}; topk 1 is the chain)")
        if self.steps < 1:
            raise ValueError(f"a draft tree needs at least 1 step (got {self.steps})")
        if not 2 <= self.nodes <= self.pool + 1:
            raise ValueError(
                f"num_draft_tokens {self.nodes} must lie in [2, {self.pool + 1}]: the root and up to the "
                f"{self.pool} nodes that topk {self.topk} and {self.steps} steps draft"
            )
        if self.nodes > TREE_SLOTS or self.frontier_slots > TREE_SLOTS:
            raise ValueError(f"a draft tree of at most {TREE_SLOTS} nodes and frontier slots is supported")

    @property
    def pool(self) -> int:
        """Nodes drafted: topk at step 0, topk x topk at each later step."""
        return self.topk + (self.steps - 1) * self.topk * self.topk

    @property
    def frontier_slots(self) -> int:
        """Draft-cache slots the frontier rows take past the new root: topk per step after the first."""
        return (self.steps - 1) * self.topk

    @property
    def reach(self) -> int:
        """Positions past the pending root a step writes: the verified rows, or the draft's path pass and
        frontier rows (from the last accepted position pos + steps)."""
        return max(self.nodes - 1, self.steps + self.frontier_slots)


def tree_of(topk: int, steps: int, nodes: int | None, with_draft: bool) -> TreeShape | None:
    """The tree speculative options ask for (SpeculativeConfig's topk, num_speculative_tokens,
    num_draft_tokens; with_draft: an EAGLE-3 draft, with or without n-gram lookup beside it), None for a
    chain (topk 1, and num_draft_tokens None or K + 1 as SGLang spells a chain). ValueError naming what does
    not fit."""
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    if topk == 1 and nodes in (None, steps + 1):
        return None
    if not with_draft:
        raise ValueError('draft trees (topk > 1, num_draft_tokens) need an EAGLE-3 draft (method "eagle3")')
    if topk == 1:
        raise ValueError("num_draft_tokens sizes a draft tree: give topk > 1 (topk 1 is the chain, "
                         "num_draft_tokens K + 1)")  # fmt: skip
    return TreeShape(topk, steps, nodes or 2 * steps)
