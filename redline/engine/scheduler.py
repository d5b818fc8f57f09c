"""Continuous batching: requests join free slots at step boundaries and leave as soon as they finish.

Each step: admit waiting requests into free slots, run one prefill forward, then one decode step for
every request past its prefill.

KV blocks (engine/blocks.py, through ModelRunner.admit and reserve): a request joins only when the pool
holds blocks for its tokens (its cached prompt prefix reused), and before each decode step every
decoding request gets blocks for the step's writes, oldest first. When the pool runs dry the newest
running request is preempted: its blocks go back, and it waits at the head of the queue to be
prefilled again over its prompt and the tokens it has produced (its outputs are unchanged: greedy and
seeded draws depend only on the position). A request that could not fit even alone fails with an
error that names the sizes.

Prefill (engine/prefill.py): the requests still prefilling, in admission order, share one forward of
at most max_prefill_tokens tokens, padding included (rows x the longest chunk, rounded up to 16). Each
takes the rest of its tokens, at most the budget; one that would overflow it takes a chunk no longer
than the rows before it, if that fits; else the forward is full. Example, budget 2,048: a 4,000-token
prompt prefills in chunks of 2,048 and 1,952, one per step, while the running streams decode a step
after each; eight 100-token prompts prefill as one 8 x 112 batch. A prompt's final chunk gives its
first token, and its slot decodes from the same step on.

A failure ends only the requests it touched: a prefill (or its first token) that raises fails its own
request, a decode step that raises fails the requests in the step; their slots are freed and the
others go on. An error that leaves the device unusable (failures.device_unusable) fails every request,
and the scheduler refuses new ones from then on (`unusable` says why).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from redline.engine.compiled_prefill import padded_prompt_len
from redline.engine.failures import DeviceUnusableError, describe, device_unusable
from redline.engine.prefill import PrefillChunk, PrefillResult
from redline.engine.request import Request
from redline.engine.runner import ModelRunner, batch_bucket

log = logging.getLogger("redline.engine")

Events = list[tuple[Request, str]]


class Scheduler:
    def __init__(self, runner: ModelRunner, max_prefill_tokens: int | None = None):
        """max_prefill_tokens: tokens of one prefill forward, padding included (None: a whole context,
        so every prompt prefills in one forward)."""
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens or runner.cache_len
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
        """Admits waiting requests into free slots, runs one prefill forward, then decodes one step for
        every request past its prefill. Returns (request, new text) once for every request that received
        tokens or finished, failed ones too (a request prefilled and decoded in this step: both pieces)."""
        events: Events = []
        self._admit(events)
        if self.unusable is None:
            self._prefill(events)
        if self._decoding() and self.unusable is None:
            self._reserve_step(events)
        if self._decoding() and self.unusable is None:
            self._decode(events)
        texts: dict[Request, str] = {}
        for request, text in events:
            texts[request] = texts.get(request, "") + text
        return list(texts.items())

    def _decoding(self) -> dict[int, Request]:
        """Running requests past their prefill, by slot, in admission order."""
        return {slot: r for slot, r in self.running.items() if r.prefill_ids is None}

    def _admit(self, events: Events) -> None:
        """Waiting requests into free slots while the pool holds their tokens, oldest first."""
        free = [s for s in range(self.runner.slots) if s not in self.running]
        for request in list(self.waiting):
            if not free or self.unusable is not None:
                break
            if self._sibling_prefilling(request):
                continue  # it waits a step, then takes the sibling's prompt blocks from the prefix cache
            slot = free[0]
            tokens = request.prompt_ids + request.output_ids  # a preempted request's too
            try:
                cached = self.runner.admit(
                    slot, tokens, request.params, request.seed, len(request.prompt_ids)
                )
            except Exception as error:
                self._failed("prefill", error, [request], events)
                if self.unusable is None:
                    self.runner.release(slot)
                continue
            if cached is None:
                if self.running:
                    break  # blocks come back as running requests end
                self.waiting.remove(request)
                self.fail(request, self._too_large(len(tokens)))
                events.append((request, ""))
                continue
            self.waiting.remove(request)
            request.slot = free.pop(0)
            request.prefill_ids, request.computed = tokens, cached
            request.cached_tokens += cached
            self.running[slot] = request

    def _sibling_prefilling(self, request: Request) -> bool:
        """Whether another of the n samples of the request's prompt is still prefilling it (with prefix
        caching: once it is done, the prompt's full blocks are in the cache and the request reuses them)."""
        return (
            request.group is not None
            and self.runner.prefix_caching
            and request.params.prompt_logprobs is None  # it would not reuse them: prefill at once
            and any(r.group is request.group and r.prefill_ids is not None for r in self.running.values())
        )

    def _prefill(self, events: Events) -> None:
        """One prefill forward over the next chunks of the requests still prefilling."""
        chunks: list[PrefillChunk] = []
        requests: list[Request] = []
        budget, length = self.max_prefill_tokens, 0  # length: the longest chunk so far
        padded = lambda rows, n: rows * padded_prompt_len(n, self.runner.cache_len)  # tokens computed
        for request in self.running.values():
            if request.prefill_ids is None:
                continue
            chunk = min(len(request.prefill_ids) - request.computed, budget)
            if chunks and padded(len(chunks) + 1, max(length, chunk)) > budget:
                if padded(len(chunks) + 1, length) > budget:
                    break
                chunk = min(chunk, length)  # a row no longer than the others still fits
            length = max(length, chunk)
            assert request.slot is not None
            end = request.computed + chunk
            chunks.append(PrefillChunk(request.slot, request.prefill_ids, request.computed, end))
            requests.append(request)
        if not chunks:
            return
        for request, chunk, result in self._run_prefill(requests, chunks, events):
            request.computed = chunk.end
            if result.prompt_logprobs is not None and not request.prompt_logprobs_done:
                request.add_prompt_logprobs(result.prompt_logprobs)  # (not again after a preemption)
            if result.first is None:
                continue
            request.prefill_ids = None
            try:
                if request.params.max_tokens == 0:
                    request.end_prefill_only()
                    events.append((request, ""))
                else:
                    logprobs = None if result.logprob is None else [result.logprob]
                    events.append((request, request.accept([result.first], logprobs)))
            except Exception as error:
                self._failed("prefill", error, [request], events)
                continue
            if request.finished:
                self._free(chunk.slot)

    def _run_prefill(
        self, requests: list[Request], chunks: list[PrefillChunk], events: Events
    ) -> list[tuple[Request, PrefillChunk, PrefillResult]]:
        """runner.prefill_batch; when the batch raises, each chunk again alone, so that a failure (an
        out-of-memory prompt, say) fails only its own request. Returns the chunks that ran and their
        results (first tokens, log-probabilities)."""
        try:
            return list(zip(requests, chunks, self.runner.prefill_batch(chunks), strict=True))
        except Exception as error:
            if len(chunks) == 1 or device_unusable(error):
                self._failed("prefill", error, requests, events)
                return []
        ran = []
        for request, chunk in zip(requests, chunks, strict=True):
            try:
                ran.append((request, chunk, self.runner.prefill_batch([chunk])[0]))
            except Exception as error:
                self._failed("prefill", error, [request], events)
                if self.unusable is not None:
                    return []
        return ran

    def _reserve_step(self, events: Events) -> None:
        """Blocks for the next step of every decoding request, oldest first, preempting the newest running
        request while the pool is short (the short one itself, when it is the newest)."""
        for slot, request in self._decoding().items():  # admission order
            if self.running.get(slot) is not request:
                continue  # preempted meanwhile
            while not self._reserve(slot, request, events):
                if len(self.running) == 1:  # alone and still short
                    self.fail(request, self._too_large(request.position + 1))
                    events.append((request, ""))
                    break
                newest = next(reversed(self.running.values()))
                self._preempt(newest)
                if newest is request:
                    break

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
        request.slot, request.prefill_ids = None, None
        if not request.prompt_logprobs_done:  # its prefill starts over at the first token
            request.prompt_logprobs.clear()
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
        decoding = self._decoding()
        rows = batch_bucket(max(decoding) + 1, self.runner.slots)
        last_position = max(r.position for r in decoding.values())
        try:
            out = self.runner.decode(rows, last_position)
        except Exception as error:
            self._failed("decode step", error, list(decoding.values()), events)
            return
        for slot, request in decoding.items():
            try:
                *emitted, n_acc = out.tokens[slot]
                request.record_step(n_acc)
                events.append((request, request.accept(emitted[: n_acc + 1], out.logprobs.get(slot))))
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

    def _free(self, slot: int) -> None:
        del self.running[slot]
        self.runner.release(slot)
