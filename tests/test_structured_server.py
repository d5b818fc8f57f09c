"""Structured outputs through the HTTP API, with the official openai client: response_format json_schema
(`beta.chat.completions.parse` with a pydantic model), vLLM's guided_* and structured_outputs fields,
streaming and not, and the 400s of specs that do not compile; the token-level controls (logit_bias,
allowed_token_ids, bad_words)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from live_server import live  # noqa: E402

from redline import LLM  # noqa: E402
from redline.server.app import Server  # noqa: E402
from redline.tokenizer import Tokenizer  # noqa: E402

MODEL = "tiny"
DATE = r"20\d\d-(0[1-9]|1[0-2])-[0-3]\d"


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    indoor: bool
    colors: list[Literal["black", "white", "ginger"]] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def client(trained) -> Iterator[openai.OpenAI]:
    llm = LLM(trained / "target", dtype="float32", max_batch=4, max_seq_len=512, draft=trained / "draft")
    with live(Server(llm, MODEL)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_parse_returns_the_pydantic_object(client):
    """What the openai client sends for response_format=Pet (a strict json_schema) comes back as a Pet,
    greedy and sampled, with speculation on (the server's engine drafts with EAGLE-3)."""
    for temperature in (0.0, 1.0):
        out = client.beta.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet,
            max_tokens=200, temperature=temperature, seed=3,
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_constrain_completions(client, stream):
    """guided_regex, guided_choice and structured_outputs.json on /v1/completions, streamed and not: the
    text matches, and the request ends on the grammar's stop."""
    cases = [
        ({"guided_regex": DATE}, lambda text: re.fullmatch(DATE, text)),
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda text: text in ("alpha", "beta gamma")),
        (
            {"structured_outputs": {"json": Pet.model_json_schema()}},
            lambda text: Pet.model_validate_json(text),
        ),
    ]
    for extra, ok in cases:
        kw = dict(
            model=MODEL, prompt="def main():", max_tokens=100, temperature=0.8, seed=1, extra_body=extra
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            out = client.completions.create(**kw)
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert reason == "stop" and ok(text), (extra, text)


def test_json_object_mode_gives_an_object(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=300,
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a long string value can outrun max_tokens; what came is an object's start
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"guided_json": '{"type": "objec'}, "guided_json"),
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_specs_that_do_not_compile_are_400s_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_body=extra)
    assert error.value.body["param"] == field and field in error.value.body["message"]


def test_token_controls_over_http(client, trained):
    """logit_bias (OpenAI's, keys as strings), allowed_token_ids and bad_words (vLLM's) shape what comes
    out, streamed and not; ids past the vocabulary and biases past 100 are 400s naming the field."""
    tokenizer = Tokenizer.from_dir(trained / "target")
    [x] = tokenizer.encode("x", add_special_tokens=False)
    letters = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab"]
    kw = dict(model=MODEL, prompt="class Point:\n    def __init__(", max_tokens=12, temperature=0)
    forced = client.completions.create(**kw, logit_bias={str(x): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "x" * 12
    chunks = client.completions.create(**kw, stream=True, extra_body={"allowed_token_ids": letters})
    assert set("".join(c.choices[0].text for c in chunks if c.choices)) <= set("ab")
    tokens = lambda out: out.choices[0].logprobs.tokens
    word = next(t for t in tokens(client.completions.create(**kw, logprobs=0)) if t.strip())  # greedy's
    banned = client.completions.create(**kw, logprobs=0, extra_body={"bad_words": [word]})
    assert word not in tokens(banned)
    bad = [({"logit_bias": {"99999": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
           ({"logit_bias": {"five": 1}}, "logit_bias"), ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
           ({"bad_words": [""]}, "bad_words"),
           ({"allowed_token_ids": [x], "bad_words": ["x"]}, "allowed_token_ids")]  # fmt: skip
    for extra, field in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=5, extra_body=extra)
        assert error.value.body["param"].startswith(field), error.value.body
