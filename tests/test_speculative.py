"""EAGLE-3 speculative decoding: greedy output identical to plain decoding, for both families."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    build_hf_model,
    greedy_divergence_is_a_near_tie,
    llama3_hf_config,
    llama4_hf_config,
    save_hf_model,
)

from redline import LLM, SamplingParams
from redline.tokenizer import Tokenizer
from redline.train.random_init import write_random_draft

TARGETS = {
    "llama3": lambda: llama3_hf_config(num_hidden_layers=4),
    "llama4": lambda: llama4_hf_config(),  # MoE on layers 1, 3; chunk 24; NoPE layer 3
}


@pytest.fixture(scope="module", params=list(TARGETS))
def target_and_draft(request, tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp(request.param)
    target_dir = save_hf_model(build_hf_model(TARGETS[request.param]()), root / "target", tokenizer_dir)
    draft_dir = write_random_draft(target_dir, root / "draft", draft_vocab=200)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def plain(target_and_draft):
    return LLM(target_and_draft[0], dtype="float32", max_batch=4)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_is_lossless(target_and_draft, plain, k):
    """Batch 1 and batch 4 with different prompt lengths; 70 tokens cross the Llama 4 chunk (24) boundary."""
    target_dir, draft_dir = target_and_draft
    spec = LLM(target_dir, dtype="float32", max_batch=4, draft=draft_dir, num_draft_tokens=k)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (13, 3, 22, 8)]
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    expected = plain.generate(prompts, params)
    for batch in ([prompts[0]], prompts):
        for prompt, got, want in zip(batch, spec.generate(batch, params), expected, strict=False):
            assert len(got.token_ids) == 70
            assert greedy_divergence_is_a_near_tie(plain.model, prompt, got.token_ids, want.token_ids)
            assert got.acceptance_length is not None and 1.0 <= got.acceptance_length <= k + 1
            assert len(got.acceptance_rates) == k


@pytest.fixture(scope="module")
def forced(tmp_path_factory, tokenizer_dir):
    """A target that always predicts token X (attention and MLP outputs zeroed, all embeddings equal) and a
    draft that always proposes X (zero lm_head: draft id 0 wins the tie; d2t maps it to X). Every draft
    is accepted, so each step emits K + 1 tokens: the accepting path end to end."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("forced")
    hf = build_hf_model(llama3_hf_config(num_hidden_layers=4, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        hf.model.embed_tokens.weight.copy_(
            hf.model.embed_tokens.weight[0].expand_as(hf.model.embed_tokens.weight)
        )
        x = Tokenizer.from_dir(tokenizer_dir).encode("e", add_special_tokens=False)[0]  # one whole character
        final_hidden = hf.model.norm(hf.model.embed_tokens.weight[0])
        hf.lm_head.weight[x] = 10 * final_hidden / final_hidden.norm()
        assert hf(torch.tensor([[7]])).logits[0, -1].argmax().item() == x
    target_dir = save_hf_model(hf, root / "target", tokenizer_dir)
    draft_dir = write_random_draft(target_dir, root / "draft", draft_vocab=200)
    weights = load_file(draft_dir / "model.safetensors")
    weights["lm_head.weight"].zero_()
    weights["d2t"][0] = x
    save_file(weights, draft_dir / "model.safetensors", metadata={"format": "pt"})
    return target_dir, draft_dir, x


@pytest.mark.parametrize("k", [1, 3, 5])
def test_accepting_path_emits_k_plus_one_tokens_per_step(forced, k):
    target_dir, draft_dir, x = forced
    llm = LLM(target_dir, dtype="float32", max_batch=2, draft=draft_dir, num_draft_tokens=k)
    [c] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=41, ignore_eos=True))
    assert c.token_ids == [x] * 41
    assert c.acceptance_length == k + 1 and c.acceptance_rates == [1.0] * k


def test_max_tokens_and_stop_strings_are_exact_within_a_step(forced):
    """K = 5: tokens arrive six at a time, yet nothing past max_tokens or a stop string is emitted."""
    target_dir, draft_dir, x = forced
    llm = LLM(target_dir, dtype="float32", max_batch=2, draft=draft_dir, num_draft_tokens=5)
    piece = llm.tokenizer.decode([x])
    for n in (1, 2, 4, 7, 9):
        [c] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=n, ignore_eos=True))
        assert c.token_ids == [x] * n and c.finish_reason == "length" and c.text == piece * n
    [c] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, ignore_eos=True, stop=piece * 4))
    assert c.finish_reason == "stop" and c.token_ids == [x] * 4 and c.text == ""
    [c] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, ignore_eos=True, stop=["z", piece * 3]))
    assert c.finish_reason == "stop" and c.token_ids == [x] * 3 and c.text == ""
    # eos inside a step: make X an eos id
    llm.tokenizer.eos_token_ids = frozenset({x})
    [c] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30))
    assert c.token_ids == [x] and c.finish_reason == "stop"
