"""A request's grammar between steps: which tokens each row of its next step may emit, and the tokens it
emitted.

A decode step verifies pending = [bonus, d1 .. dK] (or a draft tree's N rows): row j's logits choose the
token after row j's, so row j may emit what the grammar allows after the emitted tokens and the drafts on
the path to row j. The matcher is advanced over those drafts without committing and rolled back, as vLLM
does. A draft the grammar refuses cannot be accepted (its parent row's mask excludes it, so verification
rejects it: greedy never picks it, a sampled row gives it probability 0), so rows past it are left
all-allowed: nothing they choose is ever emitted.

Example, chain K = 2, grammar root ::= "ab" | "ac" (one token per letter), the bonus 'a' committed,
pending ['a', 'b', 'x']: row 0 (after 'a') allows {'b', 'c'}; 'b' is taken, so row 1 (after 'ab') allows
only the stop token; 'x' is refused, so row 2 is all-allowed. If the target picks 'c' at row 0, the step
emits 'c' (d1 rejected) and the host commits 'c'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from redline.structured.bitmask import ALL_ALLOWED

if TYPE_CHECKING:
    import xgrammar


def words(vocab_size: int) -> int:
    """int32 words of a token bitmask: bit t % 32 of word t // 32 allows token t (49,152 tokens: 1,536)."""
    return -(-vocab_size // 32)


class RequestGrammar:
    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)  # rolls back any number of tokens
        self.vocab_size = vocab_size

    def next_mask(self) -> torch.Tensor:  # [1, words] int32
        """What may come after the committed tokens: a final prefill chunk's row."""
        bits = torch.empty(1, words(self.vocab_size), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(bits, 0)
        return bits

    @property
    def done(self) -> bool:
        """The output is complete and its stop token emitted."""
        return self.matcher.is_terminated()

    def commit(self, tokens: list[int]) -> None:
        """The tokens a step emitted, in order (they obeyed the masks, so the grammar takes each)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} broke the request's grammar (its mask allowed it)")

    def masks(
        self,
        pending: list[int],  # the step's rows' tokens: bonus, then drafts (a chain's, or a tree's nodes)
        parents: list[int] | None,  # a tree's: row i's parent row (< i; the root's is 0); None: a chain
        out: torch.Tensor,  # [T, words] int32 on the host, T = len(pending): written
    ) -> None:
        """Row j's allowed tokens: after the committed tokens and the drafts on the path to row j (the bonus,
        pending[0], is committed already: row 0 is the matcher's own state). One walk over the rows in
        order; the matcher holds one path at a time and, for each row, rolls back to where that path and
        the row's parent's path part, then takes the rest. A chain's rows each take one draft more; a
        tree with parents [0, 0, 0, 1, 2]: row 1 takes d1; row 2 rolls back to the root, takes d2; row 3
        rolls back to the root, takes d1, d3; row 4 rolls back to the root, takes d2, d4."""
        out.fill_(ALL_ALLOWED)
        parents = parents if parents is not None else chain_parents(len(pending))
        path: list[int] = []  # the rows whose tokens the matcher holds, the root's child first
        refused: set[int] = set()  # rows the grammar refuses (or past the stop token), and their subtrees
        for row in range(len(pending)):
            if row:
                if parents[row] in refused:
                    refused.add(row)
                    continue
                path = self._walk_to(path, path_to(parents[row], parents), pending)
                if self.matcher.is_terminated() or not self.matcher.accept_token(pending[row]):
                    refused.add(row)
                    continue
                path.append(row)
            if not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(out, row)
        if path:
            self.matcher.rollback(len(path))

    def proposal_masks(self, emitted: list[int], paths: list[list[int]], out: torch.Tensor) -> None:
        """out[f] ([F, words] int32, all-allowed): what may follow the committed tokens, `emitted` and
        paths[f] (a step's new tokens, then the draft's proposals on one path: structured/draft_masks.py);
        left all-allowed where the grammar refuses a token of them or ends inside them. The matcher is
        where it was afterwards, an exception included."""
        held = [0]  # tokens the matcher holds past the committed ones

        def take(tokens: list[int]) -> bool:
            for token in tokens:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    return False
                held[0] += 1
            return True

        try:
            if not take(emitted):
                return
            for f, path in enumerate(paths):
                if take(path) and not self.matcher.is_terminated():
                    self.matcher.fill_next_token_bitmask(out, f)
                if held[0] > len(emitted):
                    self.matcher.rollback(held[0] - len(emitted))
                    held[0] = len(emitted)
        finally:
            if held[0]:
                self.matcher.rollback(held[0])

    def _walk_to(self, path: list[int], target: list[int], pending: list[int]) -> list[int]:
        """From holding `path`'s tokens to holding `target`'s (rows the grammar took before): rolls back
        past their common start, then takes target's rest."""
        common = 0
        while common < min(len(path), len(target)) and path[common] == target[common]:
            common += 1
        if len(path) > common:
            self.matcher.rollback(len(path) - common)
        for row in target[common:]:
            if not self.matcher.accept_token(pending[row]):
                raise RuntimeError(f"the grammar refused draft row {row}, which it took before")
        return list(target)


def chain_parents(rows: int) -> list[int]:
    """A chain's rows as a tree: row i's parent is row i - 1 (the root's is 0): 4 rows -> [0, 0, 1, 2]."""
    return [max(row - 1, 0) for row in range(rows)]


def path_to(row: int, parents: list[int]) -> list[int]:
    """A tree's rows from the root's first child to `row` (the root itself is committed): parents
    [0, 0, 0, 1, 3] -> row 4: [1, 3, 4], row 0: []."""
    path = []
    while row > 0:
        path.append(row)
        row = parents[row]
    return path[::-1]
