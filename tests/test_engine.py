"""The Python API on a tiny random Llama 3 checkpoint with a real BPE tokenizer."""

from __future__ import annotations

import pytest
import torch

from redline import LLM, SamplingParams
from redline.engine.request import Request


@pytest.fixture(scope="module")
def llm(tmp_path_factory, tokenizer_dir):
    from conftest import build_hf_model, llama3_hf_config, save_hf_model

    hf = build_hf_model(llama3_hf_config(tie_word_embeddings=False), seed=3)  # texts long enough to cut
    return LLM(save_hf_model(hf, tmp_path_factory.mktemp("api"), tokenizer_dir), dtype="float32", max_batch=4)


def test_generate_text_prompt_returns_a_full_completion(llm):
    [c] = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=20, ignore_eos=True))
    assert c.finish_reason == "length" and len(c.token_ids) == 20
    assert c.text == llm.tokenizer.decode(c.token_ids)
    assert c.prompt_tokens == len(llm.tokenizer.encode("def fibonacci(n):"))
    assert 0 < c.ttft_s <= c.latency_s and c.tokens_per_s > 0


def test_stream_pieces_join_to_the_generated_text(llm):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    stream = llm.stream("import os\n", params)
    pieces = list(stream)
    [c] = llm.generate("import os\n", params)
    assert "".join(pieces) == c.text == stream.completion.text
    assert stream.completion.token_ids == c.token_ids


def test_stop_string_cuts_the_text_and_the_tokens(llm):
    prompt = "class Foo:"
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    [full] = llm.generate(prompt, params)
    assert len(full.text) >= 13
    stop = full.text[10:13]
    [stopped] = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert stop in llm.tokenizer.decode(stopped.token_ids)  # the token completing the stop is counted


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    [alone] = llm.generate("while True:", params)
    batch = llm.generate(
        ["x = 1", "while True:", "for i in range(3):"],
        [
            SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True),
            params,
            SamplingParams(max_tokens=5),
        ],
    )
    assert batch[1].token_ids == alone.token_ids
    other = llm.generate(
        "while True:", SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other[0].token_ids != alone.token_ids


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    c = llm.chat(messages, SamplingParams(max_tokens=5, ignore_eos=True))
    assert c.prompt_tokens == len(llm.tokenizer.encode_chat(messages))
    assert len(c.token_ids) == 5


def test_more_prompts_than_slots(llm):
    prompts = [torch.randint(5, 300, (n,)).tolist() for n in (4, 9, 2, 7, 12, 3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, c in zip(prompts, together, strict=True):
        assert c.token_ids == llm.generate([prompt], params)[0].token_ids


def test_eos_ends_a_request_and_is_not_in_the_text(llm):
    eos = next(iter(llm.tokenizer.eos_token_ids))
    request = Request([0, 10], SamplingParams(max_tokens=10), llm.tokenizer, frozenset({eos}))
    piece = request.accept([20, 21, eos, 22])
    assert request.finish_reason == "stop" and request.output_ids == [20, 21, eos]
    assert piece == llm.tokenizer.decode([20, 21])


def test_bad_input_gets_clear_errors(llm, tmp_path):
    with pytest.raises(ValueError, match="context window"):
        llm.generate([1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 10**9]])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown dtype"):
        LLM(llm.model_dir, dtype="float12")
