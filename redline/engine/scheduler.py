"""Continuous batching: requests join free slots at step boundaries and leave as soon as they finish.

KV blocks (engine/blocks.py, through ModelRunner.reserve): a request joins only when the pool holds
blocks for its tokens, and before each decode step every running request gets blocks for the step's
writes, oldest first. When the pool runs dry the newest running request is preempted: its blocks go
back, and it waits at the head of the queue to be prefilled again over its prompt and the tokens it
has produced (its outputs are unchanged: greedy and seeded draws depend only on the position). A
request that could not fit even alone fails with an error that names the sizes.

A failure ends only the requests it touched: a prefill (or its first token) that raises fails its own
request, a decode step that raises fails the requests in the step; their slots are freed and the
others go on. An error that leaves the device unusable (failures.device_unusable) fails every request,
and the scheduler refuses new ones from then on (`unusable` says why).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from redline.engine.failures import DeviceUnusableError, describe, device_unusable
from redline.engine.request import Request
from redline.engine.runner import ModelRunner, batch_bucket

log = logging.getLogger("redline.engine")

Events = list[tuple[Request, str]]


class Scheduler:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.unusable: str | None = None  # why the device can run nothing more, once it cannot

    def add(self, request: Request) -> None:
        if self.unusable is not None:
            raise DeviceUnusableError(f"the device is unusable after an earlier error: {self.unusable}")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> Events:
        """Admits waiting requests into free slots (prefill), then decodes one step for all of them.
        Returns (request, new text) for every request that received tokens or finished, failed ones too."""
        events: Events = []
        free = [s for s in range(self.runner.slots) if s not in self.running]
        while self.waiting and free and self.unusable is None:
            request, slot = self.waiting[0], free[0]
            tokens = request.prompt_ids + request.output_ids  # a preempted request's too
            try:
                reserved = self.runner.reserve(slot, len(tokens) + self.runner.lookahead)
            except Exception as error:
                self._failed("prefill", error, [request], events)
                continue
            if not reserved:
                if self.running:
                    break  # blocks come back as running requests end
                self.waiting.popleft()
                self.fail(request, self._too_large(len(tokens)))
                events.append((request, ""))
                continue
            self.waiting.popleft()
            request.slot = free.pop(0)
            try:
                first = self.runner.prefill(slot, tokens, request.params, request.seed)
                events.append((request, request.accept([first])))
            except Exception as error:
                self._failed("prefill", error, [request], events)
                if self.unusable is None:
                    self.runner.release(slot)
                free.insert(0, slot)
                continue
            self._admit_or_finish(request)
        if self.running and self.unusable is None:
            self._reserve_step(events)
        if self.running and self.unusable is None:
            self._decode(events)
        return events

    def _reserve_step(self, events: Events) -> None:
        """Blocks for the next step of every running request, oldest first, preempting the newest while
        the pool is short."""
        for slot, request in list(self.running.items()):  # admission order
            if self.running.get(slot) is not request:
                continue  # preempted meanwhile
            while not self._reserve(slot, request, events):
                newest = next(reversed(self.running.values()))
                if newest is request:  # alone and still short
                    self.fail(request, self._too_large(request.position + 1))
                    events.append((request, ""))
                    break
                self._preempt(newest)

    def _reserve(self, slot: int, request: Request, events: Events) -> bool:
        """runner.reserve for the request's next step; an error fails every running request (it met the
        device, or a lost rank), and counts as reserved: the decode step that follows is skipped."""
        try:
            return self.runner.reserve(slot, request.position + self.runner.lookahead)
        except Exception as error:
            self._failed("decode step", error, list(self.running.values()), events)
            return True

    def _preempt(self, request: Request) -> None:
        """Gives the request's blocks back; it waits first in the queue to be prefilled again."""
        assert request.slot is not None
        del self.running[request.slot]
        self.runner.release(request.slot)
        request.slot = None
        request.preemptions += 1
        self.waiting.appendleft(request)
        log.info("preempted a request at %d tokens: the KV pool is full", request.position + 1)

    def _too_large(self, tokens: int) -> str:
        pool = self.runner.pool
        return (
            f"a request of {tokens} tokens needs more KV blocks than the pool has "
            f"({pool.num_blocks} blocks of {pool.block_size} positions); raise kv_cache_memory"
        )

    def _decode(self, events: Events) -> None:
        rows = batch_bucket(max(self.running) + 1, self.runner.slots)
        last_position = max(r.position for r in self.running.values())
        try:
            out = self.runner.decode(rows, last_position)
        except Exception as error:
            self._failed("decode step", error, list(self.running.values()), events)
            return
        for slot, request in list(self.running.items()):
            try:
                *emitted, n_acc = out[slot]
                request.record_step(n_acc)
                events.append((request, request.accept(emitted[: n_acc + 1])))
            except Exception as error:
                self._failed("decode output", error, [request], events)
                continue
            if request.finished:
                self._free(slot)

    def cancel(self, request: Request) -> None:
        self._remove(request)
        request.cancel()

    def fail(self, request: Request, message: str) -> None:
        """Ends an unfinished request with finish_reason "error": out of the queue, or out of its slot
        (freed on the device unless the device is unusable)."""
        if request.finished:
            return
        self._remove(request)
        request.fail(message)

    def _failed(self, stage: str, error: Exception, requests: Iterable[Request], events: Events) -> None:
        """Fails `requests` for `error` (every request when it left the device unusable)."""
        message = describe(stage, error)
        log.error("%s; failing the requests in it", message, exc_info=error)
        if device_unusable(error):
            self.unusable = message
            requests = [*requests, *self.waiting, *self.running.values()]
        for request in dict.fromkeys(requests):
            if not request.finished:
                self.fail(request, message)
                events.append((request, ""))

    def _remove(self, request: Request) -> None:
        """Takes an unfinished request out of the queue or its slot; a slot is freed on the device."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request.slot is not None and not request.finished:
            if self.running.get(request.slot) is request:
                del self.running[request.slot]
            if self.unusable is None:
                self.runner.release(request.slot)

    def _admit_or_finish(self, request: Request) -> None:
        assert request.slot is not None
        if request.finished:
            self.runner.release(request.slot)
        else:
            self.running[request.slot] = request

    def _free(self, slot: int) -> None:
        del self.running[slot]
        self.runner.release(slot)
