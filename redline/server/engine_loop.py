"""One thread owns the model: it admits requests into slots at step boundaries, runs decode steps, and
hands each request's new text to its consumer. The HTTP side never touches the model.

`redline serve` runs the loop on the main thread (run()) and uvicorn on another: torch's CPU thread
pool is slow outside the main thread (the demo pair decodes at ~40 instead of ~90 tokens/s with 2
intra-op threads from a second thread). Tests use start(), a background thread.

Consumers are callables run on the engine thread with an Event; the server wraps an asyncio queue
(loop.call_soon_threadsafe), so handlers simply await their events.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from redline.engine.llm import LLM
from redline.engine.request import Completion, Request

log = logging.getLogger("redline.server")


@dataclass
class Event:
    text: str
    completion: Completion | None = None  # set on the request's last event
    error: str | None = None  # the engine failed this request


Consumer = Callable[[Event], None]


class QueueFull(Exception):
    pass


class EngineLoop:
    def __init__(self, llm: LLM, max_queue: int, on_step: Callable[[EngineLoop], None] | None = None):
        self.llm, self.max_queue = llm, max_queue
        self._inbox: queue.SimpleQueue[tuple[str, Request, Consumer | None]] = queue.SimpleQueue()
        self._consumers: dict[int, Consumer] = {}  # id(request) -> consumer
        self._pending = 0  # submitted, not yet in a slot
        self._lock = threading.Lock()
        self._on_step = on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="redline-engine", daemon=True)

    def start(self) -> None:
        """Runs the loop on a background thread."""
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))  # type: ignore[arg-type]
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return self._pending

    @property
    def slots_in_use(self) -> int:
        return len(self.llm.scheduler.running)

    def submit(self, request: Request, consumer: Consumer) -> None:
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull
            self._pending += 1
        self._inbox.put(("add", request, consumer))

    def cancel(self, request: Request) -> None:
        self._inbox.put(("cancel", request, None))

    def run(self) -> None:
        """The loop, on the calling thread, until stop()."""
        scheduler = self.llm.scheduler
        while not self._stop.is_set():
            self._drain(block=not scheduler.has_work)
            if not scheduler.has_work:
                continue
            waiting_before = len(scheduler.waiting)
            try:
                events = scheduler.step()
            except Exception as e:  # a failed step must not take the server down: fail its requests
                log.exception("decode step failed")
                self._fail_all(f"internal error in the decode step: {e}")
                continue
            self._admitted(waiting_before - len(scheduler.waiting))
            for request, text in events:
                self._deliver(request, text)
            if self._on_step:
                self._on_step(self)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, request, consumer = item
            if kind == "add" and consumer is not None:
                self._consumers[id(request)] = consumer
                self.llm.scheduler.add(request)
            elif kind == "cancel" and id(request) in self._consumers:
                was_waiting = request in self.llm.scheduler.waiting
                self.llm.scheduler.cancel(request)
                self._admitted(1 if was_waiting else 0)
                self._deliver(request, "")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admitted(self, count: int) -> None:
        with self._lock:
            self._pending -= count

    def _deliver(self, request: Request, text: str) -> None:
        consumer = self._consumers.get(id(request))
        if consumer is None:
            return
        if request.finished:
            del self._consumers[id(request)]
            consumer(Event(text, request.completion()))
        elif text:
            consumer(Event(text))

    def _fail_all(self, message: str) -> None:
        scheduler = self.llm.scheduler
        for request in [*scheduler.waiting, *scheduler.running.values()]:
            was_waiting = request in scheduler.waiting
            scheduler.cancel(request)
            self._admitted(1 if was_waiting else 0)
            consumer = self._consumers.pop(id(request), None)
            if consumer is not None:
                consumer(Event("", request.completion(), error=message))
