"""Log-probabilities computed inside the step (redline/logprobs.py): the target's own, with and without
speculation, for generated tokens and for prompt tokens (echo), through chunked prefill and the cache.

The reference is a whole forward of the sequence without any cache (ModelRunner.log_probs). All runs
are fp32, so 1e-4 absolute covers the difference between attending over a cache and over the sequence.
"""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_divergence_is_a_near_tie

from redline import LLM, SamplingParams
from redline.data import sharegpt
from redline.logprobs import TokenLogprob, pack, unpack
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.train.random_init import write_random_draft

ATOL = 1e-4
PROMPTS = ["import os\nimport sys\n\n\ndef main():\n", "class Reader:\n    def __init__(self, path", "x = ["]


@pytest.fixture(scope="module")
def engines(trained) -> dict[str, LLM]:
    kw = dict(dtype="float32", max_batch=4, max_seq_len=256, progress=False)
    return {
        "plain": LLM(trained / "target", **kw),
        "eagle3": LLM(trained / "target", draft=trained / "draft", **kw),
    }


def check_against_reference(llm: LLM, prompt: list[int], tokens: list[int], entries: list[TokenLogprob],
                            top: int) -> None:  # fmt: skip
    """Each entry is the log-probability of its token after prompt + the tokens before it, and its top
    alternatives are the model's most likely tokens, most likely first."""
    reference = llm.runner.log_probs(prompt + tokens)  # [T - 1, V]
    assert [e.token for e in entries] == tokens
    for i, entry in enumerate(entries):
        row = reference[len(prompt) + i - 1]
        assert entry.logprob == pytest.approx(row[entry.token].item(), abs=ATOL)
        values, ids = row.topk(top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=ATOL)


def test_pack_and_unpack_round_trip_fp32_bits():
    logits = torch.randn(2, 3, 50)
    tokens = torch.randint(0, 50, (2, 3))
    packed = pack(logits, tokens).view(2, 3, -1)
    logp = logits.log_softmax(-1)
    entries = unpack(packed[1], tokens[1, :2].tolist(), 4)
    assert len(entries) == 2
    for j, entry in enumerate(entries):
        assert entry.logprob == logp[1, j, tokens[1, j]].item()  # bit for bit
        values, ids = logp[1, j].topk(4)
        assert entry.top == list(zip(ids.tolist(), values.tolist(), strict=True))


def test_greedy_logprobs_are_the_targets_own_with_and_without_speculation(engines):
    params = SamplingParams(max_tokens=40, logprobs=5, ignore_eos=True)
    runs = {name: llm.generate(PROMPTS, params) for name, llm in engines.items()}
    without_logprobs = engines["eagle3"].generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    llm = engines["plain"]
    assert any(c.acceptance_length > 1.5 for c in runs["eagle3"]), "the draft must be accepted"
    for i, text in enumerate(PROMPTS):
        plain, spec = runs["plain"][i], runs["eagle3"][i]
        assert spec.token_ids == plain.token_ids == without_logprobs[i].token_ids  # the logits path is exact
        assert [e.logprob for e in spec.logprobs] == pytest.approx(
            [e.logprob for e in plain.logprobs], abs=ATOL
        )
        prompt = llm.tokenizer.encode(text)
        check_against_reference(llm, prompt, plain.token_ids, spec.logprobs, 5)
        assert all(e.top[0][0] == e.token for e in spec.logprobs)  # greedy: the chosen token is the top one


def test_sampled_tokens_report_the_raw_target_logprob(engines):
    """Temperature scales the sampling distribution, never the reported log-probabilities."""
    llm = engines["eagle3"]
    params = SamplingParams(max_tokens=30, temperature=1.3, seed=int(torch.randint(0, 2**31, ())), logprobs=2)
    for text, completion in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        prompt = llm.tokenizer.encode(text)
        check_against_reference(llm, prompt, completion.token_ids, completion.logprobs, 2)


def test_prompt_logprobs_through_chunks_and_a_warm_prefix_cache(trained):
    """A 150-token prompt prefilled in chunks of 48, twice: the second time its blocks are cached, yet a
    request asking for prompt logprobs computes them all. max_tokens 0 generates nothing."""
    llm = LLM(trained / "target", draft=trained / "draft", dtype="float32", max_seq_len=256,
              max_prefill_tokens=48, progress=False)  # fmt: skip
    prompt = torch.randint(5, llm.model_config.vocab_size, (150,)).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=4))  # caches the prompt's blocks
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    [only] = llm.generate([prompt], params)
    assert only.token_ids == [] and only.finish_reason == "length"
    assert only.prompt_logprobs[0] is None and len(only.prompt_logprobs) == len(prompt)
    check_against_reference(llm, prompt[:1], prompt[1:], only.prompt_logprobs[1:], 3)
    [both] = llm.generate([prompt], SamplingParams(max_tokens=5, prompt_logprobs=1, logprobs=1))
    assert [e.logprob for e in both.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in only.prompt_logprobs[1:]], abs=ATOL
    )
    check_against_reference(llm, prompt, both.token_ids, both.logprobs, 1)


def test_prompt_logprobs_start_over_when_a_chunked_prefill_is_preempted(trained):
    """A pool of 11 blocks, chunks of 32: the 120-token prompt asking for prompt logprobs is preempted
    part-way through its prefill by the decoding request before it, and prefilled again from its first
    token; its prompt logprobs are each prompt token's once."""
    probe = LLM(trained / "target", dtype="float32", max_seq_len=256, progress=False)
    llm = LLM(trained / "target", dtype="float32", max_seq_len=256, max_batch=4, progress=False,
              kv_cache_memory=11 * probe.runner.block_bytes, max_prefill_tokens=32)  # fmt: skip
    running, scored = (torch.randint(5, llm.model_config.vocab_size, (n,)).tolist() for n in (45, 120))
    _, out = llm.generate([running, scored], [SamplingParams(max_tokens=100, ignore_eos=True),
                                              SamplingParams(max_tokens=2, prompt_logprobs=1)])  # fmt: skip
    assert out.preemptions > 0
    assert len(out.prompt_logprobs) == len(scored)
    check_against_reference(llm, scored[:1], scored[1:], out.prompt_logprobs[1:], 1)


def test_smollm2_logprobs_of_a_long_prompt_and_its_completion_with_and_without_a_draft(tmp_path):
    """The real SmolLM2-135M-Instruct (fp32), a 2,000-token prompt of real ShareGPT text prefilled in chunks
    of 1,024 (each chunk's prompt logprobs computed 512 rows at a time), then 12 greedy tokens: every
    prompt and generated token's logprob, and its top 2, equal one whole forward of the sequence, with an
    EAGLE-3 draft (K = 2 on every step) and without (up to the first token where an fp32 near tie may split
    them)."""
    model_dir = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    draft = write_random_draft(model_dir, tmp_path / "draft")
    text = " ".join(m["content"] for c in sharegpt.conversations("train")[:40] for m in c.messages)
    kw = dict(dtype="float32", max_batch=1, max_seq_len=2100, max_prefill_tokens=1024, progress=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    runs = []
    for d in (None, draft):
        llm = LLM(model_dir, draft=d, num_draft_tokens=2, adaptive_draft_length=False, compile=False, **kw)
        prompt = llm.tokenizer.encode(text)[:2000]
        [out] = llm.generate([prompt], params)
        runs.append(out)
    # fp32 products of 1 row (plain) and K + 1 rows (verify) round differently: equal, or a near tie
    plain_ids, spec_ids = runs[0].token_ids, runs[1].token_ids
    assert greedy_divergence_is_a_near_tie(llm.model, prompt, spec_ids, plain_ids)
    pairs = enumerate(zip(plain_ids, spec_ids, strict=True))
    agreed = next((i for i, (a, b) in pairs if a != b), len(plain_ids))  # tokens equal before this
    assert len(runs[1].prompt_logprobs) == len(prompt)
    sequence = prompt + spec_ids
    entries = runs[1].prompt_logprobs[1:] + runs[1].logprobs
    check_against_reference(llm, prompt[:1], sequence[1:], entries, 2)
    plain = [e.logprob for e in runs[0].prompt_logprobs[1:] + runs[0].logprobs[:agreed]]
    assert plain == pytest.approx([e.logprob for e in entries[: len(plain)]], abs=ATOL)
