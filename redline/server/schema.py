"""The OpenAPI 3.1 description of `redline serve`'s HTTP API, for clients, docs and the schema fuzzer.

Documentation only: the server parses bodies by hand (redline/server/protocol.py) so that every error is
an OpenAI-shaped JSON body. These pydantic models state the same fields, types and bounds; unknown fields
are allowed (clients send many), and the fields redline cannot honour (suffix, logit_bias, tools,
functions, guided_*, structured_outputs, prompt_logprobs, length_penalty) are left out: they get a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel
from pydantic.json_schema import models_json_schema

from redline import __version__
from redline.sampling import MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_TOP_K
from redline.server.protocol import MAX_N, MAX_PROMPTS, MAX_STOP_STRINGS, MAX_TEMPERATURE

TOKEN_ID = "a token id in [0, vocabulary size)"  # openapi_schema(vocab_size=...) adds the maximum here
TokenId = Annotated[int, Field(ge=0, description=TOKEN_ID)]
Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(Body):
    include_usage: bool | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


def _given(key: str, value: Any) -> dict:
    """The JSON Schema of an object whose `key` is `value` (for the conditions between fields)."""
    return {"properties": {key: {"const": value}}, "required": [key]}


class Sampling(Body):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str = Field(description="the served model's id (GET /v1/models); any other is a 404")
    stream: bool | None = Field(False, description="server-sent events, ending with data: [DONE]")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
        1.0, description="0: greedy"
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[int, Field(ge=0, le=MAX_TOP_K)] | None = Field(0, description="0: off")
    min_p: Probability | None = 0.0
    ignore_eos: bool | None = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(1, description="samples of each prompt")
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = Field(
        1.0, description="1: off"
    )
    response_format: ResponseFormat | None = None
    tool_choice: Literal["none"] | None = None
    user: str | None = None


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    model_config = ConfigDict(json_schema_extra={"if": _given("max_tokens", 0), "then": _given("echo", True)})

    prompt: (
        NonEmpty | TokenIds | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description=f"a prompt (text or token ids), or a list of 1 to {MAX_PROMPTS}")  # fmt: skip
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        16, description="prompt + max_tokens must fit the context; 0 only with echo"
    )
    echo: bool | None = Field(False, description="the prompt's text (and logprobs) before the completion")
    logprobs: TopLogprobs | None = Field(None, description="top-N alternatives per token (0: chosen only)")
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(None, description="null or equal to n")


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(
        json_schema_extra={"dependentSchemas": {"top_logprobs": _given("logprobs", True)}}
    )

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="default: up to the context")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="over max_tokens")
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


class TokenizeRequest(RootModel[TokenizePrompt | TokenizeChat]):
    """POST /tokenize (as vLLM): a prompt, or chat messages rendered with the chat template."""


class DetokenizeRequest(Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


class ErrorDetail(Body):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(Body):
    """Every 4xx/5xx (GET /health's 503 adds "status": "unhealthy")."""

    error: ErrorDetail


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(CompletionChoice):
    text: str


class CompletionChunk(Body):
    """One server-sent event of a streamed text completion (the last, with include_usage: the usage)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[TokenLogprob] | None


class ChatMessage(Body):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Body):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(Body):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(Body):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Body):
    prompt: str


class ModelCard(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Body):
    status: Literal["ok"]


ERRORS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
          413: "request body too large", 429: "request queue full (Retry-After)",
          500: "internal error", 503: "the engine cannot serve"}  # fmt: skip
Model = type[BaseModel] | None
# path, method, summary, request body, 200's body, its server-sent event (stream: true), error statuses
OPERATIONS: list[tuple[str, str, str, Model, Model, Model, tuple[int, ...]]] = [
    ("/v1/completions", "post", "Text completion", CompletionRequest, Completion, CompletionChunk,
     tuple(ERRORS)),
    ("/v1/chat/completions", "post", "Chat completion", ChatCompletionRequest, ChatCompletion,
     ChatCompletionChunk, tuple(ERRORS)),
    ("/tokenize", "post", "Token ids of a prompt or chat", TokenizeRequest, TokenizeResponse, None,
     tuple(ERRORS)),
    ("/detokenize", "post", "Text of token ids", DetokenizeRequest, DetokenizeResponse, None, tuple(ERRORS)),
    ("/v1/models", "get", "The served model", None, ModelList, None, (401, 500)),
    ("/health", "get", "Engine health", None, Health, None, (500, 503)),
    ("/metrics", "get", "Prometheus metrics (text/plain)", None, None, None, (500,)),
]  # fmt: skip


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _sse(chunk: type[BaseModel]) -> dict:
    """text/event-stream: the schema of each event (OpenAPI 3.1 has no itemSchema); its data is a JSON
    chunk, an error, or the final [DONE]."""
    json_chunk = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    as_json = {"type": "string", "contentMediaType": "application/json", "contentSchema": json_chunk}
    data = {"anyOf": [{"const": "[DONE]"}, as_json]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


def _bound(node: Any, model: str | None, max_model_len: int | None, vocab_size: int | None) -> None:
    """Narrows the schemas in place to one server: its model id, context window and vocabulary."""
    if isinstance(node, list):
        for item in node:
            _bound(item, model, max_model_len, vocab_size)
    if not isinstance(node, dict):
        return
    properties = node.get("properties", {})
    if model is not None and "model" in properties:
        served = {"type": "string", "enum": [model], "description": "the served model's id"}
        required = "model" in node.get("required", ())
        properties["model"] = served if required else {"anyOf": [served, {"type": "null"}]}
    for key in ("max_tokens", "max_completion_tokens"):
        for option in properties.get(key, {}).get("anyOf", []) if max_model_len is not None else []:
            if option.get("type") == "integer":
                option["maximum"] = max_model_len
    if vocab_size is not None and node.get("description") == TOKEN_ID:
        node["maximum"] = vocab_size - 1
    for value in node.values():
        _bound(value, model, max_model_len, vocab_size)


def openapi_schema(
    title: str = "redline", *, model: str | None = None, max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> dict:  # fmt: skip
    """The API's OpenAPI 3.1 document. Given the served model's id, context window and vocabulary size,
    `model`, max_tokens and token ids are narrowed to the values this server accepts."""
    models = [m for op in OPERATIONS for m in op[3:6] if m is not None] + [ErrorResponse]
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    components = defs["$defs"]
    _bound(components, model, max_model_len, vocab_size)

    def content(m: type[BaseModel]) -> dict:
        return {"application/json": {"schema": _ref(m)}}

    errors = {str(s): {"description": d, "content": content(ErrorResponse)} for s, d in ERRORS.items()}
    paths: dict[str, dict] = {}
    for path, method, summary, request, response, chunk, statuses in OPERATIONS:
        ok = content(response) if response else {"text/plain": {"schema": {"type": "string"}}}
        ok |= _sse(chunk) if chunk else {}
        operation: dict[str, Any] = {
            "summary": summary,
            "operationId": path.strip("/").replace("/", "_"),
            "responses": {"200": {"description": "OK", "content": ok}}
            | {str(s): errors[str(s)] for s in statuses},
        }
        if request is not None:
            operation["requestBody"] = {"required": True, "content": content(request)}
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__, "description": "An OpenAI-compatible API."},
        "paths": paths,
        "components": {"schemas": components},
    }
