"""N-gram (prompt lookup) drafting on the device: each slot's own tokens, prompt and output, propose the
next K by finding the latest earlier occurrence of the sequence's last n tokens and copying what followed.

Every slot's tokens live in `history` [S, L] by position (the state's; written when a request is set up and
by every emission). Matching is static in shape: for each candidate end j < t (t the last known position)
it compares history[j - i] with history[t - i] for i < n, for every n in [n_min, n_max] at once, so it
compiles into the one-graph step and runs with no host sync. The longest n with a match wins, and among
its matches the latest.

Example, n in 2..3, a row whose tokens are [a b c d a b c] (t = 6): the suffix [a b c] (n = 3) also ends
at j = 2, so the proposals copy what followed it: history[3], history[4], ... = [d a b]. The copy runs on
with the same period d = t - j (here 4), past t into its own proposals: with [x y x y] (t = 3, n = 2, j = 1,
d = 2), K = 3 proposes history[2], history[3], then history[2] again: [x y x].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramRange:
    """vLLM's prompt_lookup_min / prompt_lookup_max: the suffix lengths tried, longest first."""

    min_n: int
    max_n: int


def record(
    history: torch.Tensor,  # [B, L] each row's tokens by position, written in place
    tokens: torch.Tensor,  # [B, T] emitted tokens: tokens[:, j] goes to position after[:, j] + 1
    after: torch.Tensor,  # [B, T] the positions they follow
    new: torch.Tensor,  # [B, T] bool: the tokens really emitted (the first n_acc + 1 of active rows)
) -> None:
    """Writes the new tokens into their rows' history; the rest keep what they held. Positions past
    the history's end are never new (the cache holds every position a step writes)."""
    where = (after + 1).clamp_max(history.shape[1] - 1)
    history.scatter_(1, where, torch.where(new, tokens, history.gather(1, where)))


def propose(
    history: torch.Tensor,  # [B, L] tokens by position, known up to `last`
    last: torch.Tensor,  # [B] the position of each row's last known token
    k: int,
    lookup: NgramRange,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns drafts [B, K] and found [B] bool (a row without a match proposes its last token K times:
    whatever it proposes stays lossless, verification decides)."""
    b, length = history.shape
    device = history.device
    ends = torch.arange(length, device=device)  # candidate match ends j
    t = last[:, None]  # [B, 1]
    suffix_at = (t - torch.arange(lookup.max_n, device=device)).clamp_min(0)  # [B, N]: t, t - 1, ...
    suffix = history.gather(1, suffix_at)  # [B, N]
    best = torch.full((b,), -1, dtype=torch.int64, device=device)  # the chosen match end, -1 for none
    run = torch.ones_like(history, dtype=torch.bool)  # [B, L]: history[j - i] == suffix[i] for all i < n
    for n in range(1, lookup.max_n + 1):
        i = n - 1  # history[j - i] as a row shifted right by i: [h0 h1 h2] -> i = 1 -> [-1 h0 h1]
        shifted = torch.cat(
            (torch.full((b, i), -1, dtype=history.dtype, device=device), history[:, : length - i]), 1
        )
        run = run & (shifted == suffix[:, i : i + 1])
        if n < lookup.min_n:
            continue
        # a match ends before t, starts at position 0 or later, and the suffix itself fits (n <= t)
        valid = run & (ends < t) & (ends >= i) & (t >= n)
        latest = torch.where(valid, ends, -1).amax(dim=1)  # [B]
        best = torch.where(latest >= 0, latest, best)  # a longer n overrides a shorter one
    found = best >= 0
    period = torch.where(found, last - best, 1)[:, None]  # [B, 1]; no match: repeat the last token
    start = torch.where(found, best + 1, last)[:, None]
    # proposal m copies history[start + m mod period]: period 2, start 2 -> positions 2, 3, 2, 3, ...
    source = start + torch.arange(k, device=device) % period  # [B, K], every entry <= t
    return history.gather(1, source), found
