"""The compiled engine: every prefill and step shape compiles at start-up, and none while serving."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from conftest import (
    build_hf_model,
    greedy_divergence_is_a_near_tie,
    llama3_hf_config,
    llama4_hf_config,
    save_hf_model,
)

from redline import LLM, SamplingParams
from redline.engine.request import Request
from redline.runner import compiled_step
from redline.train.random_init import write_random_draft

CONTEXT = 320


@pytest.fixture(scope="module")
def llama3_pair(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("compile")
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=7), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d")


@pytest.fixture(scope="module")
def llama4_pair(tmp_path_factory, tokenizer_dir):
    """Chunked attention (chunk 24, so the context of 320 crosses 13 chunk boundaries) and MoE."""
    root = tmp_path_factory.mktemp("compile4")
    target = save_hf_model(build_hf_model(llama4_hf_config(), seed=7), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d", draft_vocab=200)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("drafting", ["eagle3", "eagle3+ngram", "tree"])
def test_a_run_through_every_bucket_compiles_nothing(request, drafting):
    """K = 3, a context of 320: kv buckets 64 -> 128 -> 256 -> 327 as a request grows to the limit, greedy
    and sampled. Every (rows, kv_len, sampling, k) key is visited after the warm-up, none compiles, and
    greedy tokens equal the eager engine's. EAGLE-3 alone: two slots (rows 1 and 2: slot 1 busy keeps rows
    at 2), every step drafting. Beside it n-gram lookup (its history sliced to the unbacked kv_len; lookup
    alone runs the same code without the draft): one slot, adaptive, steps that verify no drafts forced
    every third step. A draft tree (topk 2, 5 rows) beside n-gram lookup on Llama 4 (its rows within their
    root's chunk, those past it cut): one slot, adaptive, steps that verify no drafts forced every third
    step. With two slots the tree's step graphs doubled (the test took 1,031 s cold on a 2-core CPU) for
    batch indexing that the chain compiles at two rows here and test_tree.py checks for trees eagerly."""
    target, draft = request.getfixturevalue("llama4_pair" if drafting == "tree" else "llama3_pair")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # unique_graphs counts from here
    spec = {
        "eagle3": dict(draft=draft, max_batch=2, adaptive_draft_length=False),
        "eagle3+ngram": dict(draft=draft, prompt_lookup_max=3, max_batch=1),
        "tree": dict(
            draft=draft,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=5,
            prompt_lookup_max=3,
            max_batch=1,
        ),
    }[drafting]
    kw = dict(dtype="float32", max_seq_len=CONTEXT, num_draft_tokens=3, **spec)
    llm = LLM(target, compile=True, progress=False, **kw)
    runner = llm.runner
    graphs_after_warm_up = unique_graphs()
    # (rows, sampling, k) for the step: 2 x 2 x 1 or 1 x 2 x 2; prefill: one row (and several rows)
    assert graphs_after_warm_up == {"eagle3": 4 + 2, "eagle3+ngram": 4 + 1, "tree": 4 + 1}[drafting]
    visited = set()
    step = runner.run_step

    def recording_step(rows: int, kv_len: int, sampling: bool, k: int) -> torch.Tensor:
        visited.add((rows, kv_len, sampling, k))
        return step(rows, kv_len, sampling, k)

    runner.run_step = recording_step
    if runner.shapes.adaptive:
        steps = iter(range(10**6))
        llm.engine.scheduler.draft_length.choose = lambda rows, slots, seeded=False: (
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


def test_compiled_llama4_runs_past_4096_tokens_without_compiling(tmp_path, tokenizer_dir):
    """Llama 4 target (MoE, chunked attention) + draft, K = 3, one slot, a context of 4,200: a 4,080-token
    prompt, then steps whose kv bucket goes from 4,096 to the whole cache, where inductor's CPU code
    would split its reductions if kv_len could be specialized (runner/compiled_step.py). compile_sampling
    off: the warm-up compiles the argmax step alone, and a sampled request with log-probs then runs
    eagerly, compiling nothing, its log-probabilities the eager model's."""
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
    reference = eager.log_probs(short + run.token_ids)  # [T - 1, V]
    want_logprobs = [reference[len(short) + i - 1, t].item() for i, t in enumerate(run.token_ids)]
    assert [e.logprob for e in run.logprobs] == pytest.approx(want_logprobs, abs=1e-4)


def test_a_compiled_step_compiles_each_pair_once_then_runs_its_bytecode_directly():
    """A (rows, sampling, k) key compiles on its first call; later calls, at any kv_len, run the bytecode
    dynamo made for it with no guard lookup (and the same results); a new key raises after freeze()."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    state, weight = torch.randn(4, 8), torch.randn(8, 8)

    def step(rows: int, kv_len: int, sampling: bool, k: int) -> torch.Tensor:  # -> [rows, 8]
        out = state[:rows] @ weight * kv_len - k
        return out + 1 if sampling else out

    compiled = compiled_step.CompiledStep(step, cache_len=64, device=torch.device("cpu"), graphs=3)
    keys = [(1, 10, False, 3), (2, 20, True, 3), (1, 33, False, 3), (2, 64, True, 3), (1, 17, False, 0)]
    for rows, kv_len, sampling, k in keys:
        torch.testing.assert_close(compiled(rows, kv_len, sampling, k), step(rows, kv_len, sampling, k))
    assert unique_graphs() == 3 and set(compiled.direct) == {(1, False, 3), (2, True, 3), (1, False, 0)}
    compiled.freeze()
    with pytest.raises(RuntimeError, match="not compiled at warm-up"):
        compiled(4, 10, False, 3)
    compiled.compiled = None  # dynamo's entry point gone: the keys run without it
    torch.testing.assert_close(compiled(2, 5, True, 3), step(2, 5, True, 3))
    torch.testing.assert_close(compiled(1, 64, False, 0), step(1, 64, False, 0))
