"""The Hypothesis state machine both engines run (the real one in test_block_accounting.py, the scheduler
over a toy model in test_scheduler.py): prompts over a 3-token alphabet (so prefixes are shared and
cached), stop strings, cancellations at any point (waiting, prefilling, decoding), and steps, over a pool
small enough to run dry and preempt. After every rule each block is held exactly as often as the slots'
tables list it; at the end every request has finished without error and the pool is whole again."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from redline.engine.core import EngineCore
from redline.engine.request import Request


class BlockMachine(RuleBasedStateMachine):
    core: EngineCore  # set by the subclass's __init__

    def __init__(self):
        super().__init__()
        self.requests: list[Request] = []

    def new_request(self, prompt: list[int], max_tokens: int, stop: list[str] | None) -> Request:
        raise NotImplementedError

    @rule(
        prompt=st.lists(st.integers(5, 7), min_size=1, max_size=40),
        max_tokens=st.integers(1, 50),
        stop=st.booleans(),
    )
    def arrive(self, prompt, max_tokens, stop):
        request = self.new_request(prompt, max_tokens, ["a"] if stop else None)
        self.core.add(request)
        self.requests.append(request)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.core.step()

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(which=st.integers(0, 100))
    def cancel(self, which):
        live = [r for r in self.requests if not r.finished]
        self.core.cancel(live[which % len(live)])

    @invariant()
    def every_block_is_accounted_for(self):
        scheduler = self.core.scheduler
        pool = scheduler.pool
        held = [b for slot in scheduler.running for b in scheduler.tables[slot].blocks]
        free_slots = [s for s in range(scheduler.shapes.slots) if s not in scheduler.running]
        assert all(not scheduler.tables[s].blocks for s in free_slots)
        for block in range(pool.num_blocks):
            assert pool.refs[block] == held.count(block)
            assert (block in pool.free) + (block in pool.evictable) == (pool.refs[block] == 0)
        assert pool.available + len(set(held)) == pool.num_blocks
        assert not any(r.finish_reason == "error" for r in self.requests), [r.error for r in self.requests]

    def teardown(self):
        while self.core.has_work:
            self.core.step()
        pool = self.core.scheduler.pool
        assert pool.available == pool.num_blocks and not any(pool.refs)
        for r in self.requests:
            assert r.finished and r.finish_reason != "error"
            if r.finish_reason == "length":
                assert len(r.output_ids) == r.params.max_tokens
