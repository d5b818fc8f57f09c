"""Sampling under a grammar follows the masked target distribution, with speculation too: the first three
tokens of a 12-token vocabulary ('a' .. 'l', one letter each) under the regex [a-f][a-f][g-l][a-l]*, their
exact marginals computed from the target (its logits masked, then softmax) and compared by chi-square, as
tests/test_spec_sampling.py does without a grammar. The drafts are unconstrained: a draft the grammar
refuses has target probability 0 at its row, so rejection sampling never keeps it."""

from __future__ import annotations

import pytest
import torch
from test_spec_sampling import PROMPT, VOCAB, chi2, chi2_critical, tiny_vocab_pair  # noqa: F401

from redline import LLM, SamplingParams, StructuredOutputs

pytest.importorskip("xgrammar")

REGEX = "[a-f][a-f][g-l][a-l]*"
ALLOWED = [torch.arange(VOCAB) < 6, torch.arange(VOCAB) < 6, torch.arange(VOCAB) >= 6]  # tokens 1, 2, 3


def masked_marginals(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P(x2) [V], P(x3) [V] and P(x2, x3) [V, V] when each token is sampled from the target's distribution
    over the tokens the regex allows there (temperature 1)."""

    def next_probs(prefixes: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:  # [N, T] -> [N, V]
        n = prefixes.shape[0]
        with torch.no_grad():
            hidden, _ = model(prefixes, torch.arange(prefixes.shape[1]).expand(n, -1))
        logits = model.logits(hidden[:, -1]).masked_fill(~allowed, float("-inf"))
        return logits.softmax(-1)

    ids = torch.arange(VOCAB)
    p1 = next_probs(torch.tensor([PROMPT]), ALLOWED[0])[0]
    pre2 = torch.cat((torch.tensor(PROMPT).expand(VOCAB, -1), ids[:, None]), dim=1)  # [V, 4]
    joint12 = p1[:, None] * next_probs(pre2, ALLOWED[1])
    pre3 = torch.cat((pre2.repeat_interleave(VOCAB, 0), ids.repeat(VOCAB)[:, None]), dim=1)  # [V*V, 5]
    joint123 = (joint12.reshape(-1, 1) * next_probs(pre3, ALLOWED[2])).reshape(VOCAB, VOCAB, VOCAB)
    return joint12.sum(0), joint123.sum((0, 1)), joint123.sum(0)


@pytest.mark.parametrize("drafting", ["none", "eagle3", "tree"])
def test_sampled_tokens_follow_the_masked_target_distribution(tiny_vocab_pair, drafting):  # noqa: F811
    target_dir, draft_dir = tiny_vocab_pair
    spec = {
        "none": {},
        "eagle3": dict(draft=draft_dir, num_draft_tokens=2, adaptive_draft_length=False),
        "tree": dict(
            draft=draft_dir,
            num_draft_tokens=2,
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=10,
            adaptive_draft_length=False,
        ),
    }[drafting]
    llm = LLM(target_dir, dtype="float32", max_batch=32, **spec)
    n, base = 3000, torch.randint(0, 2**40, (1,)).item()
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=base + i,
                             structured=StructuredOutputs(regex=REGEX)) for i in range(n)]  # fmt: skip
    completions = llm.generate([PROMPT] * n, params)
    tokens = torch.tensor([c.token_ids for c in completions])  # [n, 3]
    for position in range(3):
        assert ALLOWED[position][tokens[:, position]].all(), "a token the grammar refuses was emitted"
    if drafting != "none":
        rates = torch.tensor([c.acceptance_rates[0] for c in completions])
        assert 0.05 < rates.mean() < 0.95, "both the accept and the reject path must be exercised"
    p2, p3, p23 = masked_marginals(llm.model)
    for position, probs in ((1, p2), (2, p3)):
        stat, df = chi2(torch.bincount(tokens[:, position], minlength=VOCAB), probs)
        assert stat < chi2_critical(df), f"token {position + 1}: chi2 {stat:.1f} (df {df})"
    stat, df = chi2(torch.bincount(tokens[:, 1] * VOCAB + tokens[:, 2], minlength=VOCAB**2), p23.flatten())
    assert stat < chi2_critical(df), f"tokens 2 and 3 together: chi2 {stat:.1f} (df {df})"
