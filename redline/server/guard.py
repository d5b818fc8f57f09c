"""The ASGI middleware every HTTP request passes first (innermost to Starlette's error middleware, outermost
to the routes):

1. it names the request: the client's X-Request-Id if it is a plain token, else "req-" and 16 hex digits,
   echoed in the answer's X-Request-Id and kept in request.state.request_id;
2. it applies the web policy (server/web_policy.py: Host, Origin, Content-Type; CORS for listed origins,
   their preflights answered here) and the API key (every path but /health; /metrics takes its own key
   when one is set);
3. it turns any exception a route let through into a 500 that names the request and nothing internal
   (the traceback goes to the log under the request's id);
4. it counts every answer by endpoint and status (redline_http_requests_total) and every refusal by
   reason (redline_rejections_total; a route's APIError leaves its reason in request.state.rejection).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from redline.server.errors import APIError, internal
from redline.server.metrics import Metrics
from redline.server.web_policy import WebPolicy

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Send], Awaitable[None]]
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
OPEN_PATHS = ("/health",)  # answered without a key (load balancers probe it)
PREFLIGHT_HEADERS = "authorization, content-type, x-request-id"
TOKEN = r"[A-Za-z0-9!#$%&'*+.^_`|~-]+"  # a header name (RFC 9110's token)
HEADER_NAMES = re.compile(rf"{TOKEN}(\s*,\s*{TOKEN}){{0,63}}")  # "content-type, x-stainless-os"

log = logging.getLogger("redline.server")


class Guard:
    def __init__(self, app: ASGIApp, *, metrics: Metrics, policy: WebPolicy, endpoints: Collection[str],
                 api_key: str | None = None, metrics_api_key: str | None = None):  # fmt: skip
        """endpoints: the paths counted by name (the app's routes); any other is counted as "other"."""
        self.app, self.metrics, self.policy, self.endpoints = app, metrics, policy, frozenset(endpoints)
        self.api_key, self.metrics_api_key = api_key, metrics_api_key

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        request_id = given if CLIENT_ID.fullmatch(given) else f"req-{secrets.token_hex(8)}"
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        origin = headers.get("origin")
        extra = [(b"x-request-id", request_id.encode())]
        if origin is not None and self.policy.origin_allowed(origin):
            extra += [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        status: int | None = None  # once the answer has started; 499 (as nginx): the client left first

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
                await send(message)
                status = message["status"]  # once sent: a start that failed is not an answer
            else:
                await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                state["rejection"] = refusal.reason
                await _answer(send_with_headers, refusal.status, refusal.body(), refusal.headers)
            elif _is_preflight(scope, headers):  # an allowed origin's: refused ones were refused above
                await _answer(send_with_headers, 204, None, _preflight_answer(headers))
            else:
                await self.app(scope, receive, send_with_headers)
        except ClientDisconnect:  # the client left mid-request: no answer to give, nothing failed
            status = status or 499
        except asyncio.CancelledError:  # (a disconnect seen while waiting on the engine)
            status = status or 499
            raise
        except Exception:
            log.exception("request %s (%s %s) failed", request_id, scope["method"], scope["path"])
            if status is None:  # nothing sent yet (a started answer cannot change; its stream just ends)
                await _answer(send_with_headers, 500, internal(request_id).body(), {})
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.metrics.http.labels(endpoint, str(status or 500)).inc()
            if "rejection" in state:
                self.metrics.rejections.labels(state["rejection"]).inc()

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        method, path = scope["method"], scope["path"]
        refusal = self.policy.refusal(method, headers.get("host"), headers.get("origin"),
                                      headers.get("content-type"))  # fmt: skip
        if refusal is not None or _is_preflight(scope, headers) or path in OPEN_PATHS:
            return refusal
        key = self.metrics_api_key if path == "/metrics" and self.metrics_api_key else self.api_key
        given = headers.get("authorization", "").encode("latin-1")
        if key is not None and not hmac.compare_digest(given, f"Bearer {key}".encode()):
            message = "missing or wrong API key (Authorization: Bearer KEY)"
            return APIError(401, message, kind="authentication_error")
        return None


def _is_preflight(scope: Scope, headers: dict[str, str]) -> bool:
    """A browser's CORS preflight: OPTIONS with Origin and Access-Control-Request-Method (sent without
    credentials, so answered without the key)."""
    return scope["method"] == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers


def _preflight_answer(headers: dict[str, str]) -> dict[str, str]:
    """The headers a page may send: those it asks for (SDKs add their own, x-stainless-os, ...), when they
    are plain header names, else the ones this API reads."""
    asked = headers.get("access-control-request-headers", "")
    allowed = asked if HEADER_NAMES.fullmatch(asked) else PREFLIGHT_HEADERS
    return {"access-control-allow-methods": "GET, POST, OPTIONS", "access-control-allow-headers": allowed,
            "access-control-max-age": "600"}  # fmt: skip


async def _answer(send: Send, status: int, body: dict | None, headers: dict[str, str]) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    fields = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if body is not None:
        fields += [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": payload})
