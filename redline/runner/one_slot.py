"""Driving a runner without a scheduler, one slot at a time: a prompt prefilled into a slot over blocks of
its own, steps on it, the slot released. Warm-up and the benchmarks use it; serving goes through the
scheduler's plans (engine/scheduler.py).

Slot s takes the pool's blocks [s M, s M + n), M the blocks of one whole context, n those of `positions`:
slot 1 of a 4,096-token context (M = 257) holding 100 positions takes blocks 257 .. 263.
"""

from __future__ import annotations

from collections.abc import Sequence

from redline.runner.model_runner import ModelRunner
from redline.runner.plan import PrefillBatch, PrefillChunk, SlotSampling, SlotSetup, StepPlan, TableUpdate
from redline.sampling import SamplingParams
from redline.structured.token_controls import token_bias


def fill_slot(
    runner: ModelRunner,
    prompt: Sequence[int],
    slot: int = 0,
    params: SamplingParams | None = None,
    positions: int | None = None,  # blocks for positions [0, positions); None: the whole context
    seed: int = 0,
) -> int:
    """Prefills `prompt` into `slot`, which decodes from then on (runner.run_step); returns the first
    token."""
    shapes, params = runner.shapes, params or SamplingParams()
    per_slot = shapes.blocks_for(shapes.cache_len)
    first = slot * per_slot
    blocks = tuple(range(first, first + shapes.blocks_for(positions or shapes.cache_len)))
    if blocks[-1] >= runner.num_blocks:
        raise ValueError(f"the KV pool ({runner.num_blocks} blocks) cannot give slot {slot} blocks "
                         f"{first}..{blocks[-1]}")  # fmt: skip
    known = params.penalized or shapes.ngram is not None  # penalties or n-gram lookup read the tokens
    known_tokens = (tuple(prompt), len(prompt)) if known else (None, 0)
    chunk = PrefillChunk(slot, tuple(prompt), 0, final=True, logprobs=params.logprobs)
    result = runner.execute(StepPlan(
        tables=(TableUpdate(slot, 0, blocks),),
        admitted=(SlotSetup(slot, SlotSampling.of(params, seed), *known_tokens, token_bias(params, set())),),
        prefill=PrefillBatch((chunk,), logits=params.needs_logits),
    ))  # fmt: skip
    token = result.prefill[0].first
    assert token is not None
    return token


def release_slot(runner: ModelRunner, slot: int = 0) -> None:
    runner.execute(StepPlan(released=(slot,)))
