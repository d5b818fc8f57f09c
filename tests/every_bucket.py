"""A compiled engine walked through every decode-step key (tests/test_compile.py, test_compile_llama4.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import greedy_divergence_is_a_near_tie

from redline import LLM, SamplingParams

CONTEXT = 320


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run_through_every_bucket(target: Path, spec: dict, graphs: int) -> None:
    """K = 3, a context of 320: kv buckets 64 -> 128 -> 256 -> 327 as a request grows to the limit, greedy
    and sampled. The warm-up compiles `graphs` graphs; then every (rows, kv_len, sampling, k) key is
    visited, none compiles, and greedy tokens equal the eager engine's. spec: the drafting options (an
    adaptive engine gets steps that verify no drafts forced every third step)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # unique_graphs counts from here
    kw = dict(dtype="float32", max_seq_len=CONTEXT, num_draft_tokens=3, **spec)
    llm = LLM(target, compile=True, progress=False, **kw)
    runner = llm.runner
    graphs_after_warm_up = unique_graphs()
    assert graphs_after_warm_up == graphs
    visited = set()
    step = runner.run_step

    def recording_step(rows: int, kv_len: int, sampling: bool, k: int) -> torch.Tensor:
        visited.add((rows, kv_len, sampling, k))
        return step(rows, kv_len, sampling, k)

    runner.run_step = recording_step
    if runner.shapes.adaptive:
        steps = iter(range(10**6))
        llm.engine.scheduler.draft_length.choose = lambda rows, slots, seeded=False, logits=False: (
            3 * (next(steps) % 3 != 2)
        )
    long, short = torch.randint(5, 384, (20,)).tolist(), torch.randint(5, 384, (9,)).tolist()
    greedy = SamplingParams(max_tokens=CONTEXT - 20, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=CONTEXT - 20,
        ignore_eos=True,
        temperature=0.8,
        seed=5,
        logprobs=2,
        presence_penalty=0.5,
        repetition_penalty=1.2,
    )  # the logits path, all of it
    outputs = []
    for params in (greedy, sampled):
        brief = SamplingParams(max_tokens=4, ignore_eos=True, temperature=params.temperature)
        outputs.append(llm.generate([long], params)[0])  # rows 1
        outputs.append(llm.generate([short, long], [brief, params])[1])  # slot 1 runs alone: rows 2
    assert visited == set(runner.shapes.step_keys())
    assert unique_graphs() == graphs_after_warm_up
    assert all(len(c.token_ids) == CONTEXT - 20 for c in outputs)
    eager = LLM(target, **kw)
    [want] = eager.generate([long], greedy)
    for got in outputs[:2]:
        assert greedy_divergence_is_a_near_tie(eager.model, long, got.token_ids, want.token_ids)
    # the compiled step's packed log-probabilities are the eager model's, for the tokens it sampled
    sampled_run = outputs[2]
    reference = eager.log_probs(long + sampled_run.token_ids)  # [T - 1, V]
    got = [e.logprob for e in sampled_run.logprobs]
    want_logprobs = [reference[len(long) + i - 1, t].item() for i, t in enumerate(sampled_run.token_ids)]
    assert got == pytest.approx(want_logprobs, abs=1e-4)
