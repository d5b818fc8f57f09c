"""redline against HF transformers on tiny random models, fp32.

Tolerance: fp32 has a unit roundoff of 6e-8; a 3-4 layer model with width 64-112 sums a few hundred
products per output, so two correct implementations that order their sums differently differ by ~1e-6
relative. Logits here are O(1-10): atol 1e-4 is ~100x that noise and far below any real bug (a wrong
rope pair, mask or routing changes logits by O(0.1)).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, llama4_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.models.build import load_target
from redline.models.kv_cache import KVCache

ATOL = 1e-4

CONFIGS = {
    "llama3-tied": lambda: llama3_hf_config(tie_word_embeddings=True),
    "llama3-untied": lambda: llama3_hf_config(tie_word_embeddings=False),
    "llama4-moe-chunked": lambda: llama4_hf_config(),
}


@pytest.fixture(params=list(CONFIGS))
def pair(request, tmp_path, tokenizer_dir):
    hf = build_hf_model(CONFIGS[request.param]())
    return hf, save_hf_model(hf, tmp_path / request.param, tokenizer_dir)


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation and HF's logits over the whole sequence (for near-tie checks)."""
    hf.generation_config.eos_token_id = None  # run the full n tokens, like ignore_eos
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0].tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([out])).logits[0]
    return out[len(prompt) :], logits


def assert_same_greedy(ours: list[int], theirs: list[int], hf_logits: torch.Tensor, prompt_len: int) -> None:
    """Identical tokens, unless the first divergence is at an fp32 near-tie of HF's own top two logits."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            top2 = hf_logits[prompt_len + i - 1].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < ATOL, f"token {i}: redline {a} != HF {b} with HF's top-2 gap {gap:.2e}"
            return
    assert len(ours) == len(theirs)


def test_logits_match_hf_every_position(pair):
    hf, model_dir = pair
    ours = load_target(model_dir, torch.float32)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 70))  # crosses the Llama 4 chunk (24) twice
    with torch.no_grad():
        expected = hf(tokens).logits
        hidden, _ = ours(tokens, torch.arange(70).expand(2, -1))
    torch.testing.assert_close(ours.logits(hidden), expected, atol=ATOL, rtol=0)


def test_cached_prefill_then_decode_matches_full_forward(pair):
    """Prefill 30 tokens into slot 1 of a 2-slot cache, then feed 40 more one at a time."""
    hf, model_dir = pair
    model = load_target(model_dir, torch.float32)
    tokens = torch.randint(0, hf.config.vocab_size, (1, 70))
    with torch.no_grad():
        expected = hf(tokens).logits[0]
    cache = KVCache(model.config, 2, 128, torch.float32, torch.device("cpu"))  # fixed runs of blocks per slot
    layers, tables = cache.layers, cache.tables(1, 1)
    with torch.no_grad():
        hidden, _ = model(tokens[:, :30], torch.arange(30)[None], layers, tables, kv_len=64)
        got = [model.logits(hidden)[0]]
        for p in range(30, 70):
            hidden, _ = model(tokens[:, p : p + 1], torch.tensor([[p]]), layers, tables, kv_len=128)
            got.append(model.logits(hidden)[0])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_greedy_generation_matches_hf_batch1(pair):
    hf, model_dir = pair
    llm = LLM(model_dir, dtype="float32", max_batch=1)
    prompt = torch.randint(5, hf.config.vocab_size, (11,)).tolist()
    expected, hf_logits = hf_greedy(hf, prompt, 64)
    [completion] = llm.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))
    assert completion.finish_reason == "length"
    assert_same_greedy(completion.token_ids, expected, hf_logits, len(prompt))


def test_greedy_generation_matches_hf_batched_different_lengths(pair):
    """Five prompts over three slots: rows finish and new prompts join mid-flight (continuous batching)."""
    hf, model_dir = pair
    llm = LLM(model_dir, dtype="float32", max_batch=3)
    lengths = [3, 17, 9, 30, 5]
    prompts = [torch.randint(5, hf.config.vocab_size, (n,)).tolist() for n in lengths]
    max_tokens = [64, 40, 70, 64, 20]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    completions = llm.generate(prompts, params)
    for completion, prompt, m in zip(completions, prompts, max_tokens, strict=True):
        expected, hf_logits = hf_greedy(hf, prompt, m)
        assert_same_greedy(completion.token_ids, expected, hf_logits, len(prompt))
