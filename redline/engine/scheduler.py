"""Continuous batching: requests join free slots at step boundaries and leave as soon as they finish."""

from __future__ import annotations

from collections import deque

from redline.engine.request import Request
from redline.engine.runner import ModelRunner, batch_bucket


class Scheduler:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[tuple[Request, str]]:
        """Admits waiting requests into free slots (prefill), then decodes one step for all of them.
        Returns (request, new text) for every request that received tokens."""
        events = []
        free = [s for s in range(self.runner.slots) if s not in self.running]
        while self.waiting and free:
            request = self.waiting.popleft()
            request.slot = free.pop(0)
            first = self.runner.prefill(request.slot, request.prompt_ids, request.params, request.seed)
            events.append((request, request.accept([first])))
            self._admit_or_finish(request)
        if self.running:
            rows = batch_bucket(max(self.running) + 1, self.runner.slots)
            last_position = max(r.position for r in self.running.values())
            out = self.runner.decode(rows, last_position)
            for slot, request in list(self.running.items()):
                *emitted, n_acc = out[slot]
                request.record_step(n_acc)
                events.append((request, request.accept(emitted[: n_acc + 1])))
                if request.finished:
                    self._free(slot)
        return events

    def cancel(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif request.slot is not None and self.running.get(request.slot) is request:
            self._free(request.slot)
        request.cancel()

    def _admit_or_finish(self, request: Request) -> None:
        assert request.slot is not None
        if request.finished:
            self.runner.release(request.slot)
        else:
            self.running[request.slot] = request

    def _free(self, slot: int) -> None:
        del self.running[slot]
        self.runner.release(slot)
