"""The compiled engine on Llama 4 (MoE, chunked attention): a draft tree through every bucket, and a context
past 4,096 tokens, without compiling while serving."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama4_hf_config, save_hf_model
from every_bucket import run_through_every_bucket, unique_graphs

from redline import LLM, SamplingParams
from redline.engine.request import Request
from redline.train.random_init import write_random_draft


def test_a_draft_tree_runs_through_every_bucket_compiling_nothing(tmp_path, tokenizer_dir):
    """A draft tree (topk 2, 5 rows) beside n-gram lookup (its rows within their root's chunk, those past
    it cut): one slot, adaptive, 1 x 2 x 2 step graphs (rows, sampling, k) and 1 of prefill. Chunked
    attention of 24, so the context of 320 crosses 13 chunk boundaries. With two slots the tree's step
    graphs doubled (the test took 1,031 s cold on a 2-core CPU) for batch indexing that test_compile.py
    compiles for the chain at two rows and test_tree.py checks for trees eagerly."""
    target = save_hf_model(build_hf_model(llama4_hf_config(), seed=7), tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d", draft_vocab=200)
    tree = dict(draft=draft, speculative_eagle_topk=2, speculative_num_draft_tokens=5, prompt_lookup_max=3,
                max_batch=1)  # fmt: skip
    run_through_every_bucket(target, tree, 4 + 1)


def test_compiled_llama4_runs_past_4096_tokens_without_compiling(tmp_path, tokenizer_dir):
    """Llama 4 target (MoE, chunked attention) + draft, K = 3, one slot, a context of 4,200: a 4,080-token
    prompt, then steps whose kv bucket goes from 4,096 to the whole cache, where inductor's CPU code
    would split its reductions if kv_len could be specialized (runner/compiled_step.py). compile_sampling
    off: the warm-up compiles the argmax step alone, and a sampled request with log-probs then runs
    eagerly, compiling nothing, its log-probabilities the eager model's, its steps timed apart."""
    config = llama4_hf_config(max_position_embeddings=4200)
    target_dir = save_hf_model(build_hf_model(config), tmp_path / "t", tokenizer_dir)
    draft_dir = write_random_draft(target_dir, tmp_path / "d", draft_vocab=200)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # unique_graphs counts from here
    kw = dict(
        dtype="float32",
        max_batch=1,
        max_seq_len=4200,
        draft=draft_dir,
        num_draft_tokens=3,
        adaptive_draft_length=False,
    )  # every step drafting: the graphs this test counts
    llm = LLM(target_dir, compile=True, progress=False, compile_sampling=False, **kw)
    graphs_after_warm_up = unique_graphs()
    assert llm.runner.compiled_step.seen == {(1, False, 3)}
    prompt = torch.randint(5, 384, (4080,)).tolist()
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    request = Request(prompt, params, llm.tokenizer, frozenset(), num_draft_tokens=3)
    kv_lens, execute = set(), llm.executor.execute

    def recording(plan):
        if plan.decode is not None:
            kv_lens.add(plan.decode.kv_len)
        return execute(plan)

    llm.executor.execute = recording
    llm.engine.add(request)
    while not request.finished:
        llm.engine.step()
    assert kv_lens == {4096, llm.runner.shapes.cache_len}
    assert unique_graphs() == graphs_after_warm_up
    eager = LLM(target_dir, **kw)
    [want] = eager.generate([prompt], params)
    assert greedy_divergence_is_a_near_tie(llm.model, prompt, request.output_ids, want.token_ids)
    short = prompt[:100]
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3, logprobs=1)
    [run] = llm.generate([short], sampled)
    assert unique_graphs() == graphs_after_warm_up and len(run.token_ids) == 12
    # its eager steps timed for the draft length on their own path (engine/draft_length.py)
    assert any(path for _, _, path in llm.engine.scheduler.draft_length.seconds)
    reference = eager.log_probs(short + run.token_ids)  # [T - 1, V]
    want_logprobs = [reference[len(short) + i - 1, t].item() for i, t in enumerate(run.token_ids)]
    assert [e.logprob for e in run.logprobs] == pytest.approx(want_logprobs, abs=1e-4)
