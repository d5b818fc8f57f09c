"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions
(optionally streamed as server-sent events), /health and /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.sampling import ParamError
from redline.server import protocol
from redline.server.engine_loop import EngineLoop, EngineUnavailable, Event, QueueFull
from redline.server.errors import APIError, internal
from redline.server.guard import Guard
from redline.server.http_timeouts import timeout_answer
from redline.server.json_body import parse_json
from redline.server.metrics import Metrics
from redline.server.responses import Choice, Responder, sse
from redline.server.schema import openapi_schema
from redline.server.web_policy import WebPolicy
from redline.structured.grammar import StructuredError
from redline.tokenizer import TokenizerError
from redline.tool_calls.formats import format_for, template_format
from redline.tool_calls.tool_use import ToolUse, template_messages

MAX_BODY_BYTES = 1 << 20
LOOPBACK = WebPolicy()  # a server on 127.0.0.1: loopback Host names, no web origins
DISCONNECT_POLL_S = 1.0

log = logging.getLogger("redline.server")
EventQueue = asyncio.Queue[tuple[Choice, Event]]  # a request's events, each with the choice it is of
Failure = Callable[[str], APIError]  # the engine's message on a failed request -> what its client hears


class Server:
    """The app's state: the engine loop, the served model's name, limits, metrics, who may call it."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None, max_queue: int = 64,
                 tool_format: str | None = None, metrics_api_key: str | None = None,
                 policy: WebPolicy = LOOPBACK, read_timeout_s: float = 30.0):  # fmt: skip
        """tool_format: how the model writes tool calls ("llama3_json", "pythonic"; None: the one its chat
        template writes, else its family's: tool_calls/formats.py). api_key: required on every path but
        /health; metrics_api_key: /metrics' own (else api_key). policy: the Host, Origin and Content-Type
        rules (server/web_policy.py; by default a loopback server's). read_timeout_s: a request body's
        deadline (its headers': serve.py)."""
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.metrics_api_key, self.policy, self.read_timeout_s = metrics_api_key, policy, read_timeout_s
        self.tool_format = format_for(llm.model_config.family, tool_format, template_format(llm.tokenizer))
        self.metrics = Metrics()
        self.engine = EngineLoop(llm, max_queue, on_step=self._gauges)
        self.created = int(time.time())

    def _gauges(self, engine: EngineLoop) -> None:
        stats = engine.stats()
        self.metrics.queue_depth.set(engine.queue_depth)
        self.metrics.slots_in_use.set(stats.running)
        self.metrics.count_prefix_cache(stats.prefix_cache)

    async def read_json(self, http: Request) -> Any:
        """The request's JSON body (server/json_body.py's bounds); a body over MAX_BODY_BYTES is a 413,
        one not in within read_timeout_s a 408."""
        declared = http.headers.get("content-length", "")
        too_big = APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_big

        async def read() -> bytes:
            body = bytearray()
            async for chunk in http.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise too_big
            return bytes(body)

        try:
            return parse_json(await asyncio.wait_for(read(), self.read_timeout_s))
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            raise timeout_answer(self.read_timeout_s, "body") from None

    def engine_failure(self, request_id: str, detail: str) -> APIError:
        """A request the engine failed, as its client hears it: what failed, without the cause's text
        (an exception's, which may name paths and ports), and the request id it is logged under."""
        log.error("request %s failed in the engine: %s", request_id, detail)
        return internal(request_id, summary(detail))

    def choices(self, parsed: protocol.Parsed) -> list[Choice]:
        """Templates and tokenizes a parsed body into one engine request per choice (slow: run it off the
        event loop): each prompt n times, the samples of a prompt sharing a group (their prefill, through
        the prefix cache) and, with a seed, taking seed, seed + 1, ... A chat template that raises, or a
        prompt too long for the context, is a 400."""
        prompts: list[tuple[list[int], str | None]] = []
        if parsed.messages is not None:
            prompts.append((self.chat_ids(parsed.messages, tools=parsed.tools), None))
        tokenizer = self.llm.tokenizer
        for prompt in parsed.prompts or []:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if parsed.echo else None
            prompts.append((ids, echo))
        choices = []
        for i, (ids, echo) in enumerate(prompts):
            params = parsed.params
            if not parsed.max_tokens_given and parsed.messages is not None:  # chat: up to the context limit
                params = dataclasses.replace(params, max_tokens=max(1, self.llm.max_seq_len - len(ids)))
            group = object() if parsed.n > 1 else None
            for j in range(parsed.n):
                seed = None if params.seed is None else params.seed + j
                try:
                    request = self.llm.make_request(ids, dataclasses.replace(params, seed=seed), group)
                except StructuredError as e:  # a schema, regex or grammar that does not compile
                    raise APIError(400, f"{parsed.structured_field}: {e}", parsed.structured_field) from e
                except ParamError as e:  # logit_bias, allowed_token_ids, bad_words
                    raise APIError(400, str(e), e.param) from e
                except ValueError as e:
                    too_long = "context window" in str(e)
                    raise APIError(400, str(e), "max_tokens" if too_long else "prompt",
                                   reason="too_long" if too_long else "bad_field") from e  # fmt: skip
                choices.append(Choice(i * parsed.n + j, request, echo, tools=parsed.tools))
        return choices

    def chat_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: ToolUse | None = None
    ) -> list[int]:
        """The rendered chat's token ids (with the tools, as the template renders them); a chat template
        that raises is the messages' 400."""
        try:
            template_tools = None if tools is None else tools.template_tools
            return self.llm.tokenizer.encode_chat(
                template_messages(messages), add_generation_prompt, template_tools
            )
        except TokenizerError as e:  # jinja2 errors, raise_exception(...) in the template
            raise APIError(400, f"messages: {e}", "messages") from e
        except Exception as e:  # templates are code: they may fail in plain Python on odd messages
            raise APIError(400, f"messages: chat template error: {type(e).__name__}: {e}", "messages") from e

    def submit(self, choices: list[Choice]) -> EventQueue:
        """Queues every choice's request; their events arrive on one queue. If one is refused (a full
        queue), those already queued are cancelled."""
        loop, events = asyncio.get_running_loop(), EventQueue()

        def consume(choice: Choice, event: Event) -> None:  # on the engine thread
            if event.completion is not None:
                self.metrics.observe(event.completion)
            loop.call_soon_threadsafe(events.put_nowait, (choice, event))

        if len(choices) > self.engine.max_queue:  # it would be refused however long it waited
            raise APIError(400, f"{len(choices)} choices (prompts x n) exceed the server's queue of "
                           f"{self.engine.max_queue} requests", "n")  # fmt: skip
        for k, choice in enumerate(choices):
            try:
                self.engine.submit(choice.request, functools.partial(consume, choice))
            except (QueueFull, EngineUnavailable) as e:
                self.cancel(choices[:k])
                if isinstance(e, EngineUnavailable):
                    raise unavailable(str(e)) from None
                raise APIError(429, "the request queue is full; retry shortly", kind="rate_limit_error",
                               headers={"Retry-After": "1"}) from None  # fmt: skip
        return events

    def cancel(self, choices: list[Choice]) -> None:
        for choice in choices:
            if not choice.request.finished:
                self.engine.cancel(choice.request)


def summary(problem: str) -> str:
    """An engine problem without its cause: the engine words them "what: cause" ("prefill failed:
    OutOfMemoryError: ...", "the engine loop died: RankLostError: ..."); the log has the whole. Running
    out of memory is said, as the one cause a client can act on (fewer tokens, later)."""
    what = problem.split(": ", 1)[0]
    return f"{what}: out of memory" if what != problem and "out of memory" in problem.lower() else what


def unavailable(problem: str) -> APIError:
    return APIError(503, f"the engine cannot serve: {summary(problem)}", kind="service_unavailable")


async def sse_events(
    events: EventQueue,
    responder: Responder,
    choices: list[Choice],
    include_usage: bool,
    failure: Failure,
) -> AsyncIterator[str]:
    """The server-sent events of every choice up to the last (without [DONE]); a failed request ends
    with an OpenAI-style error event (failure(the engine's message)). With echo, a choice's first chunk is
    its prompt."""
    if responder.chat:
        for choice in choices:
            yield responder.chunk(choice, "", role=True)
    completions: dict[int, Completion] = {}
    while len(completions) < len(choices):
        choice, event = await events.get()
        if event.error:
            yield sse(failure(event.error).body())
            return
        if choice.echo is not None and not choice.started:
            asked = choice.request.params.logprobs is not None  # (max_tokens 0 computes them regardless)
            entries = event.prompt_logprobs if asked else None
            prompt = choice.request.prompt_ids
            logprobs = None if entries is None else responder.logprobs(choice, prompt, entries)
            yield responder.chunk(choice, choice.echo, logprobs)
        choice.started = True
        text = event.text if choice.tool_stream is None else choice.tool_stream.feed(event.text)
        if text or event.logprobs:
            tokens = [e.token for e in event.logprobs]
            logprobs = responder.logprobs(choice, tokens, list(event.logprobs)) if event.logprobs else None
            yield responder.chunk(choice, text, logprobs)
        if event.completion is not None:
            completions[choice.index] = event.completion
            reason = event.completion.finish_reason
            if choice.tool_stream is not None:  # the text held back: content, or the calls
                held, calls, reason = choice.tool_stream.finish(reason)
                if held or calls:
                    yield responder.chunk(choice, held or None, calls=calls)
            yield responder.chunk(choice, None, finish_reason=reason)
    if include_usage:
        yield responder.usage_chunk(choices, [completions[c.index] for c in choices])


def create_app(server: Server, start_engine: bool = True) -> FastAPI:
    """With start_engine, the app runs the engine loop on a background thread while it is up; without,
    the caller runs server.engine.run() itself (redline serve: on the main thread)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            server.engine.start()
        yield
        if start_engine:
            server.engine.stop()

    app = FastAPI(title="redline", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.openapi = lambda: openapi_schema(
        model=server.model_name,
        max_model_len=server.llm.max_seq_len,
        vocab_size=server.llm.model_config.vocab_size,
    )
    for error in (APIError, HTTPException, RequestValidationError):
        app.add_exception_handler(error, _error_response)
    app.include_router(routes)
    endpoints = [route.path for route in routes.routes] + [app.openapi_url]  # type: ignore[attr-defined]
    app.add_middleware(Guard, metrics=server.metrics, policy=server.policy, endpoints=endpoints,
                       api_key=server.api_key, metrics_api_key=server.metrics_api_key)  # fmt: skip
    return app


async def _error_response(http: Request, e: Exception) -> JSONResponse:
    """Every error as OpenAI-style JSON, a refusal's (4xx) reason left for the Guard to count. (Any other
    exception is a bug: the Guard answers it with a 500 naming the request.)"""
    if isinstance(e, HTTPException):
        e = APIError(e.status_code, str(e.detail), headers=e.headers)
    elif isinstance(e, RequestValidationError):
        e = APIError(400, str(e), reason="bad_field")
    assert isinstance(e, APIError)
    if e.status < 500:
        http.state.rejection = e.reason
    return JSONResponse(e.body(), e.status, headers=e.headers)


routes = APIRouter()


def _server(http: Request) -> Server:
    return http.app.state.server


@routes.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
async def health(http: Request) -> Response:
    """200 while the engine loop runs on a usable device; 503 with the reason otherwise."""
    problem = _server(http).engine.problem()
    if problem is not None:
        error = unavailable(problem)
        return JSONResponse({"status": "unhealthy"} | error.body(), error.status)
    return JSONResponse({"status": "ok"})


@routes.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(generate_latest(_server(http).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(http: Request) -> dict:
    server = _server(http)
    card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "redline",
            "max_model_len": server.llm.max_seq_len}  # fmt: skip
    return {"object": "list", "data": [card]}


@routes.post("/tokenize")
async def tokenize(http: Request) -> dict:
    """vLLM's /tokenize: a prompt's (or chat's) token ids, their count and the context window."""
    server = _server(http)
    parsed = protocol.parse_tokenize(await server.read_json(http), server.model_name)
    if isinstance(parsed, protocol.TokenizeChat):
        messages = [m.text() for m in parsed.messages]
        ids = await asyncio.to_thread(server.chat_ids, messages, parsed.add_generation_prompt is not False)
    else:
        special = parsed.add_special_tokens is not False
        ids = await asyncio.to_thread(server.llm.tokenizer.encode, parsed.prompt, special)
    return {"count": len(ids), "max_model_len": server.llm.max_seq_len, "tokens": ids}


@routes.post("/detokenize")
async def detokenize(http: Request) -> dict:
    """vLLM's /detokenize: token ids back to text."""
    server = _server(http)
    data = await server.read_json(http)
    tokens = protocol.parse_detokenize(data, server.model_name, server.llm.model_config.vocab_size)
    return {"prompt": server.llm.tokenizer.decode(tokens)}


@routes.post("/v1/completions")
async def completions(http: Request) -> Response:
    return await _generate(http, chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(http: Request) -> Response:
    return await _generate(http, chat=True)


async def _generate(http: Request, chat: bool) -> Response:
    server = _server(http)
    llm, name = server.llm, server.model_name
    data = await server.read_json(http)
    parsed = protocol.parse_request(data, chat, name, llm.max_seq_len, llm.model_config.vocab_size,
                                    server.tool_format)  # fmt: skip
    choices = await asyncio.to_thread(server.choices, parsed)
    events = server.submit(choices)
    responder = Responder(chat, name, llm.tokenizer)
    failure = functools.partial(server.engine_failure, http.state.request_id)
    if parsed.stream:
        stream = _stream(server, choices, events, responder, parsed.include_usage, failure)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    return JSONResponse(responder.full(choices, await _collect(server, http, choices, events, failure)))


async def _collect(
    server: Server, http: Request, choices: list[Choice], events: EventQueue, failure: Failure
) -> list[Completion]:
    """Every choice's completion, in choice order; a failed one fails the response (500)."""
    done: dict[int, Completion] = {}
    try:
        while len(done) < len(choices):
            try:
                choice, event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            if event.error:
                raise failure(event.error)
            if event.completion is not None:
                done[choice.index] = event.completion
        return [done[c.index] for c in choices]
    finally:
        server.cancel(choices)


async def _stream(
    server: Server,
    choices: list[Choice],
    events: EventQueue,
    responder: Responder,
    include_usage: bool,
    failure: Failure,
) -> AsyncIterator[str]:
    try:
        async for piece in sse_events(events, responder, choices, include_usage, failure):
            yield piece
    except Exception as e:  # the status line is sent: the error goes in the stream, the cause in the log
        yield sse(failure(f"streaming the response failed: {type(e).__name__}: {e}").body())
    finally:  # the client went away mid-stream (or a choice failed): free the slots
        server.cancel(choices)
    yield "data: [DONE]\n\n"
