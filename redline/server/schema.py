"""The OpenAPI 3.1 description of `redline serve`'s HTTP API, for clients, docs and the schema fuzzer:
the request models are the ones that parse the requests (server/protocol.py), the responses' models are
here. The fields redline cannot honour (suffix, functions, prompt_logprobs, length_penalty) are left
out: they get a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, RootModel
from pydantic.json_schema import models_json_schema

from redline import __version__
from redline.server import protocol


class Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class TokenizeRequest(RootModel[protocol.TokenizePrompt | protocol.TokenizeChat]):
    """POST /tokenize (as vLLM): a prompt, or chat messages rendered with the chat template."""


class ErrorDetail(Reply):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(Reply):
    """Every 4xx/5xx (GET /health's 503 adds "status": "unhealthy")."""

    error: ErrorDetail


class Usage(Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Reply):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Envelope(Reply):
    id: str
    created: int
    model: str


class Completion(Envelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Completion):
    """One server-sent event of a streamed text completion (the last, with include_usage: the usage)."""

    usage: Usage | None = None  # type: ignore[assignment]


class TopLogprob(Reply):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply):
    content: list[TokenLogprob] | None


class CalledFunction(Reply):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(Reply):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolCallDelta(ToolCall):
    index: int


class ChatMessage(Reply):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Reply):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(Envelope):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class Delta(Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Reply):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(Envelope):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(Reply):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Reply):
    prompt: str


class ModelCard(Reply):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Reply):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Reply):
    status: Literal["ok"]


ERRORS = {400: "invalid request", 401: "missing or wrong API key",
          403: "Host or Origin not allowed (server/web_policy.py)", 404: "unknown model",
          408: "request not received within the read timeout", 413: "request body too large",
          415: "request body not application/json", 429: "request queue full (Retry-After)",
          500: "internal error", 503: "the engine cannot serve"}  # fmt: skip
Model = type[BaseModel] | None
# path, method, summary, request body, 200's body, its server-sent event (stream: true), error statuses
OPERATIONS: list[tuple[str, str, str, Model, Model, Model, tuple[int, ...]]] = [
    ("/v1/completions", "post", "Text completion", protocol.CompletionRequest, Completion, CompletionChunk,
     tuple(ERRORS)),
    ("/v1/chat/completions", "post", "Chat completion", protocol.ChatCompletionRequest, ChatCompletion,
     ChatCompletionChunk, tuple(ERRORS)),
    ("/tokenize", "post", "Token ids of a prompt or chat", TokenizeRequest, TokenizeResponse, None,
     tuple(ERRORS)),
    ("/detokenize", "post", "Text of token ids", protocol.DetokenizeRequest, DetokenizeResponse, None,
     tuple(ERRORS)),
    ("/v1/models", "get", "The served model", None, ModelList, None, (401, 403, 500)),
    ("/health", "get", "Engine health", None, Health, None, (403, 500, 503)),
    ("/metrics", "get", "Prometheus metrics (text/plain)", None, None, None, (401, 403, 500)),
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
    if vocab_size is not None and node.get("description") == protocol.TOKEN_ID:
        node["maximum"] = vocab_size - 1
    for value in node.values():
        _bound(value, model, max_model_len, vocab_size)


def openapi_schema(
    *, model: str | None = None, max_model_len: int | None = None, vocab_size: int | None = None
) -> dict:
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
        "info": {"title": "redline", "version": __version__, "description": "An OpenAI-compatible API."},
        "paths": paths,
        "components": {"schemas": components},
    }
