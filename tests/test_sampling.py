"""Token selection: filters on hand-built logits, exact distributions, seeds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from redline import sampling
from redline.sampling import (
    SamplingParams,
    SamplingTensors,
    filtered_probs,
    open_unit,
    sample_from,
    uniform,
)
from redline.speculative.verify import rejection_verify


def tensors(temperature, top_k=0, top_p=1.0, seed=0, rows=1, min_p=0.0) -> SamplingTensors:
    return dataclasses.replace(
        SamplingTensors.zeros(rows, torch.device("cpu")),
        temperature=torch.full((rows,), float(temperature)),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), float(top_p)),
        seed=torch.full((rows,), seed, dtype=torch.int64),
        min_p=torch.full((rows,), float(min_p)),
    )


def test_filters_on_hand_built_logits():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()[None, None]  # probs 0.4, 0.3, 0.2, 0.1
    plain = filtered_probs(logits, tensors(1.0))
    torch.testing.assert_close(plain[0, 0], torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top_k = filtered_probs(logits, tensors(1.0, top_k=2))
    torch.testing.assert_close(top_k[0, 0], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    # top_p 0.5: 0.4 alone is not enough, 0.4 + 0.3 is
    top_p = filtered_probs(logits, tensors(1.0, top_p=0.5))
    torch.testing.assert_close(top_p[0, 0], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    top_p_exact = filtered_probs(logits, tensors(1.0, top_p=0.4))  # mass before token 1 is 0.4, not < 0.4
    torch.testing.assert_close(top_p_exact[0, 0], torch.tensor([1.0, 0, 0, 0]))
    hot = filtered_probs(logits, tensors(0.5))  # T = 0.5 squares the probabilities
    torch.testing.assert_close(hot[0, 0], torch.tensor([16, 9, 4, 1]) / 30.0)
    greedy = filtered_probs(logits, tensors(0.0))
    torch.testing.assert_close(greedy[0, 0], torch.tensor([1.0, 0, 0, 0]))
    # min_p 0.4: keep what reaches 0.4 x 0.4 = 0.16; after top_p 0.5 (0.4, 0.3 kept), min_p 0.8: 0.32
    min_p = filtered_probs(logits, tensors(1.0, min_p=0.4))
    torch.testing.assert_close(min_p[0, 0], torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))
    torch.testing.assert_close(filtered_probs(logits, tensors(1.0, top_p=0.5, min_p=0.8))[0, 0],
                               torch.tensor([1.0, 0, 0, 0]))  # fmt: skip


def test_filters_keep_vocab_order_on_shuffled_logits():
    logits = torch.randn(3, 2, 50)
    probs = filtered_probs(logits, tensors(0.7, top_k=5, rows=3))
    kept = probs > 0
    assert (kept.sum(-1) == 5).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(-1, logits.topk(5).indices, True))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 2))


def test_sampled_frequencies_match_the_distribution():
    """Chi-square goodness of fit over 30,000 draws of a fresh random 6-way distribution.
    Critical value 20.52 is the 0.999 quantile of chi2(5 dof): this test falsely fails 0.1% of the time."""
    probs = torch.rand(6) + 0.05
    probs /= probs.sum()
    n = 30_000
    seed = torch.randint(0, 2**32, (1,))
    positions = torch.arange(n)[None]  # one draw per position
    tokens = sample_from(probs.expand(1, n, 6), seed, positions, stream=0)[0]
    counts = torch.bincount(tokens, minlength=6).double()
    expected = probs.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.52, f"chi2 {chi2:.1f}; counts {counts.tolist()} expected {expected.tolist()}"


def test_draws_depend_only_on_seed_position_and_stream():
    seed = torch.tensor([5, 5, 6])
    pos = torch.tensor([[10], [10], [10]])
    u = uniform(seed, pos, stream=0, width=100)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u[0], uniform(seed, pos, stream=1, width=100)[0])
    assert not torch.equal(u[0], uniform(seed, pos + 1, stream=0, width=100)[0])
    assert u.min() > 0 and u.max() < 1


def test_draws_stay_inside_the_open_interval_at_the_extreme_keys(monkeypatch):
    """The largest 32-bit keys once rounded to u = 1 (noise 0: a greedy row's race then took a random
    token); each key maps inside (0, 1), the largest strictly below 1, and sample_from's race over a
    one-hot picks its token when every draw is that largest one."""
    keys = torch.tensor([0, 1, 511, 2**31, 2**32 - 512, 2**32 - 256, 2**32 - 1])
    u = open_unit(keys)
    assert u.min() > 0 and u.max() < 1 and u[-1] == 1 - 2**-24
    one_hot = torch.zeros(1, 1, 6)
    one_hot[..., 4] = 1.0
    monkeypatch.setattr(sampling, "uniform", lambda seed, position, stream, width: u[-1].expand(1, 1, width))
    assert sample_from(one_hot, torch.tensor([0]), torch.tensor([[0]]), stream=0).item() == 4


def test_greedy_rows_ignore_noise_and_sampling_rows_follow_seed():
    logits = torch.randn(4, 1, 30)
    t = tensors(1.0, rows=4)
    t.temperature[0] = 0.0
    t.seed[:] = torch.tensor([1, 2, 2, 3])
    pos = torch.full((4, 1), 7)
    no_drafts, no_q = torch.zeros(4, 0, dtype=torch.int64), torch.zeros(4, 0, 30)
    emit = lambda: rejection_verify(filtered_probs(logits, t), no_q, no_drafts, t.seed, pos)[0]
    tokens = emit()  # a first token: the emitting path of every prefill and step (speculative/emit.py)
    assert tokens[0, 0] == logits[0, 0].argmax()
    logits[2] = logits[1]
    again = emit()
    assert again[1, 0] == again[2, 0]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(stop=[""]),
        dict(seed="x"),
    ],
)
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
