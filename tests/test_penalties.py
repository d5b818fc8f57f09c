"""Presence, frequency and repetition penalties (redline/penalties.py), against transformers' repetition
processor and the OpenAI formula, and through whole generations with and without speculation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import greedy_divergence_is_a_near_tie
from transformers import RepetitionPenaltyLogitsProcessor

from redline import LLM, SamplingParams
from redline.penalties import count_emitted, counts_after_drafts, penalize
from redline.sampling import SamplingTensors

PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3)


def reference_penalized(logits: torch.Tensor, prompt: list[int], outputs: list[int], presence: float,
                        frequency: float, repetition: float) -> torch.Tensor:  # fmt: skip
    """logits [V] of the next token: transformers' repetition penalty over prompt + outputs, then OpenAI's
    presence and frequency penalties over the outputs."""
    ids = torch.tensor([prompt + outputs])
    logits = RepetitionPenaltyLogitsProcessor(repetition)(ids, logits[None].clone())[0]
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=logits.shape[0]).float()
    return logits - frequency * counts - presence * (counts > 0).float()


def test_penalize_matches_transformers_and_the_openai_formula():
    vocab, prompt, outputs = 40, [3, 5, 5, 9], [5, 11, 11, 11, 2]
    logits = torch.randn(vocab) * 3
    t = dataclasses.replace(
        SamplingTensors.zeros(1, torch.device("cpu")),
        presence=torch.tensor([0.6]),
        frequency=torch.tensor([0.4]),
        repetition=torch.tensor([1.3]),
    )
    counts = torch.bincount(torch.tensor(outputs), minlength=vocab).int()
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[prompt] = True
    got = penalize(logits[None, None], t, counts[None, None], seen[None])[0, 0]
    want = reference_penalized(logits, prompt, outputs, 0.6, 0.4, 1.3)
    torch.testing.assert_close(got, want)
    neutral = SamplingTensors.zeros(1, torch.device("cpu"))
    neutral.repetition.fill_(1.0)
    assert torch.equal(penalize(logits[None, None], neutral, counts[None, None], seen[None])[0, 0], logits)


def test_counts_after_drafts_add_the_drafts_before_each_row():
    counts = torch.zeros(1, 10, dtype=torch.int32)
    counts[0, 7] = 2
    rows = counts_after_drafts(counts, torch.tensor([[5, 7]]))[0]  # [K + 1, V]
    assert rows[:, 5].tolist() == [0, 1, 1] and rows[:, 7].tolist() == [2, 2, 3]
    assert rows.sum(-1).tolist() == [2, 3, 4]
    count_emitted(counts, torch.tensor([[5, 9, 9]]), torch.tensor([[True, True, False]]))
    assert counts[0, 5].item() == 1 and counts[0, 9].item() == 1


def reference_greedy(llm: LLM, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy decoding, a whole forward per token, penalties from reference_penalized."""
    outputs: list[int] = []
    for _ in range(steps):
        seq = torch.tensor([prompt + outputs])
        with torch.no_grad():
            hidden, _ = llm.model(seq, torch.arange(seq.shape[1])[None])
            logits = llm.model.logits(hidden)[0, -1]
        penalized = reference_penalized(logits, prompt, outputs, *PENALTIES.values())
        outputs.append(int(penalized.argmax()))
    return outputs


@pytest.mark.parametrize("draft", [False, True])
def test_penalized_greedy_generation_equals_plain_decoding(trained, draft):
    """Batched with an unpenalized request (whose tokens must not change), speculative or not, the
    penalized tokens are those of the reference loop; and the penalties do change them."""
    llm = LLM(trained / "target", draft=trained / "draft" if draft else None, dtype="float32", max_batch=4,
              max_seq_len=256, progress=False)  # fmt: skip
    prompts = [llm.tokenizer.encode(t) for t in ("def read(path):\n    with open(", "for i in range(")]
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    penalized = dataclasses.replace(plain, **PENALTIES)
    out = llm.generate([prompts[0], prompts[1], prompts[0]], [penalized, penalized, plain])
    for prompt, completion in zip(prompts, out[:2], strict=True):
        want = reference_greedy(llm, prompt, 24)
        assert greedy_divergence_is_a_near_tie(llm.model, prompt, completion.token_ids, want)
    assert out[2].token_ids == llm.generate([prompts[0]], plain)[0].token_ids
    assert out[0].token_ids != out[2].token_ids
    if draft:
        assert out[0].acceptance_length > 1.2, "penalized drafts must still be accepted"


def test_penalties_survive_preemption(trained):
    """A preempted request is prefilled again over prompt + outputs: its counts come back with it."""
    kw = dict(dtype="float32", max_seq_len=256, draft=trained / "draft", progress=False)
    roomy = LLM(trained / "target", max_batch=3, **kw)
    tight = LLM(trained / "target", max_batch=3, kv_cache_memory=roomy.runner.block_bytes * 12, **kw)
    prompts = [torch.randint(5, 384, (40,)).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=60, ignore_eos=True, **PENALTIES)
    want = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert sum(c.preemptions for c in got) > 0
    for prompt, a, b in zip(prompts, got, want, strict=True):
        assert greedy_divergence_is_a_near_tie(roomy.model, prompt, a.token_ids, b.token_ids)
