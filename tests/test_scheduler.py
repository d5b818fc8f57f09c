"""The scheduler without a model: plans executed by a toy model on a toy paged cache (fake_executor.py),
which checks every plan (blocks held for every read and write, rows covering every decoding slot, kv_len
covering every step) and whose tokens depend on what the cache holds. A Hypothesis state machine drives
arrivals, steps, stop strings and cancellations over a pool small enough to preempt; every request must
end with the toy model's own continuation, and no block may leak."""

from __future__ import annotations

import pytest
from block_machine import BlockMachine
from fake_executor import FakeExecutor, continuation
from hypothesis import settings
from hypothesis.stateful import invariant

from redline.engine.core import EngineCore
from redline.engine.request import Request
from redline.engine.scheduler import Scheduler
from redline.runner.plan import Shapes
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer

TOKENIZER: list[Tokenizer] = []  # a state machine cannot take fixtures


@pytest.fixture(scope="module", autouse=True)
def tokenizer(tokenizer_dir):
    TOKENIZER.append(Tokenizer.from_dir(tokenizer_dir))
    yield TOKENIZER[0]
    TOKENIZER.clear()


def engine(slots: int, max_len: int, k: int, blocks: int, prefill_tokens: int | None = None,
           caching: bool = True, adaptive: bool = False) -> tuple[EngineCore, FakeExecutor]:  # fmt: skip
    shapes = Shapes(slots, max_len, k, adaptive=adaptive)
    executor = FakeExecutor(shapes, blocks, TOKENIZER[0].vocab_size)
    return EngineCore(Scheduler(shapes, blocks, prefill_tokens, caching, draft=k > 0), executor), executor


def request(prompt: list[int], max_tokens: int, **kw) -> Request:
    tokenizer = TOKENIZER[0]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(prompt, params, tokenizer, tokenizer.eos_token_ids)


def run(core: EngineCore, requests: list[Request]) -> None:
    for r in requests:
        core.add(r)
    while core.has_work:
        core.step()


@pytest.mark.parametrize("k", [0, 3])
def test_requests_get_the_models_continuation_in_every_slot_and_step(k):
    core, _ = engine(slots=4, max_len=200, k=k, blocks=64)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]  # 6 requests over 4 slots
    requests = [request(p, 20 + i) for i, p in enumerate(prompts)]
    run(core, requests)
    vocab = TOKENIZER[0].vocab_size
    assert [r.output_ids for r in requests] == [continuation(p, 20 + i, vocab) for i, p in enumerate(prompts)]
    assert core.stats().kv_blocks_free == 64 and core.stats().running == 0


def test_steps_that_draft_nothing_reach_the_requests():
    """Adaptive draft length: the plan's k reaches the executor, each step's tokens the requests; only the
    steps that drafted count towards acceptance."""
    core, _ = engine(slots=4, max_len=200, k=3, blocks=64, adaptive=True)
    steps = iter(range(10**6))
    core.scheduler.draft_length.choose = lambda rows, slots, seeded=False, logits=False: 3 * (next(steps) % 2)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    requests = [request(p, 20 + i) for i, p in enumerate(prompts)]
    for r in requests:
        r.num_draft_tokens = 3
    run(core, requests)
    vocab = TOKENIZER[0].vocab_size
    assert [r.output_ids for r in requests] == [continuation(p, 20 + i, vocab) for i, p in enumerate(prompts)]
    for r in requests:
        c = r.completion()
        assert 0 < c.draft_steps < c.decode_steps and 1.0 <= c.acceptance_length <= 4.0


def test_a_long_prompt_prefills_in_chunks_while_a_stream_decodes():
    """Budget 64: a 150-token prompt prefills in chunks of 64, 64, 22, one per step; the stream that was
    decoding gets a token every one of those steps."""
    core, fake = engine(slots=2, max_len=400, k=0, blocks=64, prefill_tokens=64)
    stream = request([9, 9, 9], 30)
    core.add(stream)
    core.step()  # its prefill, and its first decode step in the same plan
    assert len(stream.output_ids) == 2
    long = request(list(range(10, 160)), 4)
    core.add(long)
    for expected in (3, 4, 5):
        core.step()
        assert len(stream.output_ids) == expected
    chunks = [[len(c.tokens) for c in p.prefill.chunks] for p in fake.plans[-3:]]
    assert chunks == [[64], [64], [22]] and len(long.output_ids) == 2  # first token + one step
    while core.has_work:
        core.step()
    assert long.output_ids == continuation(long.prompt_ids, 4, TOKENIZER[0].vocab_size)


def test_eight_short_prompts_share_one_prefill_forward():
    core, fake = engine(slots=8, max_len=300, k=0, blocks=128, prefill_tokens=2048)
    run(core, [request([5 + i] * 100, 2) for i in range(8)])
    assert [len(c.tokens) for c in fake.plans[0].prefill.chunks] == [100] * 8


def test_preemption_recomputes_and_keeps_the_outputs():
    """3 slots over 10 blocks of 16: the three requests cannot all grow to 60 tokens; the newest is
    preempted, prefilled again over its prompt and outputs, and ends with the same continuation."""
    core, _ = engine(slots=3, max_len=96, k=2, blocks=10)
    prompts = [[5, 6, 7] * 4, [7, 6] * 5, [6] * 9]
    requests = [request(p, 48) for p in prompts]
    run(core, requests)
    vocab = TOKENIZER[0].vocab_size
    assert sum(r.preemptions for r in requests) > 0
    assert [r.output_ids for r in requests] == [continuation(p, 48, vocab) for p in prompts]


def test_a_request_larger_than_the_pool_fails_naming_the_pool():
    core, _ = engine(slots=2, max_len=400, k=0, blocks=4)
    big, small = request(list(range(5, 80)), 4), request([5, 6], 4)
    run(core, [big, small])
    assert big.finish_reason == "error" and "needs more KV blocks than the pool has (4 blocks" in big.error
    assert small.finish_reason == "length"


def test_a_prefix_cache_hit_computes_only_the_rest():
    core, fake = engine(slots=2, max_len=200, k=2, blocks=32)
    shared = list(range(20, 60))  # 40 tokens: 2 full blocks
    run(core, [request([*shared, 5, 6], 3)])
    second = request([*shared, 7, 8, 9], 3)
    run(core, [second])
    starts = [c.start for p in fake.plans if p.prefill is not None for c in p.prefill.chunks]
    assert second.cached_tokens == 32 and starts == [0, 32]
    assert second.output_ids == continuation(second.prompt_ids, 3, TOKENIZER[0].vocab_size)


def test_samples_of_one_prompt_wait_for_the_first_prefill_then_reuse_its_blocks():
    core, _ = engine(slots=4, max_len=200, k=0, blocks=32)
    group = object()
    samples = [request(list(range(30, 70)), 3, seed=i) for i in range(3)]
    for s in samples:
        s.group = group
    run(core, samples)
    assert [s.cached_tokens for s in samples] == [0, 32, 32]


class SchedulerMachine(BlockMachine):
    """block_machine.py's rules over the toy model, whose outputs must be its own continuations."""

    K = 0

    def __init__(self):
        super().__init__()
        self.core, self.fake = engine(slots=3, max_len=96, k=self.K, blocks=8, prefill_tokens=32)

    def new_request(self, prompt: list[int], max_tokens: int, stop: list[str] | None) -> Request:
        return request(prompt, max_tokens, stop=stop)

    @invariant()
    def outputs_are_the_models_own(self):
        vocab = TOKENIZER[0].vocab_size
        for r in self.requests:
            assert r.output_ids == continuation(r.prompt_ids, len(r.output_ids), vocab)


class SpeculativeSchedulerMachine(SchedulerMachine):
    K = 2


for machine in (SchedulerMachine, SpeculativeSchedulerMachine):
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_no_sequence_of_requests_loses_a_block_or_a_token = SchedulerMachine.TestCase
test_with_speculation_no_sequence_of_requests_loses_a_block_or_a_token = SpeculativeSchedulerMachine.TestCase


def test_a_request_for_one_token_takes_no_decode_step():
    """Its first token comes from the prefill and ends it: the plan runs no decode step for it."""
    core, fake = engine(slots=2, max_len=100, k=2, blocks=16)
    one = request([5] * 10, 1)
    run(core, [one])
    assert one.output_ids == continuation(one.prompt_ids, 1, TOKENIZER[0].vocab_size)
    assert all(p.decode is None for p in fake.plans) and not any(fake.active)
