"""Prefix caching: a request whose prompt starts like an earlier one reuses that prompt's KV blocks and
computes only the rest, with exactly what a cold run computes, EAGLE-3's draft included; the skipped
work and the hits are counted."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    build_hf_model,
    greedy_divergence_is_a_near_tie,
    llama3_hf_config,
    llama4_hf_config,
    save_hf_model,
)

from redline import LLM, SamplingParams
from redline.kernels.paged_kv import gather_blocks
from redline.train.random_init import write_random_draft

KW = dict(dtype="float32", max_batch=2, max_seq_len=256, compile=False, progress=False)


def _prefilled(llm: LLM, prompt: list[int]) -> tuple[list[int], list[torch.Tensor], int]:
    """Runs `prompt` for one token; returns the blocks its plan gave it, the keys and values of its
    positions [0, len(prompt)) there (every target layer, then the draft's), and its cached tokens."""
    tables, execute = [], llm.executor.execute

    def recording(plan):
        tables.extend(u for u in plan.tables if u.start == 0)
        return execute(plan)

    llm.executor.execute = recording
    [done] = llm.generate([prompt], SamplingParams(max_tokens=1))
    llm.executor.execute = execute
    blocks = list(tables[0].blocks)
    runner = llm.runner
    layers = runner.cache.layers + (runner.slots.draft_cache.layers if runner.draft is not None else [])
    rows = [gather_blocks(store, torch.tensor([blocks]), len(prompt)) for layer in layers for store in layer]
    return blocks, rows, done.cached_tokens


@pytest.mark.parametrize(
    ("config", "draft"),
    [(llama3_hf_config, False), (llama3_hf_config, True), (llama4_hf_config, True)],
    ids=["llama3", "llama3-eagle3", "llama4-eagle3"],
)
def test_a_prefix_hit_writes_what_a_cold_prefill_writes(tmp_path, tokenizer_dir, config, draft):
    """Prompts A and B share their first 64 tokens (4 blocks) and differ from token 64 on. Without a
    draft B reuses all 4 blocks. With one it reuses 3: the draft's row at 63 read token 64, which is A's,
    not B's (the blocks are keyed with the token after them). Either way B's keys and values, target and
    draft, equal a cold prefill's."""
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    kw = dict(KW, draft=write_random_draft(target, tmp_path / "d")) if draft else KW
    shared = torch.randint(5, 384, (64,)).tolist()
    a, b = shared + [7] * 30, shared + [9] * 25
    hot, cold = LLM(target, **kw), LLM(target, prefix_caching=False, **kw)
    hot.generate([a], SamplingParams(max_tokens=4))
    blocks, got, reused = _prefilled(hot, b)
    assert reused == (48 if draft else 64)
    pool = hot.engine.scheduler.pool
    assert blocks[: reused // 16] == [pool.block_of[k] for k in pool.keys(a, 4)][: reused // 16]  # A's
    _, want, cold_reused = _prefilled(cold, b)
    assert cold_reused == 0
    for got_rows, want_rows in zip(got, want, strict=True):
        torch.testing.assert_close(got_rows, want_rows, atol=1e-5, rtol=1e-5)  # fp32, other GEMM shapes
    assert hot.stats().prefilled_tokens - len(a) == len(b) - reused


@pytest.mark.parametrize("config", [llama3_hf_config, llama4_hf_config], ids=["llama3", "llama4"])
def test_requests_sharing_a_system_prompt_get_the_tokens_of_cold_runs(tmp_path, tokenizer_dir, config):
    """EAGLE-3 at K = 3. A 100-token system prompt, then three requests with their own 10 to 30 tokens
    after it, two at once: seeded sampled tokens and acceptance equal a run without the cache (the draft
    proposes from the same KV, so rejection sampling draws the same), greedy up to an fp32 near tie. The
    first request computes everything; each later one finds 96 of the system prompt's tokens (6 blocks),
    and prefill computes only the rest."""
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    kw = dict(KW, draft=write_random_draft(target, tmp_path / "d"), num_draft_tokens=3)
    system = torch.randint(5, 384, (100,)).tolist()
    prompts = [system + torch.randint(5, 384, (n,)).tolist() for n in (20, 10, 30)]
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=11),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=12),
        SamplingParams(max_tokens=24, ignore_eos=True),
    ]
    hot, cold = LLM(target, **kw), LLM(target, prefix_caching=False, **kw)
    got = hot.generate(prompts[:1], params[:1]) + hot.generate(prompts[1:], params[1:])
    want = cold.generate(prompts[:1], params[:1]) + cold.generate(prompts[1:], params[1:])
    for prompt, q, g, w in zip(prompts, params, got, want, strict=True):
        if q.greedy:
            assert greedy_divergence_is_a_near_tie(hot.model, prompt, g.token_ids, w.token_ids)
        else:
            assert g.token_ids == w.token_ids and g.acceptance_rates == w.acceptance_rates
    assert [c.cached_tokens for c in got] == [0, 96, 96] and [c.cached_tokens for c in want] == [0, 0, 0]
    stats = hot.stats().prefix_cache
    assert (stats.queries, stats.hits) == (112 + 96 + 128, 2 * 96)  # full blocks before each last token
    prompt_tokens = sum(len(p) for p in prompts)
    assert hot.stats().prefilled_tokens == prompt_tokens - 2 * 96
    assert cold.stats().prefilled_tokens == prompt_tokens and cold.stats().prefix_cache.queries == 0
