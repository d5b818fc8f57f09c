"""Sampling under a grammar follows the masked target distribution, with speculation too: the first three
tokens of a 12-token vocabulary ('a' .. 'l', one letter each) under the regex [a-f][a-f][g-l][a-l]*, their
exact marginals computed from the target (its logits masked, then softmax) and compared by chi-square, as
tests/test_spec_sampling.py does without a grammar. The drafts are unconstrained: a draft the grammar
refuses has target probability 0 at its row, so rejection sampling never keeps it. The same under token
controls: a fresh random logit_bias and allowed_token_ids, added to the target's logits (and the draft's)."""

from __future__ import annotations

import pytest
import torch
from test_spec_sampling import PROMPT, VOCAB, chi2, chi2_critical, tiny_vocab_pair  # noqa: F401

from redline import LLM, SamplingParams, StructuredOutputs

pytest.importorskip("xgrammar")

REGEX = "[a-f][a-f][g-l][a-l]*"
OFF = float("-inf")
IDS = torch.arange(VOCAB)
# what the regex adds to the logits of tokens 1, 2, 3: -inf where it refuses
REGEX_ROWS = [torch.where(IDS < 6, 0.0, OFF), torch.where(IDS < 6, 0.0, OFF), torch.where(IDS >= 6, 0.0, OFF)]


def shaped_marginals(model, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P(x2) [V], P(x3) [V] and P(x2, x3) [V, V] when token i is sampled from the target's distribution
    with rows[i] [V] added to its logits (temperature 1)."""

    def next_probs(prefixes: torch.Tensor, row: torch.Tensor) -> torch.Tensor:  # [N, T] -> [N, V]
        n = prefixes.shape[0]
        with torch.no_grad():
            hidden, _ = model(prefixes, torch.arange(prefixes.shape[1]).expand(n, -1))
        return (model.logits(hidden[:, -1]) + row).softmax(-1)

    p1 = next_probs(torch.tensor([PROMPT]), rows[0])[0]
    pre2 = torch.cat((torch.tensor(PROMPT).expand(VOCAB, -1), IDS[:, None]), dim=1)  # [V, 4]
    joint12 = p1[:, None] * next_probs(pre2, rows[1])
    pre3 = torch.cat((pre2.repeat_interleave(VOCAB, 0), IDS.repeat(VOCAB)[:, None]), dim=1)  # [V*V, 5]
    joint123 = (joint12.reshape(-1, 1) * next_probs(pre3, rows[2])).reshape(VOCAB, VOCAB, VOCAB)
    return joint12.sum(0), joint123.sum((0, 1)), joint123.sum(0)


def controls(control: str) -> tuple[dict, list[torch.Tensor]]:
    """SamplingParams' fields and the rows they add to the logits of tokens 1, 2, 3: the regex, or a fresh
    random logit_bias in [-2, 2] over 9 random allowed_token_ids."""
    if control == "regex":
        return dict(structured=StructuredOutputs(regex=REGEX)), REGEX_ROWS
    allowed = torch.randperm(VOCAB)[:9]
    bias = torch.rand(VOCAB) * 4 - 2
    row = torch.full((VOCAB,), OFF).index_copy(0, allowed, bias[allowed])
    fields = dict(allowed_token_ids=allowed.tolist(), logit_bias=dict(enumerate(bias.tolist())))
    return fields, [row] * 3


@pytest.mark.parametrize("control", ["regex", "bias"])
@pytest.mark.parametrize("drafting", ["none", "eagle3", "tree"])
def test_sampled_tokens_follow_the_shaped_target_distribution(tiny_vocab_pair, drafting, control):  # noqa: F811
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
    fields, rows = controls(control)
    p2, p3, p23 = shaped_marginals(llm.model, rows)
    failures = []
    for _ in range(2):  # a second fresh sample where the first fails: a false alarm twice is ~1e-5
        n, base = 3000, torch.randint(0, 2**40, (1,)).item()
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=base + i, **fields) for i in range(n)]
        completions = llm.generate([PROMPT] * n, params)
        tokens = torch.tensor([c.token_ids for c in completions])  # [n, 3]
        for position in range(3):
            assert (rows[position][tokens[:, position]] > OFF).all(), "a token the controls refuse came out"
        if drafting != "none":
            rates = torch.tensor([c.acceptance_rates[0] for c in completions])
            assert 0.05 < rates.mean() < 0.95, "both the accept and the reject path must be exercised"
        failures = chi2_failures(tokens, p2, p3, p23)
        if not failures:
            return
    raise AssertionError("; ".join(failures))


def chi2_failures(tokens: torch.Tensor, p2: torch.Tensor, p3: torch.Tensor, p23: torch.Tensor) -> list[str]:
    """tokens [n, 3] against the marginals of tokens 2, 3 and the pair: the comparisons that fail (each
    falsely fails 0.1% of the time)."""
    failures = []
    for position, probs in ((1, p2), (2, p3)):
        stat, df = chi2(torch.bincount(tokens[:, position], minlength=VOCAB), probs)
        if stat >= chi2_critical(df):
            failures.append(f"token {position + 1}: chi2 {stat:.1f} (df {df})")
    stat, df = chi2(torch.bincount(tokens[:, 1] * VOCAB + tokens[:, 2], minlength=VOCAB**2), p23.flatten())
    if stat >= chi2_critical(df):
        failures.append(f"tokens 2 and 3 together: chi2 {stat:.1f} (df {df})")
    return failures
