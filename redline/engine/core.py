"""The engine's one loop: schedule a plan, execute it, update the requests. `LLM.generate` / `stream` and
the server's engine loop both drive it through this interface (add, cancel, step, stats), from one thread
at a time: the thread that drives it first owns it until `release()` (a server's loop claims it at
start, so a call from another thread is an error, not a race of two admits into one slot).

A failure ends only the requests it touched: a prefill that raises runs each of its chunks again alone,
so that only the one that fails fails (an out-of-memory prompt, say); a decode step that raises fails the
requests in the step. Their slots are freed and the others go on. An error that leaves the device
unusable (failures.device_unusable) fails every request, and the engine refuses new ones from then on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from redline.engine.blocks import PrefixStats
from redline.engine.request import Request
from redline.engine.scheduler import Events, Scheduler
from redline.failures import RankLostError, device_unusable
from redline.runner.plan import ChunkResult, PrefillBatch, StageError, StepPlan, StepResult


class Executor(Protocol):
    """Runs plans on every rank (runner/model_runner.py on one process, runner/ranks.py on several)."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def lost(self) -> str | None:
        """Which tensor-parallel rank died, if one did."""
        ...


@dataclass(frozen=True)
class EngineStats:
    running: int  # requests in slots
    waiting: int  # requests queued for a slot
    kv_blocks: int  # blocks of the KV pool
    kv_blocks_free: int  # blocks free or holding only cached prefixes
    prefix_cache: PrefixStats  # prompt tokens looked up, found, and blocks evicted (running totals)
    prefilled_tokens: int  # prompt positions computed by prefill (prefix-cache hits are not)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler, self.executor = scheduler, executor
        self._owner: threading.Thread | None = None

    def _drive(self) -> None:
        current = threading.current_thread()
        if self._owner is None:
            self._owner = current
        elif self._owner is not current:
            raise RuntimeError(
                f"this engine is driven by thread {self._owner.name!r} (a server's engine loop, say): "
                "send requests through it"
            )

    def claim(self) -> None:
        """Only this thread drives the engine from now on (a server's engine loop, as it starts)."""
        self._owner = threading.current_thread()

    def release(self) -> None:
        """Lets another thread drive the engine from now on."""
        self._owner = None

    @property
    def unusable(self) -> str | None:
        return self.scheduler.unusable

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: Request) -> None:
        self._drive()
        self.scheduler.add(request)

    def cancel(self, request: Request) -> None:
        self._drive()
        self.scheduler.cancel(request)

    def fail(self, request: Request, message: str) -> None:
        self._drive()
        self.scheduler.fail(request, message)

    def stats(self) -> EngineStats:
        s = self.scheduler
        pool = s.pool
        return EngineStats(len(s.running), len(s.waiting), pool.num_blocks, pool.available, pool.stats,
                           s.prefilled_tokens)  # fmt: skip

    def check_ranks(self) -> None:
        """Raises RankLostError when a tensor-parallel rank has died (the engine can run nothing more)."""
        if (dead := self.executor.lost()) is not None:
            raise RankLostError(f"tensor-parallel {dead} died")

    def step(self) -> Events:
        """One step: schedule, execute, update. Returns (request, new text) once for every request that
        received tokens or finished, failed ones too (a request prefilled and decoded in one step: both
        pieces in one)."""
        self._drive()
        plan = self.scheduler.schedule()
        if plan.empty:
            return _merged(self.scheduler.update(StepResult()))
        try:
            result = self.executor.execute(plan)
        except StageError as error:
            return _merged(self._recover(plan, error))
        except Exception as error:  # before any stage ran: a lost rank, say
            self.scheduler.failed("step", error, list(self.scheduler.running.values()))
            return _merged(self.scheduler.update(StepResult()))
        return _merged(self.scheduler.update(result))

    def _recover(self, plan: StepPlan, error: StageError) -> Events:
        cause = error.__cause__ or error
        scheduler = self.scheduler
        if error.stage == "setup":
            scheduler.failed("step setup", cause, list(scheduler.running.values()))
            return scheduler.update(StepResult())
        if error.stage == "decode step":  # the prefill's results stand; the step's requests fail
            decoding = scheduler.planned_requests("decode step")
            events = scheduler.update(StepResult(error.prefill or []))
            scheduler.failed("decode step", cause, decoding)
            return events + scheduler.take_events()
        assert plan.prefill is not None
        prefill = self._chunks_alone(plan.prefill, cause)
        if scheduler.unusable is not None or plan.decode is None:
            return scheduler.update(StepResult(prefill))
        decode_only = StepPlan(released=scheduler.take_released(), decode=plan.decode)
        try:
            decode = self.executor.execute(decode_only).decode
        except StageError as failed:
            scheduler.failed(
                "decode step", failed.__cause__ or failed, scheduler.planned_requests("decode step")
            )
            decode = None
        return scheduler.update(StepResult(prefill, decode))

    def _chunks_alone(self, batch: PrefillBatch, cause: BaseException) -> list[ChunkResult | None]:
        """After a prefill forward raised: each chunk again alone, failing only those that raise again
        (all of them, without trying, when the forward had one chunk or left the device unusable)."""
        scheduler = self.scheduler
        requests = scheduler.planned_requests("prefill")
        results: list[ChunkResult | None] = [None] * len(batch.chunks)
        if len(batch.chunks) == 1 or device_unusable(cause):
            scheduler.failed("prefill", cause, requests)
            return results
        for i, chunk in enumerate(batch.chunks):
            if scheduler.unusable is not None:
                break
            try:
                alone = StepPlan(prefill=PrefillBatch((chunk,), batch.logits))
                results[i] = self.executor.execute(alone).prefill[0]
            except StageError as failed:
                scheduler.failed("prefill", failed.__cause__ or failed, [requests[i]])
        return results


def _merged(events: Events) -> Events:
    """One (request, text) per request, its pieces joined in order."""
    texts: dict[Request, str] = {}
    for request, text in events:
        texts[request] = texts.get(request, "") + text
    return list(texts.items())
