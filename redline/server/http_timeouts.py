"""Time limits on reading a request, so a client trickling bytes cannot hold a connection as long as it likes,
and JSON answers, counted, for requests too malformed for the app to see.

uvicorn closes a keep-alive connection idle between requests (timeout_keep_alive) but waits for a
request's headers, once they have begun, for ever, and for ever on a connection that sends nothing.
`timed_h11` is its h11 protocol with one more deadline, armed whenever no request is the app's: a fresh
connection's headers must arrive within read_timeout_s (else a 408 if some bytes came, and the connection
is closed); after an answer, the connection is closed once max(read_timeout_s, the keep-alive timeout)
pass without a new request's headers (the bound on trickling the next request's headers, or on
trickling a body the app refused before reading it, say with a 415). The body's own deadline is the
server's (Server.read_json: a 408 too). uvicorn's 400 for a request h11 cannot parse (no Host on
HTTP/1.1, a header block over 16 KiB, bytes that are not HTTP) becomes an OpenAI-shaped JSON error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from redline.server.errors import APIError
from redline.server.metrics import Metrics

Refused = Callable[[APIError], None]  # counts an answer the app never saw


def timeout_answer(read_timeout_s: float, what: str) -> APIError:
    message = f"request {what} not received within {read_timeout_s:g} s"
    return APIError(408, message, headers={"Connection": "close"}, reason="read_timeout")


def timed_h11(read_timeout_s: float, refused: Refused = lambda error: None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on request headers and JSON 400s; `refused` is called for
    each answer it sends itself (the server counts them)."""

    class TimedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(read_timeout_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._app_has_request():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._app_has_request():  # (a pipelined one may)
                self._arm(max(read_timeout_s, self.timeout_keep_alive))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if self.conn.our_state is not h11.IDLE:  # an answer is under way or sent (a bad chunk later)
                self.transport.close()
                return
            self._answer(APIError(400, f"malformed HTTP request: {msg}", reason="bad_http"))

        def _app_has_request(self) -> bool:
            """A request's headers are in and its answer is not finished."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self._app_has_request():
                return
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # headers begun, not done
                self._answer(timeout_answer(read_timeout_s, "headers"))
            else:  # idle, or still sending a body the app refused unread: just closed
                self.transport.close()

        def _answer(self, error: APIError) -> None:
            """The error as a whole HTTP answer written straight to the socket, which is then closed."""
            refused(error)
            body = json.dumps(error.body()).encode()
            phrase = {400: "Bad Request", 408: "Request Timeout"}[error.status]
            head = (f"HTTP/1.1 {error.status} {phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
            self.transport.write(head.encode() + body)
            self.transport.close()

    return TimedH11Protocol


def uvicorn_config(app: Any, metrics: Metrics, read_timeout_s: float, keep_alive_s: float, **options: Any
                   ) -> uvicorn.Config:  # fmt: skip
    """uvicorn's settings for the app: the timed protocol (its own answers counted as the Guard counts the
    app's: endpoint "other") and the keep-alive timeout; options: host, port, log_level, ..."""

    def refused(error: APIError) -> None:
        metrics.http.labels("other", str(error.status)).inc()
        metrics.rejections.labels(error.reason).inc()

    protocol: Any = timed_h11(read_timeout_s, refused)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=keep_alive_s, **options)
