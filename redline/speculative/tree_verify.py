"""Verification of a draft tree (speculative/tree.py) against the target's distributions at its rows: the
longest accepted path from the root, walked level by level without branches.

Both functions return path [B, steps + 1] (the rows accepted, from the root; after the walk stops, its
last row repeated), n_acc [B] and emitted [B, steps + 1]: the first n_acc + 1 are new (the accepted nodes'
tokens, then the target's correction or bonus token), as the chain's verify.py returns them.
"""

from __future__ import annotations

import torch

from redline.sampling import sample_from, uniform
from redline.speculative.verify import ACCEPT_STREAM

# accept draws of the c-th child: stream ACCEPT_STREAM + 16 c (c = 0 is the chain's); 16 apart, past the
# streams other uses take (0 emit, 1 accept, 2 draft)
CHILD_STREAMS = 16


def _children(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:  # [B, N], [B] -> [B, N] bool
    """Rows whose parent is `node` (the root, row 0, is nobody's child)."""
    rows = torch.arange(parents.shape[1], device=parents.device)
    return (parents == node[:, None]) & (rows > 0)


def _first_row(mask: torch.Tensor) -> torch.Tensor:  # [B, N] bool -> [B] int64
    """The first row set in each mask, 0 when none: [F, T, T] -> 1. A sum over a one-hot, not argmax: on
    [B, 4] masks inductor's vectorized CPU argmax (torch 2.13) returned indices past the last row."""
    rows = torch.arange(mask.shape[1], device=mask.device)
    return ((mask & (mask.cumsum(dim=1) == 1)) * rows).sum(dim=1)


def greedy_tree_verify(
    choice: torch.Tensor,  # [B, N] the target's argmax after each row
    tokens: torch.Tensor,  # [B, N] the rows' tokens (row 0 the root)
    parents: torch.Tensor,  # [B, N]
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the root, step to the child holding the target's choice while there is one. Steps 2, root
    choice 7, children of the root [5, 7] at rows 1, 2 -> row 2; its choice 9, its children [3] -> stop:
    path [0, 2, 2], n_acc 1, emitted [7, 9, 9] (the first n_acc + 1 new). Every emitted token is a target
    argmax: the output equals plain greedy decoding whatever the tree holds."""
    node = torch.zeros(tokens.shape[0], dtype=torch.int64, device=tokens.device)
    path, n_acc = [node], torch.zeros_like(node)
    for _ in range(steps):
        want = choice.gather(1, node[:, None])  # [B, 1]
        # siblings may share a token (copies of the bonus token, an n-gram chain beside the tree's nodes):
        # the first matching row is taken
        match = _children(parents, node) & (tokens == want)
        found = match.any(dim=1) & (n_acc == len(path) - 1)  # still walking
        node = torch.where(found, _first_row(match), node)
        n_acc = n_acc + found
        path.append(node)
    path = torch.stack(path, dim=1)
    return path, n_acc, choice.gather(1, path)


def sampled_tree_verify(
    p: torch.Tensor,  # [B, N, V] target probabilities at each row (penalties and filters applied)
    tokens: torch.Tensor,  # [B, N]
    parents: torch.Tensor,  # [B, N]
    steps: int,
    topk: int,  # the most children a node has (topk, and 1 more beside n-gram lookup: chain_into_tree)
    seed: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, N] each row's position (pos + depth)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft rejection sampling with deterministic drafts (SpecInfer, EAGLE-2): at a node with target
    distribution P and children c1, c2, ... try each in turn: accept c_i with probability R(c_i) / R(all),
    R the residual (P with the children rejected so far zeroed); on acceptance move to c_i, else zero it.
    When every child is rejected, sample the correction from R. Each level's token is thus a draw from P:
    the emitted tokens are distributed as tokens sampled one by one from the target."""
    b, n, vocab = p.shape
    most = min(topk, n - 1)  # children a node can have among the N - 1 rows
    node = torch.zeros(b, dtype=torch.int64, device=p.device)
    path, n_acc = [node], torch.zeros_like(node)
    # where each row stopped: its residual and the position its correction takes (drawn once, at the end)
    stopped, stopped_at = p[:, 0], torch.zeros_like(node)[:, None]
    walking = torch.ones(b, dtype=torch.bool, device=p.device)
    for _ in range(steps + 1):
        residual = p.gather(1, node[:, None, None].expand(b, 1, vocab))[:, 0]  # [B, V]
        here = positions.gather(1, node[:, None]) + 1  # [B, 1] where the next token goes
        children = _children(parents, node) & walking[:, None]  # [B, N]
        rank = children.cumsum(dim=1) * children  # the c-th child has rank c + 1
        moved = torch.zeros_like(walking)
        nxt = node
        for c in range(most if len(path) <= steps else 0):  # past the last level: no children
            child = rank == c + 1  # [B, N]
            has = child.any(dim=1) & ~moved
            row = _first_row(child)
            token = tokens.gather(1, row[:, None])  # [B, 1]
            mass = residual.sum(dim=1, keepdim=True)
            u = uniform(seed, here, ACCEPT_STREAM + CHILD_STREAMS * c)  # [B, 1]
            accept = has & (u * mass < residual.gather(1, token))[:, 0]
            nxt = torch.where(accept, row, nxt)
            moved = moved | accept
            rejected = (has & ~accept)[:, None]
            residual = residual.scatter(1, token, torch.where(rejected, 0.0, residual.gather(1, token)))
        stops = walking & ~moved
        stopped = torch.where(stops[:, None], residual, stopped)
        stopped_at = torch.where(stops[:, None], here, stopped_at)
        n_acc = n_acc + moved
        walking = moved
        node = nxt
        if len(path) <= steps:
            path.append(node)
    path = torch.stack(path, dim=1)  # [B, steps + 1]
    # the accepted nodes' tokens, then the final token at n_acc: [5, 7, 7] n_acc 1, final 3 -> [5, 3, 7]
    final = sample_from(stopped[:, None], seed, stopped_at, stream=0)[:, 0]  # one vocabulary-wide draw
    emitted = torch.cat((tokens.gather(1, path[:, 1:]), final[:, None]), dim=1)
    return path, n_acc, emitted.scatter(1, n_acc[:, None], final[:, None])
