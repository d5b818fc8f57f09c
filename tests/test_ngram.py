"""N-gram (prompt lookup) drafting: the on-device matcher against a plain Python one, and greedy decoding
with n-gram drafts, alone or beside an EAGLE-3 draft, equal to plain decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama3_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.engine_config import EngineConfig, SpeculativeConfig
from redline.speculative import ngram
from redline.speculative.ngram import NgramRange
from redline.train.random_init import write_random_draft


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], bool]:
    """The longest suffix (max_n down to min_n) that occurs earlier, its latest occurrence, and the K tokens
    that follow it, the copy running on with the same period into its own proposals."""
    t = len(tokens) - 1
    for n in range(max_n, min_n - 1, -1):
        if n > t:
            continue
        suffix = tokens[t - n + 1 :]
        for j in range(t - 1, n - 2, -1):  # latest first: the match ends at j < t
            if tokens[j - n + 1 : j + 1] == suffix:
                out = list(tokens)
                for _ in range(k):  # x[p] = x[p - period]
                    out.append(out[len(out) - (t - j)])
                return out[t + 1 :], True
    return [tokens[-1]] * k, False


def test_the_docstring_examples():
    history = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 0, 0], [7, 8, 7, 8, 0, 0, 0, 0, 0]])
    drafts, found = ngram.propose(history, torch.tensor([6, 3]), 3, NgramRange(2, 3))
    assert drafts.tolist() == [[4, 1, 2], [7, 8, 7]] and found.tolist() == [True, True]


@pytest.mark.parametrize("lookup", [(1, 1), (2, 4), (3, 5), (1, 8)])
def test_matches_equal_a_plain_python_matcher(lookup):
    """Fresh random rows over a small alphabet (many matches, many lengths), with stale tokens past each
    row's last position that must never match."""
    rows, length, k = 64, 96, 5
    alphabet = torch.randint(2, 6, ()).item()
    history = torch.randint(0, alphabet, (rows, length))
    last = torch.randint(0, length, (rows,))
    drafts, found = ngram.propose(history, last, k, NgramRange(*lookup))
    for b in range(rows):
        want, hit = reference_propose(history[b, : last[b] + 1].tolist(), k, *lookup)
        assert drafts[b].tolist() == want and found[b].item() == hit, (b, last[b].item())


def test_record_writes_only_new_tokens():
    history = torch.zeros(2, 8, dtype=torch.int64)
    tokens = torch.tensor([[5, 6, 7], [8, 9, 4]])
    after = torch.tensor([[2, 3, 4], [0, 1, 2]])
    new = torch.tensor([[True, True, False], [True, False, False]])
    ngram.record(history, tokens, after, new)
    assert history.tolist() == [[0, 0, 0, 5, 6, 0, 0, 0], [0, 8, 0, 0, 0, 0, 0, 0]]


def test_the_config_spells_it_as_vllm_does():
    c = SpeculativeConfig.from_json('{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
                                    '"num_speculative_tokens": 5}')  # fmt: skip
    assert c.on and c.lookup == (2, 4) and c.num_speculative_tokens == 5
    assert SpeculativeConfig(method="ngram").lookup == (2, 4)
    assert SpeculativeConfig(method="ngram", prompt_lookup_max=6).lookup == (6, 6)  # one alone sets both
    assert SpeculativeConfig(method="ngram", prompt_lookup_min=3).lookup == (3, 3)
    assert SpeculativeConfig(model="d").lookup is None  # EAGLE-3 alone
    assert SpeculativeConfig(model="d", prompt_lookup_min=2, prompt_lookup_max=3).lookup == (
        2,
        3,
    )  # beside it
    assert EngineConfig.create("m", speculative_method="ngram", num_draft_tokens=2).num_draft_tokens == 2
    for given, message in [
        (dict(method="ngram", model="d"), "takes no draft model"),
        (dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "is more than"),
        (dict(method="ngram", prompt_lookup_max=0), "prompt_lookup_max must be in 1..16"),
        (dict(model="d", prompt_lookup_min=2), "needs prompt_lookup_max"),
        (dict(prompt_lookup_max=4), 'prompt lookup needs method "ngram"'),
        (dict(method="medusa"), "unknown speculative method"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**given)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("ngram")
    return save_hf_model(
        build_hf_model(llama3_hf_config(num_hidden_layers=4)), root / "target", tokenizer_dir
    )


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, dtype="float32", max_batch=4)


def repetitive_prompts() -> list[list[int]]:
    """Random pieces said twice or three times, so lookup finds matches from the first step."""
    prompts = []
    for n, times in ((13, 2), (4, 3), (22, 2), (8, 3)):
        piece = torch.randint(5, 384, (n,)).tolist()
        prompts.append(piece * times)
    return prompts


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_ngram_decoding_is_lossless(target, plain, k):
    spec = LLM(target, dtype="float32", max_batch=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": k})  # fmt: skip
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    expected = plain.generate(prompts, params)
    accepted = []
    for batch in ([prompts[0]], prompts):
        for prompt, got, want in zip(batch, spec.generate(batch, params), expected, strict=False):
            assert len(got.token_ids) == 70
            assert greedy_divergence_is_a_near_tie(plain.model, prompt, got.token_ids, want.token_ids)
            assert got.acceptance_length is not None and 1.0 <= got.acceptance_length <= k + 1
            accepted.append(got.acceptance_length)
    assert max(accepted) > 1.0  # the prompts repeat themselves: some proposals are taken


def test_lookup_beside_an_eagle3_draft_is_lossless(target, plain, tmp_path):
    """Chunked prefill: the history is written whole when a request is set up, the first token after its
    final chunk."""
    draft = write_random_draft(target, tmp_path / "draft", draft_vocab=200)
    spec = LLM(
        target,
        dtype="float32",
        max_batch=4,
        draft=draft,
        num_draft_tokens=3,
        prompt_lookup_max=3,
        max_num_batched_tokens=16,
    )  # prompts of up to 44 tokens prefill in chunks
    prompts = repetitive_prompts()
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    got_all = spec.generate(prompts, params)
    for prompt, got, want in zip(prompts, got_all, plain.generate(prompts, params), strict=True):
        assert greedy_divergence_is_a_near_tie(plain.model, prompt, got.token_ids, want.token_ids)
    assert (
        max(c.acceptance_length for c in got_all) > 1.5
    )  # lookup's proposals were taken (the draft is random)
