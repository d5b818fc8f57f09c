"""Acceptance math on hand-built logits and tokens."""

from __future__ import annotations

import pytest
import torch

from redline.speculative.verify import accepted_prefix, greedy_verify, rejection_verify


def one_hot_logits(choices: list[list[int]], vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(choices), vocab).float() * 5.0


def test_accepted_prefix_counts_the_leading_run():
    accepted = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert accepted_prefix(accepted).tolist() == [2, 0, 4]


def test_greedy_verify_rows_are_independent():
    logits = one_hot_logits([[5, 7, 2, 4], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 7, 9], [1, 2, 3], [8, 9, 9]])
    emitted, n_acc = greedy_verify(logits.argmax(-1), drafts)
    assert n_acc.tolist() == [2, 3, 0]
    assert emitted.tolist() == [[5, 7, 2, 4], [1, 2, 3, 4], [9, 9, 9, 9]]


def test_rejection_verify_with_certain_outcomes():
    """p puts all mass on the draft (always accepted) or none on it (always rejected, residual = p)."""
    vocab = 6
    p = torch.zeros(2, 3, vocab)
    p[0, 0, 1] = p[0, 1, 2] = p[0, 2, 3] = 1.0  # row 0: target wants 1, 2 then bonus 3
    p[1, 0, 4] = 1.0  # row 1: target wants 4 first
    p[1, 1:, 0] = 1.0
    q = torch.full((2, 2, vocab), 1.0 / vocab)
    drafts = torch.tensor([[1, 2], [5, 5]])
    positions = torch.tensor([[10, 11, 12], [3, 4, 5]])
    emitted, n_acc = rejection_verify(p, q, drafts, torch.tensor([1, 2]), positions)
    assert n_acc.tolist() == [2, 0]
    assert emitted[0].tolist() == [1, 2, 3]
    assert emitted[1, 0].item() == 4  # sampled from max(p - q, 0) normalised = one-hot on 4


def test_rejection_verify_acceptance_rate_is_min_one_p_over_q():
    """One draft position, p(d) = 0.3, q(d) = 0.6: accepted with probability 0.5 over fresh seeds.
    20,000 draws: standard deviation 0.0035, so |rate - 0.5| < 0.02 fails with probability < 1e-8."""
    n, vocab = 20_000, 4
    p = torch.tensor([0.3, 0.7, 0.0, 0.0]).expand(n, 2, vocab).clone()
    q = torch.tensor([0.6, 0.2, 0.2, 0.0]).expand(n, 1, vocab).clone()
    drafts = torch.zeros(n, 1, dtype=torch.int64)
    seeds = torch.randint(0, 2**32, (n,))
    emitted, n_acc = rejection_verify(p, q, drafts, seeds, torch.tensor([[0, 1]]).expand(n, -1))
    rate = n_acc.float().mean().item()
    assert abs(rate - 0.5) < 0.02
    rejected = emitted[n_acc == 0, 0]
    assert (rejected == 1).all()  # residual max(p - q, 0) = [0, 0.5, 0, 0] -> token 1 only


@pytest.mark.parametrize("rows, k", [(1, 3), (16, 8), (7, 31)])
def test_compiled_verification_equals_eager(rows, k):
    """Both chain verifications compiled (inductor, CPU) give the eager paths, every prefix length from none
    accepted to all: the first rejection is a min over positions, where inductor's vectorized argmin over
    a [16, 9] uint8 tensor returned 0 for every row on AVX2 CPUs, as its argmax twin returned indices past
    the end on trees' [B, 4] masks (test_tree.py); K = 31 is no multiple of a vector's width."""
    torch._dynamo.reset()
    vocab = 7
    greedy, sampled = (torch.compile(f, fullgraph=True) for f in (greedy_verify, rejection_verify))
    for _ in range(3):
        choice = torch.randint(0, vocab, (rows, k + 1))
        accepted = torch.randint(0, k + 1, (rows,))  # the leading run each row gets: 0 .. K
        drafts = torch.where(torch.arange(k) < accepted[:, None], choice[:, :k], (choice[:, :k] + 1) % vocab)
        for got, want in zip(greedy(choice, drafts), greedy_verify(choice, drafts), strict=True):
            assert torch.equal(got, want)
        assert torch.equal(greedy(choice, drafts)[1], accepted)
        p = torch.softmax(torch.randn(rows, k + 1, vocab) * 3, dim=-1)
        q = torch.softmax(torch.randn(rows, k, vocab) * 3, dim=-1)
        seed, positions = torch.randint(0, 2**31, (rows,)), torch.arange(k + 1).expand(rows, -1) + 9
        args = (p, q, drafts, seed, positions)
        for got, want in zip(sampled(*args), rejection_verify(*args), strict=True):
            assert torch.equal(got, want)
