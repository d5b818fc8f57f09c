"""A request's row masks between steps: its grammar's (structured/matcher.py), narrowed by its bad words
of several tokens (structured/token_controls.py). Either may be absent; the scheduler asks this one
object for the masks of each step's rows and tells it the tokens each step emitted.

Example: the regex "[a-z ]+" and the bad word "ab" (tokens a, b): a row whose context ends with 'a' allows
the letters and the space but 'b'; every other row allows them all.
"""

from __future__ import annotations

import torch

from redline.structured.bitmask import ALL_ALLOWED
from redline.structured.matcher import RequestGrammar, chain_parents, path_to, words
from redline.structured.token_controls import BadWords


class TokenRules:
    def __init__(self, vocab_size: int, grammar: RequestGrammar | None, bad_words: BadWords | None):
        assert grammar is not None or bad_words, "rules without a grammar need bad words"
        self.vocab_size, self.grammar, self.bad_words = vocab_size, grammar, bad_words

    @property
    def done(self) -> bool:
        """The grammar's output is complete and its stop token emitted."""
        return self.grammar is not None and self.grammar.done

    def commit(self, tokens: list[int]) -> None:
        """The tokens a step emitted, in order."""
        if self.grammar is not None:
            self.grammar.commit(tokens)
        if self.bad_words:
            self.bad_words.commit(tokens)

    def next_mask(self) -> torch.Tensor:  # [1, words] int32
        """What may come after the committed tokens: a final prefill chunk's row."""
        if self.grammar is not None:
            bits = self.grammar.next_mask()
        else:
            bits = torch.full((1, words(self.vocab_size)), ALL_ALLOWED, dtype=torch.int32)
        if self.bad_words:
            self.bad_words.restrict(0, [], bits)
        return bits

    def masks(
        self,
        pending: list[int],  # the step's rows' tokens: the committed bonus, then drafts (chain or tree)
        parents: list[int] | None,  # a tree's: row i's parent row; None: a chain
        out: torch.Tensor,  # [T, words] int32 on the host, T = len(pending): written
    ) -> None:
        """Row j's allowed tokens after the committed tokens and the drafts on the path to row j."""
        if self.grammar is not None:
            self.grammar.masks(pending, parents, out)
        else:
            out.fill_(ALL_ALLOWED)
        if self.bad_words:
            parents = parents if parents is not None else chain_parents(len(pending))
            for row in range(len(pending)):
                self.bad_words.restrict(row, [pending[r] for r in path_to(row, parents)], out)

    def proposal_masks(self, emitted: list[int], paths: list[list[int]], out: torch.Tensor) -> None:
        """out[f] ([F, words] int32, all-allowed): what may follow the committed tokens, a step's `emitted`
        tokens and the draft's proposals on paths[f] (structured/draft_masks.py)."""
        if self.grammar is not None:
            self.grammar.proposal_masks(emitted, paths, out)
        if self.bad_words:
            for f, path in enumerate(paths):
                self.bad_words.restrict(f, emitted + path, out)
