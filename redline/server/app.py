"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions
(optionally streamed as server-sent events), /health and /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.engine.request import Request as EngineRequest
from redline.server.engine_loop import EngineLoop, EngineUnavailable, Event, QueueFull
from redline.server.errors import APIError, internal
from redline.server.metrics import Metrics
from redline.server.protocol import Parsed, parse_detokenize, parse_json, parse_request, parse_tokenize
from redline.tokenizer import TokenizerError

MAX_BODY_BYTES = 1 << 20
DISCONNECT_POLL_S = 1.0

log = logging.getLogger("redline.server")


class Server:
    """The app's state: the engine loop, the served model's name, limits, metrics."""

    def __init__(
        self, llm: LLM, model_name: str, api_key: str | None = None, max_queue: int = 64,
        max_body: int = MAX_BODY_BYTES,
    ):  # fmt: skip
        self.llm, self.model_name, self.api_key, self.max_body = llm, model_name, api_key, max_body
        self.metrics = Metrics()
        self.engine = EngineLoop(llm, max_queue, on_step=self._gauges)
        self.created = int(time.time())

    def _gauges(self, engine: EngineLoop) -> None:
        self.metrics.queue_depth.set(engine.queue_depth)
        self.metrics.slots_in_use.set(engine.slots_in_use)
        self.metrics.count_prefix_cache(self.llm.runner.pool.stats)

    def check_key(self, http: Request) -> None:
        if self.api_key is None:
            return
        given = http.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", kind="authentication_error"
            )

    async def read_body(self, http: Request) -> bytes:
        declared = http.headers.get("content-length", "")
        too_big = APIError(413, f"request body over {self.max_body} bytes")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        body = bytearray()
        async for chunk in http.stream():
            body += chunk
            if len(body) > self.max_body:
                raise too_big
        return bytes(body)

    def engine_request(self, parsed: Parsed) -> EngineRequest:
        """Templates and tokenizes a parsed body (slow: run it off the event loop); a chat template that
        raises is the messages' 400."""
        if parsed.messages is not None:
            ids = self.chat_ids(parsed.messages)
        elif isinstance(parsed.prompt, str):
            ids = self.llm.tokenizer.encode(parsed.prompt)
        else:
            ids = list(parsed.prompt or [])
        params = parsed.params
        if not parsed.max_tokens_given and parsed.messages is not None:  # chat: up to the context limit
            params = dataclasses.replace(params, max_tokens=max(1, self.llm.max_seq_len - len(ids)))
        try:
            return self.llm.make_request(ids, params)
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens" if "context window" in str(e) else "prompt") from e

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The rendered chat's token ids; a chat template that raises is the messages' 400."""
        try:
            return self.llm.tokenizer.encode_chat(messages, add_generation_prompt)
        except TokenizerError as e:  # jinja2 errors, raise_exception(...) in the template
            raise APIError(400, f"messages: {e}", "messages") from e
        except Exception as e:  # templates are code: they may fail in plain Python on odd messages
            raise APIError(400, f"messages: chat template error: {type(e).__name__}: {e}", "messages") from e

    def submit(self, request: EngineRequest) -> asyncio.Queue[Event]:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def consume(event: Event) -> None:  # on the engine thread
            if event.completion is not None:
                self.metrics.observe(event.completion)
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            self.engine.submit(request, consume)
        except QueueFull:
            raise APIError(429, "the request queue is full; retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from None  # fmt: skip
        except EngineUnavailable as e:
            raise unavailable(str(e)) from None
        return events


def unavailable(problem: str) -> APIError:
    return APIError(503, f"the engine cannot serve: {problem}", kind="service_unavailable")


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}  # fmt: skip


class Responder:
    """Builds the response bodies of one request, chat or text completion."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, c: Completion) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
            }
            return self._envelope("chat.completion", [choice]) | {"usage": _usage(c)}
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return self._envelope("text_completion", [choice]) | {"usage": _usage(c)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            body = self._envelope(
                "chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
            )
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        return sse(body)

    def usage_chunk(self, c: Completion) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(obj, []) | {"usage": _usage(c)})


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def sse_events(
    events: asyncio.Queue[Event], responder: Responder, include_usage: bool
) -> AsyncIterator[str]:
    """One request's server-sent events up to its last (without [DONE]); a failed request ends with an
    OpenAI-style error event."""
    if responder.chat:
        yield responder.chunk("", role=True)
    while True:
        event = await events.get()
        if event.error:
            yield sse(APIError(500, event.error, kind="server_error").body())
            return
        if event.text:
            yield responder.chunk(event.text)
        if event.completion is not None:
            yield responder.chunk(None if responder.chat else "", event.completion.finish_reason)
            if include_usage:
                yield responder.usage_chunk(event.completion)
            return


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

    app = FastAPI(title="redline", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(e)).body(), 400)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, e: Exception) -> JSONResponse:
        """A 500 JSON error for a bug outside generate(); Starlette re-raises it, and uvicorn logs it."""
        return JSONResponse(internal(e).body(), 500)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs on a usable device; 503 with the reason otherwise."""
        problem = server.engine.problem()
        if problem is not None:
            error = unavailable(problem)
            return JSONResponse({"status": "unhealthy"} | error.body(), error.status)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(http: Request) -> dict:
        server.check_key(http)
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "redline",
                "max_model_len": server.llm.max_seq_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(http: Request) -> dict:
        """vLLM's /tokenize: a prompt's (or chat's) token ids, their count and the context window."""
        server.check_key(http)
        parsed = parse_tokenize(parse_json(await server.read_body(http)), server.model_name)
        tokenizer = server.llm.tokenizer
        if parsed.messages is not None:
            ids = await asyncio.to_thread(server.chat_ids, parsed.messages, parsed.add_generation_prompt)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, parsed.prompt, parsed.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.llm.max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: Request) -> dict:
        """vLLM's /detokenize: token ids back to text."""
        server.check_key(http)
        data = parse_json(await server.read_body(http))
        tokens = parse_detokenize(data, server.model_name, server.llm.config.vocab_size)
        return {"prompt": server.llm.tokenizer.decode(tokens)}

    async def generate(http: Request, chat: bool) -> Response:
        try:
            return await respond(http, chat)
        except APIError:
            raise
        except Exception as e:  # a bug: logged here, the client gets a 500 JSON error
            log.exception("%s %s failed", http.method, http.url.path)
            raise internal(e) from e

    async def respond(http: Request, chat: bool) -> Response:
        server.check_key(http)
        data = parse_json(await server.read_body(http))
        llm = server.llm
        parsed = parse_request(data, chat, server.model_name, llm.max_seq_len, llm.config.vocab_size)
        request = await asyncio.to_thread(server.engine_request, parsed)
        events = server.submit(request)
        responder = Responder(chat, server.model_name)
        if parsed.stream:
            return StreamingResponse(
                stream(request, events, responder, parsed.include_usage), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        return JSONResponse(responder.full(await collect(http, request, events)))

    async def collect(http: Request, request: EngineRequest, events: asyncio.Queue[Event]) -> Completion:
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                if event.error:
                    raise APIError(500, event.error, kind="server_error")
                if event.completion is not None:
                    return event.completion
        finally:
            if not request.finished:
                server.engine.cancel(request)

    async def stream(
        request: EngineRequest, events: asyncio.Queue[Event], responder: Responder, include_usage: bool
    ) -> AsyncIterator[str]:
        try:
            async for piece in sse_events(events, responder, include_usage):
                yield piece
        except Exception as e:  # the status line is sent: the error goes in the stream
            log.exception("streaming a response failed")
            yield sse(internal(e).body())
        finally:  # the client went away mid-stream: free its slot
            if not request.finished:
                server.engine.cancel(request)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await generate(http, chat=True)

    return app
