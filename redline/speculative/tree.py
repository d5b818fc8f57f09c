"""EAGLE-2-style draft trees of static shape: `topk` children per expanded node, `steps` levels, the best
`nodes - 1` of them (by the draft's cumulative log-probability) verified beside the root in one forward.

Expansion, topk 2, steps 3 (the draft runs on the frontier at steps 1 and 2):
  step 0: the root's top 2 -> a, b                       (the pool: a, b; frontier a, b)
  step 1: a's top 2 -> c, d; b's top 2 -> e, f           (pool += c, d, e, f; frontier: the best 2 of them)
  step 2: the frontier's top 2 each                      (pool += 4 more)
A child's score is its parent's plus its own log-probability, so it never beats its parent: the best
nodes - 1 of the pool (earlier pool entries first among equals) hold every chosen node's parent. Sorted by
pool index, parents come before children.

A tree is kept as rows: row 0 the root (the last emitted token), rows 1 .. N - 1 its nodes, each with the
row of its parent (`parents`, 0 for the root's children and for the root itself). Its rows go to the cache
at slots pos .. pos + N - 1 but sit at pos + depth (rotary), and each attends to its ancestors' slots
(layers/attention.TreeMask). The draft's frontier rows go to the draft cache past the new root, one slot
per (step, frontier entry), under the same kind of mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from redline.draft_tree import TreeShape
from redline.kernels.paged_kv import BLOCK
from redline.layers.attention import TreeMask
from redline.models.eagle3 import Eagle3Draft
from redline.models.llama import KVLayer


def structure(parents: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N] (row 0 the root, its own parent) -> depth [B, N] and ancestor bits [B, N] (bit j set
    when row j is the row itself or one of its ancestors, the root always). parents [0, 0, 1, 1, 0]:
    depth [0, 1, 2, 2, 1], bits [0b1, 0b11, 0b111, 0b1011, 0b10001]."""
    rows = torch.arange(parents.shape[1], device=parents.device).expand_as(parents)
    bits = (1 << rows) | 1
    depth = torch.zeros_like(parents)
    up = rows
    for _ in range(steps):  # a node sits at most `steps` below the root
        depth = depth + (up != 0)
        up = parents.gather(1, up)
        bits = bits | (1 << up)
    return depth, bits


def truncate_at_chunk(
    parents: torch.Tensor,  # [B, N]
    positions: torch.Tensor,  # [B, N] the rows' positions: pos + depth
    pos: torch.Tensor,  # [B] the root's
    chunk: int,  # Llama 4's attention chunk
) -> torch.Tensor:  # [B, N]
    """The parents with every row past the end of its root's chunk cut off (-1: nobody's child), for
    verification. Under chunked attention a tree's rows see the keys of their root's chunk
    (attention_core.tree_visible), which is exactly their own chunk for the rows inside it; a row past its
    end saw keys it must not, so it is not verified, as if it had not been drafted. Chunk 32, root at 30,
    depths [0, 1, 1, 2, 3]: positions 30, 31, 31, 32, 33, rows 3 and 4 cut off."""
    end = pos - pos % chunk + chunk  # [B] the next chunk's first position
    return torch.where(positions >= end[:, None], -1, parents)


def tree_mask(parents: torch.Tensor, pos: torch.Tensor, steps: int) -> tuple[torch.Tensor, TreeMask]:
    """The verify forward's rotary positions [B, N] (pos + depth) and its mask: rows at slots pos + row."""
    depth, bits = structure(parents, steps)
    slots = pos[:, None] + torch.arange(parents.shape[1], device=pos.device)
    return pos[:, None] + depth, TreeMask(slots, pos, bits)


def expand(
    draft: Eagle3Draft,
    h: torch.Tensor,  # [B, 1, H] the draft's hidden state at the root's row
    position: torch.Tensor,  # [B, 1] that row's position p: its children sit at p + 2 (as in the chain)
    cache: KVLayer,
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    kv_len: int,
    shape: TreeShape,
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # the draft's logits [B, T, V_draft]
    # from its hidden states [B, T, H] at T frontier entries, and the entries' paths [B, T, D] (target ids,
    # from the root's first child: a row's rules mask them, structured/draft_masks.py)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafts the tree and keeps its best nodes: their tokens [B, N - 1] (target ids), per row the row of
    its parent [B, N], and their scores [B, N - 1] (cumulative log-probabilities)."""
    k, b = shape.topk, h.shape[0]
    device = h.device
    logp = logits_of(h, position[:, None, :0])[:, 0].log_softmax(-1)  # [B, V_draft]
    score, choice = logp.topk(k, dim=-1)  # [B, k]
    scores, ids, parent = [score], [choice], [torch.full((b, k), -1, device=device, dtype=torch.int64)]
    frontier = torch.arange(k, device=device).expand(b, k)  # pool indices of the frontier
    hidden = h.expand(b, k, h.shape[-1])  # the frontier's parents' hidden states
    base = position[:, 0] + 1  # the first draft-cache slot the frontier may use (past the root's row)
    bits = torch.zeros(b, k, dtype=torch.int64, device=device)  # the frontier's ancestors' slots
    paths = position[:, None, :0].expand(b, k, 0)  # [B, k, step - 1]: the frontier's ancestors' tokens
    for step in range(1, shape.steps):
        slots = base[:, None] + (step - 1) * k + torch.arange(k, device=device)  # [B, k]
        bits = bits | (1 << (slots - base[:, None]))
        tokens = draft.to_target(choice)  # [B, k]
        paths = torch.cat((paths, tokens[..., None]), dim=-1)  # [B, k, step]: with the frontier's own
        out = draft(tokens, hidden, (position + step).expand(b, k), cache, tables, kv_len,
                    TreeMask(slots, base, bits))  # fmt: skip
        logp = logits_of(out, paths).log_softmax(-1)  # [B, k, V_draft]
        child_score, child = logp.topk(k, dim=-1)  # [B, k, k]
        child_score = score[:, :, None] + child_score
        offset = k + (step - 1) * k * k  # pool index of this step's first child
        scores.append(child_score.flatten(1))
        ids.append(child.flatten(1))
        parent.append(frontier[:, :, None].expand(b, k, k).flatten(1))
        # the next frontier: the best k children; [B, k * k] index i is child i % k of frontier entry i // k
        score, best = child_score.flatten(1).sort(dim=-1, descending=True, stable=True)  # ties: earlier first
        score, best = score[:, :k], best[:, :k]
        choice = child.flatten(1).gather(1, best)
        frontier = offset + best
        hidden = out.gather(1, (best // k)[..., None].expand(b, k, out.shape[-1]))
        bits = bits.gather(1, best // k)
        paths = paths.gather(1, (best // k)[..., None].expand(b, k, step))
    pool_scores, pool_ids, pool_parent = (torch.cat(t, dim=1) for t in (scores, ids, parent))
    # the best nodes - 1, earlier entries first among equal scores (a parent before its child)
    keep = pool_scores.sort(dim=1, descending=True, stable=True).indices[:, : shape.nodes - 1]
    keep = keep.sort(dim=1).values  # [B, N - 1] by pool index: parents first
    tokens, kept_scores = draft.to_target(pool_ids.gather(1, keep)), pool_scores.gather(1, keep)
    # the parent's row: 0 for the root, else 1 + its place among the kept (pool indices ascending)
    up = pool_parent.gather(1, keep)  # [B, N - 1] pool index or -1
    row_of = torch.zeros(b, pool_scores.shape[1], dtype=torch.int64, device=device)
    row_of.scatter_(1, keep, torch.arange(1, shape.nodes, device=device).expand(b, -1))
    parents = torch.where(up < 0, 0, row_of.gather(1, up.clamp_min(0)))
    root = torch.zeros(b, 1, dtype=torch.int64, device=device)
    return tokens, torch.cat((root, parents), dim=1), kept_scores


def chain_into_tree(
    pending: torch.Tensor,  # [B, N] the root, then the tree's nodes (parents before children)
    parents: torch.Tensor,  # [B, N]
    chain: torch.Tensor,  # [B, K] a chain of proposals after the root (n-gram lookup's)
) -> tuple[torch.Tensor, torch.Tensor]:  # pending [B, N], parents [B, N]
    """The tree with the chain in front: rows 1..c the chain (c = min(K, N - 1), each row the child of the
    one before), then the tree's first N - 1 - c nodes, their parents moved down by c (propose_tree keeps its
    nodes level by level, parents first, so its first rows hold their own parents). N 6, chain [x, y], nodes
    [a, b, c, d, e] with parents [0, 0, 1, 1, 2]: pending [r, x, y, a, b, c], parents [0, 0, 1, 0, 0, 3]."""
    b, n = pending.shape
    c = min(chain.shape[1], n - 1)
    rest = n - 1 - c
    tokens = torch.cat((pending[:, :1], chain[:, :c], pending[:, 1 : 1 + rest]), dim=1)
    chained = torch.arange(c, device=pending.device).expand(b, c)  # row i's parent: row i - 1
    moved = parents[:, 1 : 1 + rest]
    moved = torch.where(moved > 0, moved + c, 0)
    return tokens, torch.cat((parents[:, :1], chained, moved), dim=1)


def keep_path(
    layers: list[KVLayer],  # per layer k, v [blocks, kv_heads, BLOCK, head_dim]
    tables: torch.Tensor,  # [B, blocks per sequence] int32
    pos: torch.Tensor,  # [B] the root's slot
    path: torch.Tensor,  # [B, steps + 1] accepted rows, from the root
) -> None:
    """Moves the accepted rows' keys and values from their slots (pos + row) to their positions (pos + d),
    all read before any is written: path [0, 2, 5] at pos 40 copies slots 40, 42, 45 to 40, 41, 42 (slot 42
    is read before it is overwritten). Entries past the accepted ones land past the new position, unseen."""
    src = pos[:, None] + path  # [B, D + 1]
    dst = pos[:, None] + torch.arange(path.shape[1], device=path.device)
    heads = torch.arange(layers[0][0].shape[1], device=path.device)
    # (block, head, row) per position, broadcast to [B, D + 1, heads] (as Attention._write indexes)
    src_at, dst_at = ((tables.gather(1, p // BLOCK).long()[:, :, None], heads, (p % BLOCK)[:, :, None])
                      for p in (src, dst))  # fmt: skip
    for k, v in layers:
        for store in (k, v):
            store.index_put_(dst_at, store[src_at])
