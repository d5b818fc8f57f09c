"""The OpenAI API's fields as its clients send them: logprobs / top_logprobs, echo, n, arrays of prompts,
penalties; through the official client against a live server, checked against a second engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from live_server import live  # noqa: E402

from redline import LLM, SamplingParams  # noqa: E402
from redline.benchmark.serve_bench import PREFIX_HITS, scrape_metrics  # noqa: E402
from redline.server.app import Server  # noqa: E402

MODEL = "tiny"
ATOL = 1e-4  # fp32: a cached forward against a whole one
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description="


def engine(trained) -> LLM:
    return LLM(trained / "target", dtype="float32", max_batch=8, max_seq_len=512, draft=trained / "draft",
               progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def url(trained) -> Iterator[str]:
    with live(Server(engine(trained), MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def reference(trained) -> LLM:
    """The server's own engine belongs to its engine thread: expectations come from this one."""
    return engine(trained)


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_completion_logprobs_are_the_engines(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    [want] = reference.generate(PROMPT, SamplingParams(max_tokens=12, logprobs=3))
    logprobs = out.choices[0].logprobs
    text = lambda t: reference.tokenizer.decode([t], skip_special_tokens=False)
    assert logprobs.tokens == [text(t) for t in want.token_ids]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=ATOL)
    assert all(len(top) <= 3 and max(top, key=top.get) == tok for top, tok in zip(logprobs.top_logprobs,
               logprobs.tokens, strict=True))  # fmt: skip
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_echo_scores_token_prompts_as_lm_eval_sends_them(client, reference):
    """A batch of two token-id prompts, echo, logprobs 1, max_tokens 0 and 1: every prompt token after
    the first gets the model's log-probability, then the generated token (if any) follows."""
    prompts = [reference.tokenizer.encode(PROMPT), reference.tokenizer.encode("x = [1, 2, 3]\ny = ")]
    for max_tokens in (0, 1):
        out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=max_tokens, temperature=0,
                                        echo=True, logprobs=1)  # fmt: skip
        assert [c.index for c in out.choices] == [0, 1]
        for prompt, choice in zip(prompts, out.choices, strict=True):
            scores = choice.logprobs.token_logprobs
            assert len(scores) == len(prompt) + max_tokens and scores[0] is None
            reference_logprobs = reference.runner.log_probs(prompt)
            want = [reference_logprobs[i - 1, t].item() for i, t in enumerate(prompt) if i]
            assert scores[1 : len(prompt)] == pytest.approx(want, abs=ATOL)
            assert choice.text.startswith(reference.tokenizer.decode(prompt))
        assert out.usage.completion_tokens == 2 * max_tokens


def test_n_samples_share_the_prompts_prefill_and_follow_their_seeds(client, reference, url):
    prompt = reference.tokenizer.encode(PROMPT * 2)  # several full KV blocks
    hits_before = scrape_metrics(url)[PREFIX_HITS]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=11, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=11 + j) for j in range(3)]
    want = reference.generate([prompt] * 3, params)
    assert [c.text for c in out.choices] == [w.text for w in want]
    blocks = (len(prompt) - 1) // 16  # with a draft a block's key includes the token after it
    hits = scrape_metrics(url)[PREFIX_HITS] - hits_before
    assert hits >= 2 * blocks * 16  # samples 2 and 3 reuse the first one's blocks
    assert out.usage.prompt_tokens == len(prompt)  # once: the samples share it


def test_chat_logprobs_and_streamed_choices(client, reference):
    messages = [{"role": "user", "content": "Write a loop."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, n=2,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens // 2 and all(
        len(c.top_logprobs) == 2 for c in content
    )
    ids = reference.tokenizer.encode_chat(messages)
    [want] = reference.generate([ids], SamplingParams(max_tokens=16, logprobs=2))
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=ATOL)
    assert full.choices[0].message.content == full.choices[1].message.content == want.text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, n=2,
                                            logprobs=True, top_logprobs=2, stream=True)  # fmt: skip
    chunks = list(stream)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == want.text
        streamed = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        assert streamed == pytest.approx([e.logprob for e in want.logprobs], abs=ATOL)


def test_penalties_through_the_api_equal_the_engines(client, reference):
    penalties = dict(presence_penalty=1.2, frequency_penalty=0.8)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"repetition_penalty": 1.4}, **penalties)  # fmt: skip
    params = SamplingParams(max_tokens=20, repetition_penalty=1.4, **penalties)
    [want] = reference.generate(PROMPT, params)
    assert out.choices[0].text == want.text
    assert want.text != reference.generate(PROMPT, SamplingParams(max_tokens=20))[0].text


@pytest.mark.parametrize(
    ("chat", "fields", "param"),
    [
        (True, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"n": 17}, "n"),
        (False, {"n": 1, "best_of": 2}, "best_of"),
        (False, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        (True, {"echo": True}, "echo"),
        (False, {"repetition_penalty": 0}, "repetition_penalty"),
        (False, {"presence_penalty": 2.5}, "presence_penalty"),
        (False, {"prompt": [[1, 2], "x", 7]}, "prompt[2]"),
        (False, {"top_k": 2**63}, "top_k"),  # past an int64 (found by the schema fuzzer: was a 500)
        (False, {"prompt": ["a"] * 5, "n": 16}, "n"),  # 80 choices: more than the queue (64) ever holds
    ],
)
def test_bad_fields_are_400s_naming_them(client, chat, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    create = client.chat.completions.create if chat else client.completions.create
    with pytest.raises(openai.BadRequestError) as error:
        create(model=MODEL, extra_body=fields, **body)  # extra_body's fields override the body's
    assert error.value.body["param"] == param


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_stream_delivers_every_token_and_its_logprob_once(client, max_tokens):
    """The first tokens come from prefill and the next from a decode step of the same engine step: the
    stream still carries all of the text, and each token's logprob exactly once."""
    kw = dict(model=MODEL, prompt="def main():\n    return", max_tokens=max_tokens, temperature=0, logprobs=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens


def test_a_streamed_batch_of_prompts_and_samples_ends_with_their_usage(client, reference):
    prompts = [PROMPT, "x = [1, 2, 3]\ny = "]
    kw = dict(
        model=MODEL,
        prompt=prompts,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)
    ]
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens == 4 * 6
    assert usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in prompts)  # once per prompt
