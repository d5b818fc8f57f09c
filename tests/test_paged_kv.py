"""The engine over a pool of KV blocks smaller than its slots' contexts: requests share it, the newest is
preempted and recomputed when it runs dry, every request still gets the tokens it gets alone, and every
block comes back."""

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
from redline.cli import main
from redline.config import ModelConfig
from redline.engine.request import GenerationError
from redline.engine_config import parse_bytes
from redline.kernels.paged_kv import BLOCK
from redline.models.kv_cache import KVCache
from redline.models.llama import LlamaForCausalLM
from redline.train.random_init import normal_init, write_random_draft


@pytest.mark.parametrize(
    ("config", "draft"),
    [(llama3_hf_config, False), (llama3_hf_config, True), (llama4_hf_config, True)],
    ids=["llama3", "llama3-eagle3", "llama4-eagle3"],
)
def test_a_small_pool_preempts_and_every_request_gets_its_own_tokens(tmp_path, tokenizer_dir, config, draft):
    """4 slots, prompts of 21 to 45 tokens (crossing block boundaries) and 30 new tokens each, over a pool
    of 9 blocks of 16 positions: one request needs up to 5 (75 positions + the step's lookahead), so four
    at once do not fit. Greedy tokens (and a seeded sampled request's, without a draft) equal each
    request's alone in a full-size cache (greedy: up to an fp32 near tie, as a recomputed prefix rounds
    differently); requests were preempted; the pool is whole afterwards."""
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    kw = dict(dtype="float32", max_batch=4, max_seq_len=128, compile=False, progress=False)
    if draft:
        kw.update(draft=write_random_draft(target, tmp_path / "d"), num_draft_tokens=3)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (45, 21, 33, 40)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in prompts]
    if not draft:
        params[2] = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=3)
    alone = LLM(target, **kw)
    want = [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    small = LLM(target, kv_cache_memory=9 * alone.runner.block_bytes, **kw)
    assert small.stats().kv_blocks == 9 and small.runner.cache.layers[0][0].shape[0] == 10  # + scratch
    got = small.generate(prompts, params)
    for prompt, q, c, alone_tokens in zip(prompts, params, got, want, strict=True):
        if q.greedy:  # a recomputed prefix's logits differ from the incremental ones by fp32 rounding
            assert greedy_divergence_is_a_near_tie(small.model, prompt, c.token_ids, alone_tokens)
        else:
            assert c.token_ids == alone_tokens
    assert sum(c.preemptions for c in got) > 0
    pool = small.engine.scheduler.pool
    assert pool.available == pool.num_blocks and not any(pool.refs)


def test_a_request_larger_than_the_pool_fails_and_names_the_sizes(tmp_path, tokenizer_dir):
    """A pool of 3 blocks (48 positions) and a 60-token prompt: that request fails with an error naming
    the pool; a short request beside it completes."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=2), tmp_path / "t", tokenizer_dir)
    kw = dict(dtype="float32", max_batch=2, max_seq_len=128, compile=False, progress=False)
    block_bytes = LLM(target, **kw).runner.block_bytes
    llm = LLM(target, kv_cache_memory=3 * block_bytes, **kw)
    prompts = [torch.randint(5, 384, (60,)).tolist(), [5, 6, 7]]
    with pytest.raises(GenerationError) as failed:
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    long, short = failed.value.completions
    assert long.finish_reason == "error"
    assert "needs more KV blocks than the pool has (3 blocks of 16 positions)" in long.error
    assert short.finish_reason == "length" and len(short.token_ids) == 8
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(target, kv_cache_memory=block_bytes - 1, **kw)


def test_blocks_are_taken_as_a_request_grows(tmp_path, tokenizer_dir):
    """A 20-token prompt with K = 0 takes blocks for 20 + 2 lookahead positions (2 blocks); 40 new tokens
    later the request has reached position 59 and holds ceil((59 + 2) / 16) = 4; all return at the end."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=3), tmp_path / "t", tokenizer_dir)
    llm = LLM(target, dtype="float32", max_batch=1, max_seq_len=128, compile=False, progress=False)
    scheduler, held, execute = llm.engine.scheduler, [], llm.executor.execute

    def recording(plan):
        if plan.decode is not None:
            held.append(len(scheduler.tables[0].blocks))
        return execute(plan)

    llm.executor.execute = recording
    llm.generate([torch.randint(5, 384, (20,)).tolist()], SamplingParams(max_tokens=41, ignore_eos=True))
    assert held[0] == -(-(20 + scheduler.shapes.lookahead) // BLOCK) == 2 and held[-1] == 4
    assert scheduler.pool.available == scheduler.pool.num_blocks


def test_every_tensor_parallel_rank_executes_rank_0s_plan_once_per_step(tmp_path, tokenizer_dir):
    """Over 2 ranks with the memory of 5.5 one-process blocks (11 per rank: a rank holds 1 of the 2 KV
    heads), rank 0's scheduler plans and every rank executes each plan, one message per step: the
    preempting run gives every request its tokens alone, with EAGLE-3 at K = 3, prompts sharing their
    first 33 tokens (prefix hits) and prefill in chunks of 32 tokens."""
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=5), tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d")
    kw = dict(dtype="float32", max_batch=4, max_seq_len=128, compile=False, progress=False, draft=draft)
    shared = torch.randint(5, 384, (33,)).tolist()
    prompts = [shared + torch.randint(5, 384, (n,)).tolist() for n in (12, 1, 7, 20)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = LLM(target, prefix_caching=False, **kw)
    want = [alone.generate([p], params)[0].token_ids for p in prompts]
    memory = 11 * alone.runner.block_bytes // 2  # 11 blocks per rank: the three at once grow to 12
    small = LLM(target, tensor_parallel_size=2, kv_cache_memory=memory, max_prefill_tokens=32, **kw)
    sent, send, step, steps = [], small.executor._send, small.engine.step, [0]
    small.executor._send = lambda message: sent.append(message) or send(message)

    def counted():
        steps[0] += 1
        return step()

    small.engine.step = counted
    try:
        got = small.generate(prompts[:1], params) + small.generate(prompts[1:], params)
    finally:
        small.close()
    assert [c.cached_tokens > 0 for c in got] == [False, True, True, True]
    assert [kind for kind, _ in sent] == ["execute"] * steps[0] + ["stop"]
    first, second = (plan for _, (plan,) in sent[:2])  # 45 tokens: chunks 32, then 13 and the first step
    assert [len(c.tokens) for c in first.prefill.chunks] == [32] and first.decode is None
    assert [len(c.tokens) for c in second.prefill.chunks] == [13] and second.decode is not None
    for prompt, c, alone_tokens in zip(prompts, got, want, strict=True):
        assert greedy_divergence_is_a_near_tie(alone.model, prompt, c.token_ids, alone_tokens)
    assert sum(c.preemptions for c in got) > 0


def test_kv_cache_memory_flag_takes_sizes_and_names_a_pool_too_small(tmp_path, tokenizer_dir, capsys):
    sizes = [parse_bytes(t) for t in ("4096", "512MB", "2GiB", "1.5 gb")]
    assert sizes == [4096, 512 * 10**6, 2**31, 15 * 10**8]
    with pytest.raises(ValueError, match="not a size in bytes: '2XB'"):
        parse_bytes("2XB")
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=6), tmp_path / "t", tokenizer_dir)
    argv = ["generate", "--model", str(target), "--prompt", "x", "--dtype", "float32", "--no-compile"]
    assert main([*argv, "--kv-cache-memory", "1KB"]) != 0
    assert "kv_cache_memory 1,000 bytes holds no KV block" in capsys.readouterr().err
    assert main([*argv, "--kv-cache-memory", "1MiB", "--max-tokens", "5"]) == 0


def test_a_context_filled_to_the_limit_survives_preemption(tmp_path, tokenizer_dir):
    """A 2,048-token context: a 1,500-token prompt generates up to the limit (548 tokens) beside a
    1,200-token one (300 tokens), over 180 blocks. Both are admitted (94 + 76 blocks), but grown to 128 +
    94 they do not fit: the newer is preempted and recomputed over ~1,300 tokens. Both end with their
    tokens alone (greedy, up to an fp32 near tie) and every block comes back."""
    hf = build_hf_model(llama3_hf_config(max_position_embeddings=2048), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    kw = dict(dtype="float32", max_batch=2, max_seq_len=2048, compile=False, progress=False)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (1500, 1200)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (548, 300)]
    alone = LLM(target, **kw)
    want = [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    small = LLM(target, kv_cache_memory=180 * alone.runner.block_bytes, **kw)
    got = small.generate(prompts, params)
    assert [len(c.token_ids) for c in got] == [548, 300] and got[1].preemptions > 0
    for prompt, c, alone_tokens in zip(prompts, got, want, strict=True):
        assert greedy_divergence_is_a_near_tie(small.model, prompt, c.token_ids, alone_tokens)
    stats = small.stats()
    assert stats.kv_blocks_free == stats.kv_blocks


def _contiguous_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from whole forwards over the sequence, no KV cache at all: the contiguous reference."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            hidden, _ = model(torch.tensor([seq]), torch.arange(len(seq))[None])
            seq.append(int(model.greedy_tokens(hidden[:, -1:])[0, 0]))
    return seq[len(prompt) :]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize(
    ("config", "draft"),
    [
        (llama3_hf_config, False),
        (llama3_hf_config, True),
        (llama4_hf_config, False),
        (llama4_hf_config, True),
    ],
    ids=["llama3", "llama3-eagle3", "llama4", "llama4-eagle3"],
)
def test_paged_greedy_equals_a_contiguous_forward(tmp_path, tokenizer_dir, config, draft, batch):
    """Prompts of 15, 16, 17, 31, 32, 33, 47 and 50 tokens (on both sides of block boundaries), 24 new
    tokens each, one at a time or 8 at once: the engine's greedy tokens (blocks, block tables, chunked
    prefill of 32 tokens, speculation at K = 3) equal whole forwards without a cache, up to an fp32 near
    tie."""
    hf = build_hf_model(config(), seed=int(torch.randint(0, 2**31, ())))
    target = save_hf_model(hf, tmp_path / "t", tokenizer_dir)
    kw = dict(dtype="float32", max_batch=batch, max_seq_len=128, compile=False, progress=False)
    if draft:
        kw.update(draft=write_random_draft(target, tmp_path / "d"), num_draft_tokens=3)
    llm = LLM(target, max_prefill_tokens=32, **kw)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (15, 16, 17, 31, 32, 33, 47, 50)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = llm.generate(prompts, params) if batch > 1 else [llm.generate([p], params)[0] for p in prompts]
    for prompt, c in zip(prompts, got, strict=True):
        want = _contiguous_greedy(llm.model, prompt, 24)
        assert greedy_divergence_is_a_near_tie(llm.model, prompt, c.token_ids, want)


@torch.inference_mode()
def test_rows_grouped_by_the_keys_they_need_attend_as_each_row_alone():
    """The eager CPU path groups a batch's rows by their kv bucket (64, 512 and 128 here): two tokens in
    each of three slots holding 20, 300 and 70 positions give what each row gives alone (one gather)."""
    config = ModelConfig.from_dict({**llama3_hf_config().to_dict(), "architectures": ["LlamaForCausalLM"]})
    model = LlamaForCausalLM(config).eval()
    normal_init(model, std=0.1)
    cache = KVCache(config, 3, 512, torch.float32, torch.device("cpu"))
    lengths = (20, 300, 70)
    for slot, n in enumerate(lengths):
        model(torch.randint(5, 384, (1, n)), torch.arange(n)[None], cache.layers, cache.tables(slot, 1), 512)
    tokens = torch.randint(5, 384, (3, 2))
    positions = torch.tensor([[n, n + 1] for n in lengths])
    alone = [
        model(tokens[s : s + 1], positions[s : s + 1], cache.layers, cache.tables(s, 1), 512)[0]
        for s in range(3)
    ]
    together, _ = model(tokens, positions, cache.layers, cache.tables(0, 3), 512)
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)
