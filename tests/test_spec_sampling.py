"""Speculative sampling is lossless: sampled tokens follow the target's exact distribution.

A 12-token vocabulary keeps exact distributions computable: the marginal of the 2nd and 3rd generated
tokens (both produced by verification steps with K = 2: accepted drafts, corrections or bonus tokens)
is summed over all prefixes with the target itself, and compared with a chi-square test.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config
from test_penalties import reference_penalized
from tokenizers import Tokenizer, models, pre_tokenizers

from redline import LLM, SamplingParams
from redline.sampling import SamplingTensors, filtered_probs
from redline.train.random_init import write_random_draft

VOCAB = 12
PROMPT = [1, 2, 3]
# strong enough that verifying a position without counting the drafts before it fails the test
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=2.0)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is the 0.999 normal quantile,
    so each comparison falsely fails about 0.1% of the time."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    target_dir = root / "target"
    # a fixed pair (seed 0) whose draft is accepted about a quarter of the time, so that both the accept
    # and the reject paths run; the sampling seeds are fresh in every run
    hf = build_hf_model(
        llama3_hf_config(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, initializer_range=0.3),
        seed=0,
    )
    hf.save_pretrained(target_dir, safe_serialization=True)
    words = {chr(ord("a") + i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(words, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(target_dir / "tokenizer.json"))
    (target_dir / "tokenizer_config.json").write_text(json.dumps({}))
    draft_dir = write_random_draft(target_dir, root / "draft", draft_vocab=8, std=0.3)
    return target_dir, draft_dir


def exact_marginals(
    model, temperature: float, top_p: float, min_p: float, penalties: dict[str, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P(x2) [V], P(x3) [V] and P(x2, x3) [V, V] under plain sampling from the filtered (and penalized)
    target distribution."""

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [N, T] -> [N, V]
        n = prefixes.shape[0]
        with torch.no_grad():
            hidden, _ = model(prefixes, torch.arange(prefixes.shape[1]).expand(n, -1))
        t = dataclasses.replace(
            SamplingTensors.zeros(n, torch.device("cpu")),
            temperature=torch.full((n,), temperature),
            top_p=torch.full((n,), top_p),
            min_p=torch.full((n,), min_p),
        )
        logits = model.logits(hidden[:, -1:])  # [N, 1, V]
        if penalties:  # the generated tokens follow the prompt
            logits = torch.stack([
                reference_penalized(row[0], PROMPT, prefix[len(PROMPT) :].tolist(), *penalties.values())
                for row, prefix in zip(logits, prefixes, strict=True)
            ])[:, None]  # fmt: skip
        return filtered_probs(logits, t)[:, 0]

    ids = torch.arange(VOCAB)
    p1 = next_probs(torch.tensor([PROMPT]))[0]  # [V]
    pre2 = torch.cat((torch.tensor(PROMPT).expand(VOCAB, -1), ids[:, None]), dim=1)  # [V, 4]
    p2_given_1 = next_probs(pre2)  # [V, V]
    joint12 = p1[:, None] * p2_given_1
    pre3 = torch.cat((pre2.repeat_interleave(VOCAB, 0), ids.repeat(VOCAB)[:, None]), dim=1)  # [V*V, 5]
    joint123 = (joint12.reshape(-1, 1) * next_probs(pre3)).reshape(VOCAB, VOCAB, VOCAB)
    return joint12.sum(0), joint123.sum((0, 1)), joint123.sum(0)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic over cells with expected count >= 5 (the rest pooled into one cell)."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat((counts[big].double(), counts[~big].double().sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize(
    ("top_p", "min_p", "penalties", "drafting"),
    [
        (1.0, 0.0, None, "eagle3"),
        (0.8, 0.0, None, "eagle3"),
        (1.0, 0.2, None, "eagle3"),
        (1.0, 0.0, PENALTIES, "eagle3"),
        (0.8, 0.0, None, "ngram"),
        (1.0, 0.0, PENALTIES, "eagle3+ngram"),
        (1.0, 0.0, PENALTIES, "eagle3, every third step drafting nothing"),
        (1.0, 0.0, None, "tree"),
        (0.8, 0.0, PENALTIES, "tree"),
        (1.0, 0.0, PENALTIES, "tree, every third step drafting nothing"),
        (1.0, 0.0, PENALTIES, "tree+ngram"),
    ],
)
def test_sampled_tokens_follow_the_target_distribution(tiny_vocab_pair, top_p, min_p, penalties, drafting):
    """With penalties, each verified position is penalized for the drafts before it (penalties.py). An
    n-gram proposal is deterministic (q a one-hot on it); beside the draft, rows with a 1-gram match take
    it and the others the draft's sampled proposals, so both kinds of q meet in one batch. Steps that draft
    nothing (adaptive draft length, forced here every third step) leave the bonus token pending as a
    deterministic proposal, which the next drafting step verifies (with a tree: copies of it as the tree's
    nodes). A draft tree's nodes are the draft's top tokens, tried in turn at each level (multi-draft
    rejection sampling: tree_verify.py), each row penalized for the nodes above it; beside n-gram lookup,
    rows with a 1-gram match put its chain ahead of the tree's best nodes."""
    target_dir, draft_dir = tiny_vocab_pair
    spec = {
        "eagle3": dict(draft=draft_dir),
        "ngram": dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=2),
        "eagle3+ngram": dict(draft=draft_dir, prompt_lookup_min=1, prompt_lookup_max=1),
        "tree": dict(draft=draft_dir, speculative_eagle_topk=3, speculative_num_draft_tokens=10),
        "tree+ngram": dict(
            draft=draft_dir,
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=10,
            prompt_lookup_min=1,
            prompt_lookup_max=1,
        ),
    }[drafting.split(",")[0]]
    alternate = ", every third step" in drafting
    llm = LLM(target_dir, dtype="float32", max_batch=32, num_draft_tokens=2, adaptive_draft_length=alternate,
              **spec)  # fmt: skip
    if alternate:
        steps = iter(range(10**6))
        llm.engine.scheduler.draft_length.choose = lambda rows, slots, seeded=False, logits=False: (
            2 * (next(steps) % 3 != 2)
        )
    n, temperature = 3000, 1.0
    base = torch.randint(0, 2**40, (1,)).item()
    params = [
        SamplingParams(
            max_tokens=3,
            temperature=temperature,
            top_p=top_p,
            min_p=min_p,
            seed=base + i,
            ignore_eos=True,
            **(penalties or {}),
        )
        for i in range(n)
    ]
    completions = llm.generate([PROMPT] * n, params)
    tokens = torch.tensor([c.token_ids for c in completions])  # [n, 3]
    rates = torch.tensor([c.acceptance_rates[0] for c in completions if c.acceptance_rates is not None])
    floor = 0.01 if drafting == "ngram" else 0.05  # n-gram: 1-grams of a 3-token prompt, seldom accepted
    assert floor < rates.mean() < 0.95, "both the accept and the reject path must be exercised"
    p2, p3, p23 = exact_marginals(llm.model, temperature, top_p, min_p, penalties)
    for position, probs in ((1, p2), (2, p3)):
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        assert counts[probs == 0].sum() == 0, "a token outside the top-p / min-p set was emitted"
        stat, df = chi2(counts, probs)
        assert stat < chi2_critical(df), f"token {position + 1}: chi2 {stat:.1f} (df {df})"
    # the pair: a third token verified at the wrong penalty for the second shows here, not in the marginals
    stat, df = chi2(torch.bincount(tokens[:, 1] * VOCAB + tokens[:, 2], minlength=VOCAB**2), p23.flatten())
    assert stat < chi2_critical(df), f"tokens 2 and 3 together: chi2 {stat:.1f} (df {df})"
