"""Continuous batching, as a plan per step: the scheduler owns the KV block pool (engine/blocks.py), the
prefix cache, the queue and the slots, and turns them into one StepPlan (runner/plan.py) each step; the
runner executes it and the scheduler takes the result back (`update`).

Each plan, in order:
1. blocks for the next step of every decoding request, oldest first. When the pool is short the newest
   running request is preempted: its blocks go back, and it waits at the head of the queue to be
   prefilled again over its prompt and the tokens it has produced (its outputs are unchanged: greedy and
   seeded draws depend only on the position). A request that cannot fit even alone fails with an error
   naming the sizes.
2. waiting requests into free slots while the pool holds their tokens and a step's lookahead (their
   cached prompt prefix reused), oldest first.
3. one prefill forward: the requests still prefilling, in admission order, share at most
   max_prefill_tokens tokens, padding included (rows x the longest chunk, rounded up to 16). Each takes
   the rest of its tokens, at most the budget; one that would overflow it takes a chunk no longer than
   the rows before it, if that fits; else the forward is full. Example, budget 2,048: a 4,000-token
   prompt prefills in chunks of 2,048 and 1,952, one per step, while the running streams decode a step
   after each; eight 100-token prompts prefill as one 8 x 112 batch.
4. one decode step for every request past its prefill, those whose final chunk is in this plan included:
   a prompt's final chunk gives its first token, and its slot decodes from the same step on. A request
   with structured output (a grammar) starts decoding a plan later: its step's token masks need that
   first token and the draft's proposals after it, which the runner reads back (engine/grammar_masks.py).

The result: each request's new tokens through Request.accept (stops, text), finished requests' slots
freed (told to the runner in the next plan), final prefill chunks' full blocks offered to the prefix cache.
The scheduler never touches the device, so it is tested without a model (tests/test_scheduler.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from redline.engine.blocks import BlockPool, BlockTable, OutOfBlocks
from redline.engine.draft_length import DraftLength
from redline.engine.grammar_masks import first_token_mask, step_mask
from redline.engine.request import Request
from redline.failures import DeviceUnusableError, describe, device_unusable
from redline.kernels.paged_kv import BLOCK
from redline.runner.plan import (
    DecodeBatch,
    PrefillBatch,
    PrefillChunk,
    Shapes,
    SlotSampling,
    SlotSetup,
    StepPlan,
    StepResult,
    TableUpdate,
    TokenMask,
)
from redline.structured.draft_masks import install
from redline.structured.rules import TokenRules

log = logging.getLogger("redline.engine")

Events = list[tuple[Request, str]]


@dataclass
class Planned:
    """What the last plan asked for, so its result can be read back."""

    chunks: list[tuple[Request, PrefillChunk]] = field(default_factory=list)
    decoding: dict[int, Request] = field(default_factory=dict)  # slot -> request, admission order
    masks: list[TokenMask] = field(default_factory=list)  # structured outputs' (engine/grammar_masks.py)
    unread: list[int] = field(default_factory=list)  # prefilled constrained slots whose pending is unknown
    rules: dict[int, TokenRules] = field(default_factory=dict)  # slot -> the rules its rows run under
    logits: bool = False  # the decode step is on the logits path (DecodeBatch.logits)


class Scheduler:
    def __init__(
        self,
        shapes: Shapes,
        num_blocks: int,
        max_prefill_tokens: int | None = None,
        prefix_caching: bool = True,
        draft: bool = False,
    ):
        """max_prefill_tokens: tokens of one prefill forward, padding included (None: a whole context, so
        every prompt prefills in one forward). With a draft a cached block's key also covers the token
        after it (engine/blocks.py)."""
        self.shapes = shapes
        self.pool = BlockPool(num_blocks, BLOCK, int(draft))
        self.tables = [BlockTable(self.pool) for _ in range(shapes.slots)]
        self.max_prefill_tokens = max_prefill_tokens or shapes.cache_len
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request, admission order
        self.unusable: str | None = None  # why the device can run nothing more, once it cannot
        self.prefilled_tokens = 0  # prompt positions computed by prefill (prefix-cache hits are not)
        self._released: list[int] = []  # slots freed since the last plan
        self._tables: list[TableUpdate] = []
        self._admitted: list[SlotSetup] = []
        self._events: Events = []  # requests failed while planning
        self.planned = Planned()
        # drafts verified per step: K, or with Shapes.adaptive 0 where drafting would not pay
        self.draft_length = DraftLength(shapes.k, shapes.adaptive, fresh_without_drafting=not draft)

    def add(self, request: Request) -> None:
        if self.unusable is not None:
            raise DeviceUnusableError(f"the device is unusable after an earlier error: {self.unusable}")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ----

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module's docstring)."""
        self.planned = Planned()
        if self.unusable is None:
            self._reserve_decoding()
            self._admit()
        prefill = self._plan_prefill() if self.unusable is None else None
        decode = self._plan_decode() if self.unusable is None else None
        masks, unread = tuple(self.planned.masks), tuple(self.planned.unread)
        install(self.planned.rules)  # for the draft's proposals in this thread's steps (draft_masks.py)
        plan = StepPlan(tuple(self._released), tuple(self._tables), tuple(self._admitted), prefill, decode,
                        masks, tuple(m.slot for m in masks) + unread)  # fmt: skip
        self._released, self._tables, self._admitted = [], [], []
        return plan

    def _decoding(self) -> dict[int, Request]:
        """Running requests past their prefill, by slot, in admission order."""
        return {slot: r for slot, r in self.running.items() if r.prefill_ids is None}

    def _reserve_decoding(self) -> None:
        """Blocks for the next step of every decoding request, oldest first, preempting the newest running
        request while the pool is short (the short one itself, when it is the newest)."""
        for slot, request in self._decoding().items():  # admission order
            if self.running.get(slot) is not request:
                continue  # preempted meanwhile
            while not self._grow(slot, request.position + self.shapes.lookahead):
                if len(self.running) == 1:  # alone and still short
                    self._end_too_large(request, self._too_large(request.position + 1))
                    break
                newest = next(reversed(self.running.values()))
                self._preempt(newest)
                if newest is request:
                    break

    def _grow(self, slot: int, positions: int) -> bool:
        """Blocks for positions [0, positions) of `slot`; False, taking none, when the pool is short."""
        table = self.tables[slot]
        held = len(table.blocks)
        try:
            table.ensure(min(positions, self.shapes.cache_len))
        except OutOfBlocks:
            return False
        if len(table.blocks) > held:
            self._tables.append(TableUpdate(slot, held, tuple(table.blocks[held:])))
        return True

    def _admit(self) -> None:
        """Waiting requests into free slots while the pool holds their tokens, oldest first."""
        free = [s for s in range(self.shapes.slots) if s not in self.running]
        for request in list(self.waiting):
            if not free:
                break
            if self._sibling_prefilling(request):
                continue  # it waits a step, then takes the sibling's prompt blocks from the prefix cache
            tokens = request.prompt_ids + request.output_ids  # a preempted request's too
            cached = self._take_blocks(free[0], tokens, request)
            if cached is None:
                if self.running:
                    break  # blocks come back as running requests end
                self.waiting.remove(request)
                self._end_too_large(request, self._too_large(len(tokens)))
                continue
            self.waiting.remove(request)
            request.slot = slot = free.pop(0)
            request.prefill_ids, request.computed = tokens, cached
            request.cached_tokens += cached
            self.running[slot] = request
            self.draft_length.admit(slot)
            self._admitted.append(self._setup(slot, request, tokens, self.shapes.ngram is not None))

    def _take_blocks(self, slot: int, tokens: list[int], request: Request) -> int | None:
        """Gives `slot` the blocks of `tokens` and a step's lookahead: the cached blocks of their longest
        cached prefix (with prefix caching), then new ones. Returns how many tokens are already in the
        cache, or None, taking nothing, when the pool is short. A request asking for prompt logprobs
        computes its whole prompt (no cached prefix)."""
        table = self.tables[slot]
        reuse = self.prefix_caching and request.params.prompt_logprobs is None
        cached = table.reuse_prefix(tokens) if reuse else 0
        try:
            table.ensure(min(len(tokens) + self.shapes.lookahead, self.shapes.cache_len))
        except OutOfBlocks:
            table.release()
            return None
        if reuse:
            table.count_lookup(tokens)
        self._tables.append(TableUpdate(slot, 0, tuple(table.blocks)))
        return cached

    @staticmethod
    def _setup(slot: int, request: Request, tokens: list[int], lookup: bool) -> SlotSetup:
        """The slot's sampling and bias row; its tokens so far where penalties or n-gram lookup read them."""
        params = request.params
        sampling = SlotSampling.of(params, request.seed)
        if not (params.penalized or lookup):
            return SlotSetup(slot, sampling, bias=request.bias)
        return SlotSetup(slot, sampling, tuple(tokens), len(request.prompt_ids), request.bias)

    def _sibling_prefilling(self, request: Request) -> bool:
        """Whether another of the n samples of the request's prompt is still prefilling it (with prefix
        caching: once it is done, the prompt's full blocks are in the cache and the request reuses them)."""
        return (
            request.group is not None
            and self.prefix_caching
            and request.params.prompt_logprobs is None  # it would not reuse them: prefill at once
            and any(r.group is request.group and r.prefill_ids is not None for r in self.running.values())
        )

    def _plan_prefill(self) -> PrefillBatch | None:
        """The next chunks of the requests still prefilling, as one forward within the token budget."""
        budget, length = self.max_prefill_tokens, 0  # length: the longest chunk so far
        padded = lambda rows, n: rows * self.shapes.prefill_len(n)  # tokens the forward computes
        for request in self.running.values():
            if request.prefill_ids is None:
                continue
            chunk = min(len(request.prefill_ids) - request.computed, budget)
            rows = len(self.planned.chunks)
            if rows and padded(rows + 1, max(length, chunk)) > budget:
                if padded(rows + 1, length) > budget:
                    break
                chunk = min(chunk, length)  # a row no longer than the others still fits
            length = max(length, chunk)
            planned = self._chunk(request, request.computed + chunk)
            self.planned.chunks.append((request, planned))
            if planned.final and request.rules is not None:
                self.planned.masks.append(first_token_mask(request, request.slot))
                self.planned.rules[request.slot] = request.rules
        if not self.planned.chunks:
            return None
        logits = any(r.params.needs_logits for r, _ in self.planned.chunks)
        return PrefillBatch(tuple(c for _, c in self.planned.chunks), logits)

    @staticmethod
    def _chunk(request: Request, end: int) -> PrefillChunk:
        sequence, start, params = request.prefill_ids, request.computed, request.params
        assert sequence is not None and request.slot is not None
        final = end == len(sequence)
        prompt_top = None if request.prompt_logprobs_done else params.prompt_logprobs
        decodes = _decodes_after(request) and request.rules is None  # its first mask needs the token
        return PrefillChunk(
            request.slot, tuple(sequence[start:end]), start, final, 0 if final else sequence[end],
            decodes, params.logprobs if final else None, prompt_top, len(request.prompt_ids),
        )  # fmt: skip

    def _plan_decode(self) -> DecodeBatch | None:
        """Every request past its prefill, and those whose final chunk this plan runs (unless their first
        token, from the prefill, is all they asked for: max_tokens 0 or 1, or they follow a grammar), in
        admission order; a grammar's masks for each constrained one."""
        first_at = {c.slot: c.end for _, c in self.planned.chunks if c.final and c.decodes}
        decoding, last = self.planned.decoding, 0  # last: the furthest pending token's position
        for slot, request in self.running.items():
            if request.rules is not None and request.pending is None:
                if request.prefill_ids is None:  # after a recovery that read nothing: read now
                    self.planned.unread.append(slot)
                continue  # its pending tokens come back with this plan (its final chunk's)
            if request.prefill_ids is None or slot in first_at:
                decoding[slot] = request
                last = max(last, request.position if request.prefill_ids is None else first_at[slot])
        if not decoding:
            return None
        rows = self.shapes.batch_bucket(max(decoding) + 1)
        logits = any(r.params.needs_logits for r in decoding.values())
        logprobs = {s: r.params.logprobs for s, r in decoding.items() if r.params.logprobs is not None}
        seeded = any(r.params.seed is not None and r.params.temperature > 0 for r in decoding.values())
        k = self.draft_length.choose(rows, list(decoding), seeded, logits=logits)
        self.planned.logits = logits
        for slot, request in decoding.items():
            if request.rules is not None:
                self.planned.masks.append(step_mask(request, slot, k, self.shapes))
                self.planned.rules[slot] = request.rules
        return DecodeBatch(rows, self.shapes.kv_len_for(last), logits, logprobs, k)

    # ---- results ----

    def update(self, result: StepResult) -> Events:
        """Takes the executed plan's result: prefill progress and first tokens, the step's tokens. Returns
        (request, new text) for every request that received tokens or finished, failed ones too."""
        events, self._events = self._events, []
        for slot, pending in result.pending.items():  # constrained requests' next masks start there
            if (request := self.running.get(slot)) is not None:
                request.pending = pending
        for (request, chunk), done in zip(self.planned.chunks, result.prefill, strict=False):
            if done is not None and not request.finished:
                self._prefilled(request, chunk, done, events)
        if result.decode is not None:
            decoded = result.decode
            running = [s for s, r in self.planned.decoding.items() if self.running.get(s) is r]
            rows, accepted = len(decoded.accepted), {s: decoded.accepted[s] for s in running}
            path = self.planned.logits
            self.draft_length.observe(rows, decoded.k, decoded.seconds, accepted, decoded.runner, logits=path)
            for slot, request in self.planned.decoding.items():
                if request.finished or self.running.get(slot) is not request:
                    continue  # finished by its first token, failed or cancelled meanwhile
                n_acc = result.decode.accepted[slot]
                try:
                    request.record_step(n_acc, decoded.k > 0)
                    emitted = result.decode.tokens[slot][: n_acc + 1]
                    events.append((request, request.accept(emitted, result.decode.logprobs.get(slot))))
                except Exception as error:
                    self.fail_stage("decode output", error, [request])
                    continue
                if request.finished:
                    self._free(slot)
        return events + self.take_events()

    def _prefilled(self, request: Request, chunk: PrefillChunk, done, events: Events) -> None:
        request.computed = chunk.end
        self.prefilled_tokens += len(chunk.tokens)
        if done.prompt_logprobs is not None and not request.prompt_logprobs_done:
            request.add_prompt_logprobs(done.prompt_logprobs)
        if done.first is None:
            return
        sequence, request.prefill_ids = request.prefill_ids, None
        assert sequence is not None
        if self.prefix_caching:
            self.tables[chunk.slot].cache_prompt([*sequence, done.first], len(sequence))
        try:
            if request.params.max_tokens == 0:
                request.end_prefill_only()
                events.append((request, ""))
            else:
                logprobs = None if done.logprob is None else [done.logprob]
                events.append((request, request.accept([done.first], logprobs)))
        except Exception as error:
            self.fail_stage("prefill", error, [request])
            return
        if request.finished:
            self._free(chunk.slot)

    def take_events(self) -> Events:
        events, self._events = self._events, []
        return events

    def resend_released(self, slots: tuple[int, ...]) -> None:
        """Slots a plan released that the device may not have heard of (the plan failed): again with the
        next plan."""
        self._released[:0] = slots

    def take_released(self) -> tuple[int, ...]:
        """Slots freed since the last plan, for a plan of their own (recovery after a failed stage)."""
        released, self._released = tuple(self._released), []
        return released

    def planned_requests(self, stage: str) -> list[Request]:
        """The requests a stage of the last plan ran: "prefill" (its chunks') or "decode step"."""
        if stage == "prefill":
            return [r for r, _ in self.planned.chunks]
        return list(self.planned.decoding.values())

    # ---- ending requests ----

    def _preempt(self, request: Request) -> None:
        """Gives the request's blocks back; it waits first in the queue to be prefilled again."""
        assert request.slot is not None
        self._free(request.slot)
        request.slot, request.prefill_ids, request.pending = None, None, None
        if not request.prompt_logprobs_done:  # its prefill starts over at the first token
            request.prompt_logprobs.clear()
        request.preemptions += 1
        self.waiting.appendleft(request)
        log.info("preempted a request at %d tokens: the KV pool is full", request.position + 1)

    def _too_large(self, tokens: int) -> str:
        return (
            f"a request of {tokens} tokens needs more KV blocks than the pool has "
            f"({self.pool.num_blocks} blocks of {self.pool.block_size} positions); raise kv_cache_memory"
        )

    def _end_too_large(self, request: Request, message: str) -> None:
        self.fail(request, message)
        self._events.append((request, ""))

    def cancel(self, request: Request) -> None:
        self._remove(request)
        request.cancel()

    def fail(self, request: Request, message: str) -> None:
        """Ends an unfinished request with finish_reason "error": out of the queue, or out of its slot."""
        if request.finished:
            return
        self._remove(request)
        request.fail(message)

    def fail_stage(self, stage: str, error: BaseException, requests: Iterable[Request]) -> None:
        """Fails `requests` for `error` ("prefill failed: OutOfMemoryError: ..."), every request when the
        error left the device unusable (failures.device_unusable: new ones are refused from then on);
        their events come with the next update."""
        message = describe(stage, error)
        log.error("%s; failing the requests in it", message, exc_info=error)
        if device_unusable(error):
            self.unusable = message
            requests = [*requests, *self.waiting, *self.running.values()]
        for request in dict.fromkeys(requests):
            if not request.finished:
                self.fail(request, message)
                self._events.append((request, ""))

    def _remove(self, request: Request) -> None:
        """Takes an unfinished request out of the queue or its slot."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request.slot is not None and not request.finished and self.running.get(request.slot) is request:
            self._free(request.slot)

    def _free(self, slot: int) -> None:
        del self.running[slot]
        self.draft_length.release(slot)
        self.tables[slot].release()
        self._tables = [u for u in self._tables if u.slot != slot]  # not written for a slot gone already
        self._released.append(slot)


def _decodes_after(request: Request) -> bool:
    """Whether a request decodes after its prefill's first token: not when that token is all it asked
    for (max_tokens 1, or 0: prompt logprobs only)."""
    return request.params.max_tokens - len(request.output_ids) > 1
