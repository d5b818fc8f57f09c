"""No sequence of arrivals, cancellations, stops and preemptions loses a KV block: a Hypothesis state
machine drives the real scheduler (a tiny Llama 3 target with an EAGLE-3 draft, 3 slots over a pool
of 8 blocks, chunked prefill, prefix caching) and checks the pool against the requests after every
rule."""

from __future__ import annotations

import pytest
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from redline import LLM, SamplingParams
from redline.engine.request import Request
from redline.models.random_init import write_random_draft

LLM_BOX: list[LLM] = []  # built once per test session (a state machine cannot take fixtures)


@pytest.fixture(scope="module", autouse=True)
def llm(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("accounting")
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=7), root / "t", tokenizer_dir)
    kw = dict(dtype="float32", max_batch=3, max_seq_len=96, compile=False, progress=False)
    kw.update(draft=write_random_draft(target, root / "d"), num_draft_tokens=2, max_prefill_tokens=32)
    block_bytes = LLM(target, **kw).runner.block_bytes
    LLM_BOX.append(LLM(target, kv_cache_memory=8 * block_bytes, **kw))
    yield
    LLM_BOX.clear()


class EngineMachine(RuleBasedStateMachine):
    """Prompts over a 3-token alphabet (so prefixes are shared and cached), stop strings, cancellations
    at any point (waiting, prefilling, decoding), and steps; the pool runs dry and preempts."""

    def __init__(self):
        super().__init__()
        self.llm = LLM_BOX[0]
        self.scheduler = self.llm.scheduler
        self.requests: list[Request] = []

    @rule(
        prompt=st.lists(st.integers(5, 7), min_size=1, max_size=40),
        max_tokens=st.integers(1, 50),
        stop=st.booleans(),
    )
    def arrive(self, prompt, max_tokens, stop):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=["a"] if stop else None)
        request = self.llm.make_request(prompt, params)
        self.scheduler.add(request)
        self.requests.append(request)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.scheduler.step()

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(which=st.integers(0, 100))
    def cancel(self, which):
        live = [r for r in self.requests if not r.finished]
        self.scheduler.cancel(live[which % len(live)])

    @invariant()
    def every_block_is_accounted_for(self):
        runner = self.llm.runner
        pool = runner.pool
        held = [b for slot in self.scheduler.running for b in runner.block_tables[slot].blocks]
        free_slots = [s for s in range(runner.slots) if s not in self.scheduler.running]
        assert all(not runner.block_tables[s].blocks for s in free_slots)
        for block in range(pool.num_blocks):
            assert pool.refs[block] == held.count(block)
            assert (block in pool.free) + (block in pool.evictable) == (pool.refs[block] == 0)
        assert pool.available + len(set(held)) == pool.num_blocks
        assert not any(r.finish_reason == "error" for r in self.requests), [r.error for r in self.requests]

    def teardown(self):
        while self.scheduler.has_work:
            self.scheduler.step()
        pool = self.llm.runner.pool
        assert pool.available == pool.num_blocks and not any(pool.refs)
        for r in self.requests:
            assert r.finished and r.finish_reason != "error"
            if r.finish_reason == "length":
                assert len(r.output_ids) == r.params.max_tokens


EngineMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)
test_no_sequence_of_requests_loses_a_block = EngineMachine.TestCase
