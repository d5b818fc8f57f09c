"""The HTTP API's request bodies as pydantic models: they parse and validate every request, and the served
OpenAPI schema is generated from them (server/schema.py), so what is documented is what is accepted.

Validation is strict (no "1" for 1, no 1 for true; 2.0 is an integer, as in JSON Schema) and every error
becomes an OpenAI-shaped 400 naming its field ("messages[0].role"). Unknown fields are allowed (clients
send many: user, metadata, store, ...). What a field's type cannot say is checked after parsing, against
the served model: its id (404), context window and vocabulary, and the rules between fields (best_of = n,
top_logprobs with logprobs, max_tokens 0 only with echo). Fields whose non-default values would change
the output and that redline cannot honour yet (suffix, functions, ...) get a 400. Structured
output's fields live in server/structured_fields.py.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from redline.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    SamplingParams,
)
from redline.server.errors import APIError, invalid
from redline.server.structured_fields import StructuredFields
from redline.server.tool_fields import ToolFields, tool_constraint
from redline.structured_spec import StructuredOutputs
from redline.tool_calls.formats import FORMATS, ToolFormat
from redline.tool_calls.tool_use import ToolUse

MAX_TEMPERATURE = 2.0  # OpenAI's range: [0, 2]
MAX_STOP_STRINGS = 16  # lm-eval sends a task's stop sequences and the eos string: humaneval's are 6
MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_BAD_WORDS = 128  # each is checked against every row's context on the host
REFUSED = ("functions", "suffix", "prompt_logprobs")


def _whole(value: Any) -> Any:
    """2.0 -> 2 (an integer to JSON Schema); anything else is left to the integer check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole)]
TOKEN_ID = "a token id in [0, vocabulary size)"  # openapi_schema(vocab_size=...) adds the maximum here
TokenId = Annotated[Int, Field(ge=0, description=TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmpty = Annotated[str, Field(min_length=1)]
Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)]
TopLogprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
TokenIdText = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # OpenAI's logit_bias keys: "50256"


def _shape(value: Any) -> str | None:
    """Which form a union of JSON shapes takes (pydantic validates only that one, so its errors are the
    real ones): "a string", "token ids" (an array of integers), "a list" (any other array)."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        ids = value and all(isinstance(v, int | float) for v in value)  # [1, true, 2.5]: ids, checked as such
        return "token ids" if ids else "a list"
    return None


def _one_of(what: str, **forms: Any) -> Any:
    """A union validated by the JSON value's shape (_shape): one_of("...", a_string=str, a_list=list[str])."""
    tagged = [Annotated[form, Tag(name.replace("_", " "))] for name, form in forms.items()]
    union = functools.reduce(operator.or_, tagged)
    shape = Discriminator(_shape, custom_error_type="invalid_shape", custom_error_message=f"must be {what}")
    return Annotated[union, shape]


OnePrompt = _one_of("a non-empty string or a list of token ids", a_string=NonEmpty, token_ids=TokenIds)
Prompts = Annotated[list[OnePrompt], Field(min_length=1, max_length=MAX_PROMPTS)]
Prompt = _one_of("a string, a list of token ids, or a list of those", a_string=NonEmpty, token_ids=TokenIds,
                 a_list=Prompts)  # fmt: skip
Stop = _one_of(f"a non-empty string or a list of up to {MAX_STOP_STRINGS}", a_string=NonEmpty,
               a_list=Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)])  # fmt: skip


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: NonEmpty
    arguments: str = Field(description="a JSON object's text")


class ToolCallIn(Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: _one_of("a string or a list of text parts", a_string=str, a_list=list[TextPart]) | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (but for an assistant message with tool_calls)")
        return self

    def text(self) -> dict[str, Any]:
        """{"role", "content"} with text parts joined, and the tool calls or the call answered."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class Sampling(StructuredFields, Body):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str = Field(description="the served model's id (GET /v1/models); any other is a 404")
    stream: bool | None = Field(False, description="server-sent events, ending with data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: Stop | None = None
    seed: Int | None = None
    temperature: Temperature | None = Field(1.0, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[Int, Field(ge=0, le=MAX_TOP_K)] | None = Field(0, description="0: off")
    min_p: Probability | None = 0.0
    ignore_eos: bool | None = False
    n: Annotated[Int, Field(ge=1, le=MAX_N)] | None = Field(1, description="samples of each prompt")
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: RepetitionPenalty | None = Field(1.0, description="1: off")
    logit_bias: dict[TokenIdText, Bias] | None = Field(
        None, description="token id (a string) -> added to its logit"
    )
    allowed_token_ids: TokenIds | None = Field(None, description="vLLM's: only these tokens are generated")
    bad_words: Annotated[list[NonEmpty], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="vLLM's: words never generated"
    )
    user: str | None = None

    def params(
        self, max_tokens: int, logprobs: int | None, echo: bool, structured: StructuredOutputs | None
    ) -> SamplingParams:
        """With echo, the prompt's logprobs are computed when the tokens' are asked for, or max_tokens is
        0."""
        given = lambda value, default: default if value is None else value
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens, temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed, stop=stop,
            ignore_eos=bool(self.ignore_eos), presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given(self.repetition_penalty, 1.0),
            logprobs=logprobs,
            prompt_logprobs=(logprobs or 0) if echo and (logprobs is not None or max_tokens == 0) else None,
            structured=structured,
            logit_bias={int(t): v for t, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
        )  # fmt: skip


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    model_config = ConfigDict(json_schema_extra={"if": {"properties": {"max_tokens": {"const": 0}},
                                                        "required": ["max_tokens"]},
                                                 "then": {"properties": {"echo": {"const": True}},
                                                          "required": ["echo"]}})  # fmt: skip

    prompt: Prompt = Field(description=f"a prompt (text or token ids), or a list of 1 to {MAX_PROMPTS}")
    max_tokens: Annotated[Int, Field(ge=0)] | None = Field(
        16, description="prompt + max_tokens must fit the context; 0 only with echo"
    )
    echo: bool | None = Field(False, description="the prompt's text (and logprobs) before the completion")
    logprobs: TopLogprobs | None = Field(None, description="top-N alternatives per token (0: chosen only)")
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = Field(None, description="null or equal to n")


class ChatCompletionRequest(ToolFields, Sampling):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": {"top_logprobs": {
        "properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}})  # fmt: skip

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = Field(None, description="default: up to the context")
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = Field(None, description="over max_tokens")
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = Field(None, description="only with logprobs: true")


class TokenizePrompt(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True


class TokenizeChat(Body):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: bool | None = True


class DetokenizeRequest(Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


M = TypeVar("M", bound=BaseModel)


def _param(loc: tuple[int | str, ...]) -> str:
    """The field an error is at: ("messages", 0, "content", "a list", 1, "type") -> "messages[0].content[1].
    type": field names and list indices; the names of union forms ("a list", "str", "list[int]") are left
    out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in ("str", "int", "float", "bool"):
            out += f".{part}" if out else part
    return out


def parse(model: type[M], data: Any) -> M:
    """`data` (parsed JSON) as `model`; the first validation error as a 400 naming its field."""
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        param = _param(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param or None,
                       reason="bad_field") from None  # fmt: skip


def check_model(given: str | None, served: str) -> None:
    if given is not None and given != served:
        raise APIError(404, f"model {given!r} does not exist; this server serves {served!r}", "model",
                       "not_found_error")  # fmt: skip


def check_token_ids(ids: list[int], field: str, vocab_size: int) -> None:
    if any(t >= vocab_size for t in ids):
        raise invalid(field, f"token ids must be in [0, {vocab_size})")


@dataclass
class Parsed:
    """A completions or chat request, checked against the served model, as the server uses it."""

    prompts: list[str | list[int]] | None  # completions: one or more prompts, text or token ids
    messages: list[dict[str, str]] | None  # chat
    params: SamplingParams  # logprobs set when asked; prompt_logprobs with echo
    stream: bool
    include_usage: bool
    max_tokens_given: bool
    n: int = 1  # samples of each prompt, as choices prompt_index * n + sample_index
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    structured_field: str | None = None  # the field that asked for structured output (its errors' param)
    tools: ToolUse | None = None  # chat with tools: rendered by the template, calls read from the output


def _refuse_unsupported(data: dict, chat: bool) -> None:
    """A 400 for fields that would change the output and that redline cannot honour yet (tools: on chat
    only; echo: on completions only, as OpenAI's)."""
    refused = (*REFUSED, *(("echo",) if chat else ("tools", "tool_choice")))
    for key in refused:
        unset = (None, False, 0, [], {}, "", *(("none",) if key == "tool_choice" else ()))
        if data.get(key) not in unset:
            raise invalid(key, "is not supported")
    if data.get("length_penalty") not in (None, 1):
        raise invalid("length_penalty", "is not supported (use 1)")


def parse_request(
    data: Any,
    chat: bool,
    served_model: str,
    context: int,
    vocab_size: int,
    tool_format: ToolFormat = FORMATS["llama3_json"],
) -> Parsed:
    if isinstance(data, dict) and isinstance(data.get("model"), str):
        check_model(data["model"], served_model)  # a 404 before anything else, as OpenAI answers
        _refuse_unsupported(data, chat)
    body = parse(ChatCompletionRequest if chat else CompletionRequest, data)
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    if isinstance(body, ChatCompletionRequest):
        key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens, echo, prompts = getattr(body, key), False, None
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        key, max_tokens, echo, logprobs = "max_tokens", body.max_tokens, bool(body.echo), body.logprobs
        if max_tokens == 0 and not echo:
            raise invalid("max_tokens", "must be at least 1 (0 only with echo: true)")
        if body.best_of not in (None, body.n or 1):
            n = body.n or 1
            raise invalid("best_of", f"is not supported other than equal to n ({n}), got {body.best_of}")
        prompts = [body.prompt] if _shape(body.prompt) != "a list" else list(body.prompt)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list):
                check_token_ids(prompt, "prompt" if len(prompts) == 1 else f"prompt[{i}]", vocab_size)
    check_token_ids([int(t) for t in body.logit_bias or {}], "logit_bias", vocab_size)
    check_token_ids(body.allowed_token_ids or [], "allowed_token_ids", vocab_size)
    if max_tokens is not None and max_tokens > context:
        raise invalid(key, f"must be at most the context window ({context}), got {max_tokens}", "too_long")
    default = context if chat else 16  # OpenAI: chat runs to the context limit, completions default to 16
    structured, structured_field = body.structured()
    tools = body.tool_use(tool_format) if isinstance(body, ChatCompletionRequest) else None
    if (calls := tool_constraint(tools)) is not None:
        if structured is not None:
            raise invalid(
                "tool_choice", f"holds the output to a tool call: {structured_field} cannot apply too"
            )
        structured, structured_field = calls, "tools"
    params = body.params(default if max_tokens is None else max_tokens, logprobs, echo, structured)
    messages = [m.text() for m in body.messages] if isinstance(body, ChatCompletionRequest) else None
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    return Parsed(prompts, messages, params, stream, include_usage, max_tokens is not None, body.n or 1, echo,
                  structured_field, tools)  # fmt: skip


def parse_tokenize(data: Any, served_model: str) -> TokenizePrompt | TokenizeChat:
    """POST /tokenize (as vLLM serves it): a prompt, or chat messages to render with the template."""
    chat = isinstance(data, dict) and "messages" in data
    body = parse(TokenizeChat if chat else TokenizePrompt, data)
    check_model(body.model, served_model)
    return body


def parse_detokenize(data: Any, served_model: str, vocab_size: int) -> list[int]:
    """POST /detokenize: the token ids to turn back into text."""
    body = parse(DetokenizeRequest, data)
    check_model(body.model, served_model)
    check_token_ids(body.tokens, "tokens", vocab_size)
    return body.tokens
