"""The token masks of requests with row rules in a plan (runner/plan.TokenMask): a grammar's or bad words'
(structured/rules.py), from the request's rules and the pending tokens the device left after the last plan.

Such a request's first token comes from its final prefill chunk under its rules' first mask;
it does not decode in that plan (its step's masks need that token and the draft's proposals after it).
Each later plan gives its decode step the masks of the rows it verifies, k + 1 for a chain (a tree's N
rows when it drafts), and asks for its pending tokens back for the next.

Example, K = 3, a chain: the device left pending [t, d1, d2, d3]; a step of k = 3 gets 4 rows of masks
(after t; after t d1; ...), a step of k = 0 one (after t).
"""

from __future__ import annotations

import torch

from redline.engine.request import Request
from redline.runner.plan import Shapes, TokenMask
from redline.structured.matcher import words


def first_token_mask(request: Request, slot: int) -> TokenMask:
    """The final prefill chunk's row: what the rules allow after the tokens emitted so far."""
    assert request.rules is not None
    request.pending = None  # read back after this plan
    return TokenMask.of(slot, request.rules.next_mask(), decodes=False)


def step_mask(request: Request, slot: int, k: int, shapes: Shapes) -> TokenMask:
    """A decode step's rows for one request: k + 1 (a drafting tree's N), after its pending tokens."""
    assert request.rules is not None and request.pending is not None
    tokens, parents = request.pending
    rows = shapes.tree.nodes if shapes.tree is not None and k > 0 else k + 1
    bits = torch.empty(rows, words(request.rules.vocab_size), dtype=torch.int32)
    request.rules.masks(tokens[:rows], parents[:rows] if parents is not None and k > 0 else None, bits)
    request.pending = None  # read back after this plan
    return TokenMask.of(slot, bits, decodes=True)
