"""A live uvicorn server on 127.0.0.1 (a free port) for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from redline.server.app import Server, create_app
from redline.server.http_timeouts import uvicorn_config


@contextmanager
def live(server: Server) -> Iterator[str]:
    """Serves `server` (its engine loop on a background thread) and yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(create_app(server), server.metrics, server.read_timeout_s, keep_alive_s=5,
                            log_level="warning")  # fmt: skip
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not runner.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        runner.should_exit = True
        thread.join(timeout=15)
        sock.close()
