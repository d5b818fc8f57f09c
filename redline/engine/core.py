"""The engine's one loop: schedule a plan, execute it, update the requests. `LLM.generate` / `stream` and
the server's engine loop both drive it through this interface (add, cancel, step, stats), one thread at a
time: a thread drives it for the length of a `driving()` block (a whole `generate`, a stream's iteration,
one call), and a server's loop holds it from `claim()` to `release()`. A call from another thread in the
meantime is an error, not a race of two admits into one slot; threads may take turns.

A failure ends only the requests it touched: a prefill that raises runs each of its chunks again alone,
so that only the one that fails fails (an out-of-memory prompt, say); a decode step that raises fails the
requests in the step. Their slots are freed and the others go on. An error that leaves the device
unusable (failures.device_unusable) fails every request, and the engine refuses new ones from then on;
so does any failed stage when the executor cannot recover one (tensor parallelism: the ranks may have
left the plan at different points, so their next collectives would not match).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from redline.engine.blocks import PrefixStats
from redline.engine.request import Request
from redline.engine.scheduler import Events, Scheduler
from redline.failures import DeviceUnusableError, RankLostError, device_unusable
from redline.runner.plan import ChunkResult, PrefillBatch, StageError, StepPlan, StepResult


class Executor(Protocol):
    """Runs plans on every rank (runner/model_runner.py on one process, runner/ranks.py on several)."""

    recovers: bool  # whether the device state is whole after a failed stage, so that other plans can run

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
        self._guard = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread inside driving(), if one is
        self._depth = 0
        self._claimed: contextlib.AbstractContextManager | None = None

    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """The calling thread drives the engine inside this block (re-entrant); another thread's call
        meanwhile raises RuntimeError."""
        current = threading.current_thread()
        with self._guard:
            if self._owner not in (None, current):
                assert self._owner is not None
                raise RuntimeError(f"this engine is being driven by thread {self._owner.name!r} (a server's "
                                   "engine loop, or another generate): send requests through it, "
                                   "or wait")  # fmt: skip
            self._owner, self._depth = current, self._depth + 1
        try:
            yield
        finally:
            with self._guard:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None

    def claim(self) -> None:
        """Only this thread drives the engine until release() (a server's engine loop, as it starts)."""
        self._claimed = self.driving()
        self._claimed.__enter__()

    def release(self) -> None:
        if self._claimed is not None:
            self._claimed, claimed = None, self._claimed
            claimed.__exit__(None, None, None)

    @property
    def unusable(self) -> str | None:
        return self.scheduler.unusable

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: Request) -> None:
        with self.driving():
            self.scheduler.add(request)

    def cancel(self, request: Request) -> None:
        with self.driving():
            self.scheduler.cancel(request)

    def fail(self, request: Request, message: str) -> None:
        with self.driving():
            self.scheduler.fail(request, message)

    def stats(self) -> EngineStats:
        s = self.scheduler
        pool = s.pool
        return EngineStats(len(s.running), len(s.waiting), pool.num_blocks, pool.available,
                           dataclasses.replace(pool.stats), s.prefilled_tokens)  # fmt: skip

    def check_ranks(self) -> None:
        """Raises RankLostError when a tensor-parallel rank has died (the engine can run nothing more)."""
        if (dead := self.executor.lost()) is not None:
            raise RankLostError(f"tensor-parallel {dead} died")

    def step(self) -> Events:
        """One step: schedule, execute, update. Returns (request, new text) once for every request that
        received tokens or finished, failed ones too (a request prefilled and decoded in one step: both
        pieces in one)."""
        with self.driving():
            plan = self.scheduler.schedule()
            if plan.empty:
                return _merged(self.scheduler.update(StepResult()))
            try:
                result = self.executor.execute(plan)
            except StageError as error:
                return _merged(self._recover(plan, error))
            except Exception as error:  # before any stage ran: a lost rank, say
                self._fail_running("step", error, plan)
                return _merged(self.scheduler.update(StepResult()))
            return _merged(self.scheduler.update(result))

    def _fail_running(self, stage: str, error: BaseException, plan: StepPlan) -> None:
        """Fails every running request; the plan's released slots go out again with the next plan (the
        device may not have heard of them)."""
        self.scheduler.resend_released(plan.released)
        self.scheduler.fail_stage(stage, error, list(self.scheduler.running.values()))

    def _recover(self, plan: StepPlan, error: StageError) -> Events:
        cause = error.__cause__ or error
        scheduler = self.scheduler
        if not self.executor.recovers or error.stage == "read":
            cause = DeviceUnusableError(f"{error.stage} failed and left the device state unknown: "
                                        f"{type(cause).__name__}: {cause}")  # fmt: skip
        if error.stage in ("setup", "read") or not self.executor.recovers:
            # a set-up that raised may have written some table rows and not others: every request in a
            # slot may read wrong blocks, so all of them fail
            self._fail_running(f"step {error.stage}", cause, plan)
            return scheduler.update(StepResult())
        if error.stage == "decode step":  # the prefill's results stand; the step's requests fail
            decoding = scheduler.planned_requests("decode step")
            events = scheduler.update(StepResult(error.prefill or []))
            scheduler.fail_stage("decode step", cause, decoding)
            return events + scheduler.take_events()
        assert plan.prefill is not None
        prefill = self._chunks_alone(plan.prefill, cause)
        if scheduler.unusable is not None or plan.decode is None:
            return scheduler.update(StepResult(prefill))
        decode_only = StepPlan(released=scheduler.take_released(), decode=plan.decode, masks=plan.masks,
                               read_pending=plan.read_pending)  # fmt: skip
        try:
            result = self.executor.execute(decode_only)
            decode, pending = result.decode, result.pending
        except StageError as failed:
            decoding = scheduler.planned_requests("decode step")
            scheduler.fail_stage("decode step", failed.__cause__ or failed, decoding)
            decode, pending = None, {}
        return scheduler.update(StepResult(prefill, decode, pending))

    def _chunks_alone(self, batch: PrefillBatch, cause: BaseException) -> list[ChunkResult | None]:
        """After a prefill forward raised: each chunk again alone, failing only those that raise again
        (all of them, without trying, when the forward had one chunk or left the device unusable)."""
        scheduler = self.scheduler
        requests = scheduler.planned_requests("prefill")
        results: list[ChunkResult | None] = [None] * len(batch.chunks)
        if len(batch.chunks) == 1 or device_unusable(cause):
            scheduler.fail_stage("prefill", cause, requests)
            return results
        for i, chunk in enumerate(batch.chunks):
            if scheduler.unusable is not None:
                break
            try:
                alone = StepPlan(prefill=PrefillBatch((chunk,), batch.logits))
                results[i] = self.executor.execute(alone).prefill[0]
            except StageError as failed:
                scheduler.fail_stage("prefill", failed.__cause__ or failed, [requests[i]])
        return results


def _merged(events: Events) -> Events:
    """One (request, text) per request, its pieces joined in order."""
    texts: dict[Request, str] = {}
    for request, text in events:
        texts[request] = texts.get(request, "") + text
    return list(texts.items())
