"""EngineCore without a model (fake_executor.py): which requests a failed stage fails, what the device hears
of afterwards, when the engine stops taking requests, and who may drive it from which thread."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from fake_executor import SCRATCH, FakeExecutor, continuation
from test_scheduler import TOKENIZER, engine, request, run, tokenizer  # noqa: F401

from redline.failures import DeviceUnusableError
from redline.runner.plan import StageError, StepPlan, StepResult

pytestmark = pytest.mark.usefixtures("tokenizer")  # test_scheduler's: it sets TOKENIZER


class Failing(FakeExecutor):
    """Fails `stage` of the plans for which `when(plan)` holds, as the runner would: what ran before the
    stage stays done ("setup": nothing; "prefill": the set-up; "decode step": the prefill too, whose
    results it carries; "read": everything)."""

    def __init__(self, fake: FakeExecutor, stage: str, when):
        self.__dict__.update(fake.__dict__)
        self.stage, self.when = stage, when

    def execute(self, plan: StepPlan) -> StepResult:
        if not self.when(plan):
            return super().execute(plan)
        cause = RuntimeError(f"injected {self.stage} failure")
        if self.stage == "setup":
            self.plans.append(plan)
            raise StageError("setup") from cause
        done = {"prefill": StepPlan(plan.released, plan.tables, plan.admitted),
                "decode step": dataclasses.replace(plan, decode=None), "read": plan}[self.stage]  # fmt: skip
        result = super().execute(done)
        raise StageError(self.stage, result.prefill if self.stage == "decode step" else None) from cause


def failing(core, stage: str, when) -> Failing:
    core.executor = Failing(core.executor, stage, when)
    return core.executor


def test_a_chunk_that_fails_alone_fails_alone():
    """Two prompts in one prefill forward that raises: each runs again alone, and only the one that
    raises again fails; the other completes with the model's own continuation."""
    core, _ = engine(slots=2, max_len=200, k=2, blocks=64)
    good, bad = request([5] * 20, 6), request([6] * 30, 6)
    failing(
        core, "prefill", lambda p: p.prefill is not None and any(c.tokens[0] == 6 for c in p.prefill.chunks)
    )
    run(core, [good, bad])
    assert bad.finish_reason == "error" and "injected prefill failure" in bad.error
    assert good.output_ids == continuation(good.prompt_ids, 6, TOKENIZER[0].vocab_size)
    assert core.stats().kv_blocks_free == 64 and core.unusable is None


def test_a_failed_decode_step_fails_its_requests_and_the_prefill_results_stand():
    core, fake = engine(slots=2, max_len=200, k=0, blocks=64)
    first = request([5] * 10, 8)
    core.add(first)
    core.step()  # prefilled, and one step
    second = request([6] * 10, 8)
    core.add(second)
    fake = failing(core, "decode step", lambda p: p.decode is not None and p.prefill is not None)
    core.step()  # second's prefill runs; the step over both raises
    assert first.finish_reason == "error" and "injected decode step failure" in first.error
    assert second.finish_reason == "error"  # its slot decoded in the failed step too
    fake.when = lambda p: False
    third = request([7] * 10, 4)
    run(core, [third])
    assert third.output_ids == continuation(third.prompt_ids, 4, TOKENIZER[0].vocab_size)


@pytest.mark.parametrize("stage", ["setup", "read"])
def test_a_failed_setup_or_read_fails_every_running_request_and_resends_the_releases(stage):
    """A set-up that raised may have written some table rows and not others; a read that failed leaves
    the device state unknown. Every request in a slot fails; the slots the plan released go out again
    with the next plan; after a failed read the engine takes no more requests."""
    core, fake = engine(slots=3, max_len=200, k=0, blocks=64)
    long, short = request([6] * 10, 30), request([5] * 10, 2)
    core.add(long)
    core.step()  # long in slot 0
    core.add(short)
    core.step()  # short in slot 1: prefilled and stepped, it ends; the device hears of that next plan
    assert short.finish_reason == "length" and fake.active[short.slot], short.error
    fake = failing(core, stage, lambda p: short.slot in p.released)
    core.step()
    assert long.finish_reason == "error" and f"injected {stage} failure" in long.error
    fake.when = lambda p: False
    if stage == "read":
        assert core.unusable is not None and "left the device state unknown" in core.unusable
        with pytest.raises(DeviceUnusableError):
            core.add(request([7] * 5, 2))
        return
    core.step()  # the failed plan's releases go out again: the device holds no slot
    assert not any(fake.active) and all(set(row) == {SCRATCH} for row in fake.table)
    third = request([7] * 10, 4)
    run(core, [third])
    assert third.output_ids == continuation(third.prompt_ids, 4, TOKENIZER[0].vocab_size)


def test_without_recovery_any_failed_stage_makes_the_device_unusable():
    """Under tensor parallelism the ranks may have left a failed plan at different points: a chunk rerun
    alone would meet collectives the others never reach. So every request fails, and no new one is taken."""
    core, _ = engine(slots=2, max_len=200, k=0, blocks=64)
    fake = failing(core, "prefill", lambda p: p.prefill is not None)
    fake.recovers = False
    a, b = request([5] * 10, 4), request([6] * 10, 4)
    core.add(a)
    core.add(b)
    core.step()
    assert a.finish_reason == b.finish_reason == "error" and core.unusable is not None
    assert len(fake.plans) == 1  # nothing was run again alone
    with pytest.raises(DeviceUnusableError, match="left the device state unknown"):
        core.add(request([7] * 5, 2))


def test_threads_take_turns_but_never_drive_at_once():
    core, _ = engine(slots=2, max_len=200, k=0, blocks=64)
    done = []

    def generate(prompt: list[int]) -> None:
        r = request(prompt, 4)
        with core.driving():
            run(core, [r])
        done.append(r.output_ids)

    for prompt in ([5] * 8, [6] * 8):  # one thread after another: each drives the whole run
        worker = threading.Thread(target=generate, args=(prompt,))
        worker.start()
        worker.join()
    assert len(done) == 2
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with core.driving():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    inside.wait(10)
    with pytest.raises(RuntimeError, match="driven by thread 'holder'"):
        core.add(request([5] * 4, 2))
    leave.set()
    holder.join()
    run(core, [request([5] * 4, 2)])  # free again
