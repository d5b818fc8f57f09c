"""Verification of K draft tokens against the target's K + 1 distributions, per row, without branches.

Both functions return emitted [B, K + 1] and n_acc [B]: the first n_acc + 1 entries of a row are its
new tokens (n_acc accepted drafts, then the target's correction or bonus token); the rest is padding.
"""

from __future__ import annotations

import torch

from redline.sampling import sample_from, uniform

ACCEPT_STREAM = 1  # random stream of the accept/reject draws (stream 0 picks emitted tokens)


def accepted_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """accepted [B, K] bool -> leading run length [B]: the first position not accepted, K for rows that
    accept all. [1, 1, 0, 1] -> positions [4, 4, 2, 4] (accepted ones pushed to K) -> min -> 2. A plain
    min the compiler fuses: cumprod was a library call in the middle of the step, and inductor's
    vectorized argmin over a uint8 [16, 9] returned 0 for every row on AVX2 CPUs (torch 2.13)."""
    k = accepted.shape[1]
    if k == 0:  # no drafts (plain decoding, a prefill's first token): nothing accepted
        return torch.zeros(accepted.shape[0], dtype=torch.int64, device=accepted.device)
    positions = torch.arange(k, device=accepted.device).expand_as(accepted)
    return torch.where(accepted, k, positions).amin(dim=1)


def greedy_verify(choice: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choice [B, K + 1] the target's argmax after each pending token, drafts [B, K].

    drafts [5, 7, 9], target choices [5, 7, 2, 4] (choice j follows pending token j): 5 and 7 match,
    9 != 2, so n_acc = 2 and the row emits 5, 7, 2. Every emitted token is a target argmax, so the
    output equals plain greedy decoding whatever the draft proposes.
    """
    return choice, accepted_prefix(drafts == choice[:, :-1])


def rejection_verify(
    p: torch.Tensor,  # [B, K + 1, V] target probabilities (temperature / top-k / top-p applied)
    q: torch.Tensor,  # [B, K, V] draft probabilities the drafts were sampled from, on the target vocab
    drafts: torch.Tensor,  # [B, K]
    seed: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B, K + 1] position of each pending token; draft j sits at positions[:, j + 1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept draft d with probability min(1, p(d) / q(d)); at the first rejection
    sample from normalize(max(p - q, 0)); after K acceptances sample the bonus token from p. The emitted
    tokens are distributed exactly as tokens sampled one by one from p."""
    k, vocab = drafts.shape[1], p.shape[-1]
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, K]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    u = uniform(seed, positions[:, 1:], ACCEPT_STREAM)  # [B, K]
    n_acc = accepted_prefix(u * q_draft < p_draft)  # u < p / q, without dividing by q
    residual = (p[:, :k] - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # mass 0 means p == q there: that draft is always accepted and its residual never sampled
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :k])
    final_dist = torch.cat((residual, p[:, k:]), dim=1)  # row j: where to sample if the first rejection is j
    row = final_dist.gather(1, n_acc[:, None, None].expand(-1, 1, vocab))  # [B, 1, V]
    final_pos = positions.gather(1, n_acc[:, None]) + 1  # [B, 1]
    final = sample_from(row, seed, final_pos, stream=0)  # [B, 1]
    # drafts [5, 7, 9], n_acc 1, final 3 -> [5, 7, 9, 3] -> scatter at 1 -> [5, 3, 9, 3]; first 2 are real
    emitted = torch.cat((drafts, final), dim=1).scatter(1, n_acc[:, None], final)
    return emitted, n_acc
