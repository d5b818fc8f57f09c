"""The decode step compiles with fullgraph=True and is not recompiled from step to step."""

from __future__ import annotations

import torch
import torch._dynamo
from conftest import (
    build_hf_model,
    greedy_divergence_is_a_near_tie,
    llama4_hf_config,
    save_hf_model,
)

from redline import LLM, SamplingParams
from redline.engine.request import Request
from redline.models.random_init import write_random_draft


def test_compiled_speculative_step_never_recompiles(tmp_path, tokenizer_dir):
    """Llama 4 target (MoE, chunked attention) + draft, K = 3, two slots, 20 steps inside one kv bucket."""
    target_dir = save_hf_model(build_hf_model(llama4_hf_config()), tmp_path / "t", tokenizer_dir)
    draft_dir = write_random_draft(target_dir, tmp_path / "d", draft_vocab=200)
    torch._dynamo.reset()
    llm = LLM(
        target_dir,
        dtype="float32",
        max_batch=2,
        max_seq_len=512,
        draft=draft_dir,
        num_draft_tokens=3,
        compile=True,
    )
    prompts = [torch.randint(5, 384, (140,)).tolist(), torch.randint(5, 384, (150,)).tolist()]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    requests = [Request(p, params, llm.tokenizer, frozenset(), num_draft_tokens=3) for p in prompts]
    for r in requests:
        llm.scheduler.add(r)
    llm.scheduler.step()  # prefill both, first (compiling) step
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(20):
            llm.scheduler.step()
    eager = LLM(target_dir, dtype="float32", max_batch=2, draft=draft_dir, num_draft_tokens=3)
    for prompt, r in zip(prompts, requests, strict=True):
        n = len(r.output_ids)
        assert n >= 21
        [want] = eager.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
        assert greedy_divergence_is_a_near_tie(eager.model, prompt, r.output_ids, want.token_ids)


def test_compiled_step_across_buckets_equals_eager(tmp_path, tokenizer_dir):
    """Three requests of different lengths: the kv bucket grows 64 -> 128 and the batch bucket shrinks
    4 -> 1 as they finish; a second round revisits those graphs after others ran. With guard evaluation
    skipped for seen shapes (engine/guard_skipping.py), each call must still get its own graph."""
    from conftest import llama3_hf_config

    target_dir = save_hf_model(build_hf_model(llama3_hf_config(), seed=7), tmp_path / "t", tokenizer_dir)
    draft_dir = write_random_draft(target_dir, tmp_path / "d")
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (50, 20, 5)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 12, 24)]
    torch._dynamo.reset()
    kw = dict(dtype="float32", max_batch=4, max_seq_len=128, draft=draft_dir, num_draft_tokens=3)
    compiled = LLM(target_dir, compile=True, **kw)
    eager = LLM(target_dir, **kw)
    rounds = [compiled.generate(prompts, params) for _ in range(2)]
    assert len(compiled.runner._run_step.seen) >= 3  # (rows, kv_len, sampling) keys
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        [want] = eager.generate([prompt], p)
        for got in rounds:
            assert greedy_divergence_is_a_near_tie(eager.model, prompt, got[i].token_ids, want.token_ids)
