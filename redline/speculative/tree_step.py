"""The decode step with a draft tree (speculative/tree.py): the target over the tree's N rows under its
ancestor mask, the longest accepted path (tree_verify.py), the path's keys moved to their positions, then
the chain step's ending (Emitter.finish) over the path as if it had been a chain: the emitted tokens
counted and packed, the draft's pass over the path's rows and the next tree drafted from its last accepted
row. Static shapes and no host sync, like the chain's step; the output has the chain's layout with
K = steps.

Example, topk 2, steps 2, N 4, pending [a, b, c, d] with parents [0, 0, 0, 1] at pos 40: rows at slots
40..43, positions [40, 41, 41, 42]; the target's choices [b, e, x, y] accept b (row 1) and then not d
(e != d): path [0, 1, 1], n_acc 1, emitted [b, e, *]; row 1's keys stay at slot 41 (its position).
"""

from __future__ import annotations

import torch

from redline.speculative.emit import argmax_shaping, target_probs
from redline.speculative.propose import DraftInputs
from redline.speculative.step import DecodeStep
from redline.speculative.tree import keep_path, tree_mask, truncate_at_chunk
from redline.speculative.tree_verify import greedy_tree_verify, sampled_tree_verify


def counts_along_tree(
    counts: torch.Tensor,  # [B, V] int32
    tokens: torch.Tensor,  # [B, N] the tree's rows' tokens (row 0 the root, already counted)
    bits: torch.Tensor,  # [B, N] ancestor bits (tree.structure)
) -> torch.Tensor:  # [B, N, V]
    """Row r's counts: the step's counts plus the tokens of its ancestors below the root and its own (the
    tokens before the position it predicts). Bits 0b1011 for row 3: rows 1 and 3 add their tokens."""
    b, n = tokens.shape
    rows = torch.arange(n, device=tokens.device)
    below_root = ((bits[:, :, None] >> rows) & 1) * (rows > 0)  # [B, N (row), N (its ancestors)]
    out = counts[:, None].expand(b, n, counts.shape[-1]).clone()
    return out.scatter_add_(2, tokens[:, None, :].expand(b, n, n), below_root.to(out.dtype))


class TreeDecodeStep(DecodeStep):
    """DecodeStep's callable, for an Emitter with a tree: out [rows, steps + 2 (+ packed logprobs)]. A step
    of k = 0 (adaptive draft length) is the chain's, over each slot's root alone; it leaves a tree of
    copies of the bonus token pending (Emitter._no_proposals), which the next drafting step verifies."""

    def __call__(self, rows: int, kv_len: int, any_sampling: bool, k: int | None = None) -> torch.Tensor:
        if k == 0:
            return super().__call__(rows, kv_len, any_sampling, 0)
        st, shape = self.state, self.emit.tree
        assert shape is not None and st.parents is not None and self.draft_cache is not None
        pending, parents, active = st.pending[:rows], st.parents[:rows], st.active[:rows]
        pos = torch.where(active, st.pos[:rows], 0)  # free rows compute at position 0 (see DecodeStep)
        sampling = self.sampling.rows(0, rows)
        positions, mask = tree_mask(parents, pos, shape.steps)  # [B, N] pos + depth
        chunk = self.target.config.attention_chunk_size
        verified = parents if chunk is None else truncate_at_chunk(parents, positions, pos, chunk)
        tables = torch.where(active[:, None], self.cache.tables(0, rows), self.cache.scratch_block)
        hidden, aux = self.target(pending, positions, self.cache.layers, tables, kv_len, mask)
        assert aux is not None
        counts, seen = st.counts[:rows], st.seen[:rows]
        logits = None
        if not any_sampling:
            choice = self.target.greedy_tokens(hidden, argmax_shaping(sampling))  # [B, N]
            path, accepted, tokens = greedy_tree_verify(choice, pending, verified, shape.steps)
        else:
            logits = self.target.logits(hidden)  # [B, N, V]
            p = target_probs(logits, sampling, counts_along_tree(counts, pending, mask.bits), seen)
            most = shape.topk + (self.emit.lookup is not None)  # children of a node: an n-gram chain's too
            path, accepted, tokens = sampled_tree_verify(p, pending, verified, shape.steps, most,
                                                         sampling.seed, positions)  # fmt: skip
            logits = logits.gather(1, path[..., None].expand(-1, -1, logits.shape[-1]))
        keep_path(self.cache.layers, tables, pos, path)
        along = pos[:, None] + torch.arange(shape.steps + 1, device=pos.device)  # [B, steps + 1]
        aux = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1]))
        first_row = torch.zeros_like(pos)
        draft_inputs = DraftInputs(aux, tokens, along, first_row, self.draft_cache.layers[0], tables, kv_len)
        history = None if st.history is None else st.history[:rows, :kv_len]  # n-gram lookup beside it
        e = self.emit.finish(tokens, accepted, logits, along, sampling, counts, seen, active, any_sampling,
                             draft_inputs, history)  # fmt: skip
        assert e.parents is not None
        st.pending[:rows] = torch.where(active[:, None], e.pending, st.pending[:rows])
        st.parents[:rows] = torch.where(active[:, None], e.parents, parents)
        st.pos[:rows] = torch.where(active, pos + e.accepted + 1, st.pos[:rows])  # inactive rows keep theirs
        out = torch.cat((e.tokens, e.accepted[:, None]), dim=1)
        return out if e.packed is None else torch.cat((out, e.packed), dim=1)
