"""No sequence of arrivals, cancellations, stops and preemptions loses a KV block, end to end: a
Hypothesis state machine drives the real engine (a tiny Llama 3 target with an EAGLE-3 draft, 3 slots
over a pool of 8 blocks, chunked prefill, prefix caching) and checks the pool against the requests after
every rule. tests/test_scheduler.py runs the same machine against the scheduler alone, on a toy model."""

from __future__ import annotations

import pytest
from block_machine import BlockMachine
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from hypothesis import settings

from redline import LLM, SamplingParams
from redline.engine.request import Request
from redline.train.random_init import write_random_draft

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


class EngineMachine(BlockMachine):
    """block_machine.py's rules over the real engine."""

    def __init__(self):
        super().__init__()
        self.llm = LLM_BOX[0]
        self.core = self.llm.engine

    def new_request(self, prompt: list[int], max_tokens: int, stop: list[str] | None) -> Request:
        return self.llm.make_request(
            prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop)
        )


EngineMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)
test_no_sequence_of_requests_loses_a_block = EngineMachine.TestCase
