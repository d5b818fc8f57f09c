"""One thread owns the model: it admits requests into slots at step boundaries, runs decode steps, and
hands each request's new text to its consumer. The HTTP side never touches the model.

`redline serve` runs the loop on the main thread (run()) and uvicorn on another: torch's CPU thread
pool is slow outside the main thread (BENCHMARKS.md, "Server: the demo pair under concurrent streaming
clients"). Tests use start(), a background thread.

Consumers are callables run on the engine thread with an Event; the server wraps an asyncio queue
(loop.call_soon_threadsafe), so handlers simply await their events.

Failures: the scheduler fails single requests (their consumers get an Event with `error`); a step that
raises anyway fails every request in the engine. If the loop itself ends (stop(), or an exception), every
open request fails and submit() refuses new ones; problem() says why the engine cannot serve.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from redline.engine.core import EngineStats
from redline.engine.llm import LLM
from redline.engine.request import Completion, Request
from redline.engine.scheduler import Events
from redline.failures import DeviceUnusableError
from redline.logprobs import TokenLogprob

log = logging.getLogger("redline.server")


@dataclass
class Event:
    text: str
    completion: Completion | None = None  # set on the request's last event
    error: str | None = None  # the engine failed this request
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens new since the last event
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first event, when asked for


Consumer = Callable[[Event], None]


class QueueFull(Exception):
    pass


class EngineUnavailable(Exception):
    """The engine serves nothing more: its loop is not running, or the device is unusable."""


class EngineLoop:
    def __init__(self, llm: LLM, max_queue: int, on_step: Callable[[EngineLoop], None] | None = None):
        self.llm, self.max_queue = llm, max_queue
        self._inbox: queue.SimpleQueue[tuple[str, Request, Consumer | None]] = queue.SimpleQueue()
        self._consumers: dict[Request, Consumer] = {}
        self._sent: dict[Request, int] = {}  # log-probabilities already delivered, per request
        self._queued: set[Request] = set()  # in the scheduler, not yet in a slot or finished
        self.queue_depth = 0  # requests submitted, not yet in a slot or finished (written under _lock)
        self._lock = threading.Lock()
        self._on_step = on_step
        self._stop = threading.Event()
        self._started = False
        self._ended: str | None = None  # why the loop ended, once it has
        self._thread = threading.Thread(target=self.run, name="redline-engine", daemon=True)

    def start(self) -> None:
        """Runs the loop on a background thread."""
        self._started = True  # now, not once the thread gets going: no early 503s
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))  # type: ignore[arg-type]
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def problem(self) -> str | None:
        """None while the loop runs on a usable device; otherwise why the engine cannot serve."""
        return self._refusal() or (None if self._started else "the engine loop has not started")

    def _refusal(self) -> str | None:
        """Why submit() refuses requests: the loop ended, or the device is unusable. (Requests submitted
        before the loop starts wait for it.)"""
        if self.llm.engine.unusable is not None:
            return f"the device is unusable: {self.llm.engine.unusable}"
        return self._ended

    def stats(self) -> EngineStats:
        """The engine's counts, a snapshot (the gauges read it on the engine thread after each step)."""
        return self.llm.engine.stats()

    def submit(self, request: Request, consumer: Consumer) -> None:
        """Queues a request; QueueFull when max_queue are waiting, EngineUnavailable when nothing serves."""
        with self._lock:  # under the lock: the loop either sees this request or ends before it is put
            refusal = self._refusal()
            if refusal is not None:
                raise EngineUnavailable(refusal)
            if self.queue_depth >= self.max_queue:
                raise QueueFull
            self.queue_depth += 1
            self._inbox.put(("add", request, consumer))

    def cancel(self, request: Request) -> None:
        self._inbox.put(("cancel", request, None))

    def run(self) -> bool:
        """The loop, on the calling thread, until stop(): True then. An exception escaping the loop ends
        it too (logged; open requests fail; False)."""
        self._started = True
        self.llm.engine.claim()  # from now on only this thread drives the engine
        reason = "the engine loop was stopped"
        try:
            while not self._stop.is_set():
                self._iterate()
            return True
        except Exception as e:
            log.exception("the engine loop died")
            reason = f"the engine loop died: {type(e).__name__}: {e}"
            return False
        finally:
            self._close(reason)

    def _iterate(self) -> None:
        """Takes in new requests and cancellations, runs one step, and delivers its events."""
        engine = self.llm.engine
        self._drain(block=not engine.has_work)
        events: Events = []
        if engine.has_work:
            try:
                events = engine.step()
            except Exception as e:  # not a request's failure (the scheduler handles those): fail them all
                log.exception("engine step failed")
                events = self._fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
        self._deliver_all(events)
        engine.check_ranks()  # a tensor-parallel rank that died ends the loop: the server exits
        if self._on_step:
            self._on_step(self)

    def _drain(self, block: bool) -> None:
        for kind, request, consumer in self._inbox_items(block):
            if kind == "add" and consumer is not None:
                self._add(request, consumer)
            elif kind == "cancel" and request in self._consumers:
                self.llm.engine.cancel(request)
                self._deliver(request, "")

    def _inbox_items(self, block: bool = False) -> Iterator[tuple[str, Request, Consumer | None]]:
        """Everything in the inbox; with block, waiting up to 0.5 s for the first item."""
        try:
            yield self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                yield self._inbox.get_nowait()
        except queue.Empty:
            return

    def _add(self, request: Request, consumer: Consumer) -> None:
        self._consumers[request] = consumer
        self._queued.add(request)
        try:
            self.llm.engine.add(request)
        except DeviceUnusableError as e:  # submitted just before the device failed
            request.fail(str(e))
            self._deliver(request, "")

    def _deliver_all(self, events: Events) -> None:
        """Delivers a step's events, after counting the requests that left the queue (admitted into a slot,
        or finished: cancelled, failed), so that a client answered can submit again at once."""
        left = {r for r in self._queued if r.slot is not None or r.finished}
        self._queued -= left
        with self._lock:
            self.queue_depth -= len(left)
        for request, text in events:
            self._deliver(request, text)

    def _deliver(self, request: Request, text: str) -> None:
        consumer = self._consumers.get(request)
        if consumer is None:
            return
        sent = self._sent.get(request)
        new = request.logprobs[sent or 0 :]
        if request.finished:
            del self._consumers[request]
            self._sent.pop(request, None)
            event = Event(text, request.completion(), error=request.error, logprobs=new)
        elif text or new:
            self._sent[request] = len(request.logprobs)
            event = Event(text, logprobs=new)
        else:
            return
        if sent is None and request.params.prompt_logprobs is not None:  # the request's first event
            event.prompt_logprobs = list(request.prompt_logprobs)
        try:
            consumer(event)
        except Exception:  # one consumer's failure (its event loop closed, say) is not the engine's
            log.exception("delivering an event failed")

    def _fail_all(self, message: str) -> Events:
        """Fails every request of this loop still open, in the scheduler or not (a request may be
        between the queue and a slot when a step raises)."""
        for request in self._consumers:
            try:
                self.llm.engine.fail(request, message)
            except Exception:  # freeing its slot failed too; its client is answered all the same
                log.exception("could not free the slot of a failed request")
                request.fail(message)
        return [(request, "") for request in self._consumers]

    def _close(self, reason: str) -> None:
        """The loop ends: submit() refuses from now on, and every request submitted so far fails."""
        with self._lock:
            self._ended = reason
        for kind, request, consumer in self._inbox_items():
            if kind == "add" and consumer is not None:
                self._consumers[request] = consumer
                self._queued.add(request)
        self._deliver_all(self._fail_all(reason))
        self.llm.engine.release()
