"""Draft trees on a model with chunked attention (Llama 4): every row of a tree attends within its root's
chunk (attention_core.tree_visible), and the rows past that chunk's end are cut from verification
(speculative/tree.truncate_at_chunk)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama4_hf_config, save_hf_model

from redline import LLM, SamplingParams
from redline.kernels import cpu_ops
from redline.kernels.attention_core import tree_visible
from redline.speculative.tree import truncate_at_chunk
from redline.train.random_init import write_random_draft

NEEDS_CPU_OPS = pytest.mark.skipif(not cpu_ops.load(), reason="needs the AVX-512 BF16 CPU kernels")


def test_a_trees_rows_see_their_roots_chunk():
    """Base 40, bits 0b101 (the root and itself): keys 0..39, 40 and 42; chunk 32: keys 32..39, 40, 42."""
    keys = torch.arange(48)[None, None, None]
    base, bits = torch.tensor([40]), torch.tensor([[0b101]])
    seen = lambda chunk: tree_visible(keys, base, bits, chunk)[0, 0, 0].nonzero()[:, 0].tolist()
    assert seen(0) == [*range(40), 40, 42]
    assert seen(32) == [*range(32, 40), 40, 42]


def test_rows_past_the_roots_chunk_are_cut_from_verification():
    """Chunk 32, root at 30, depths [0, 1, 1, 2, 3]: positions 30, 31, 31, 32, 33; rows 3 and 4 cut. A root
    at 64 (the first position of its chunk) keeps every row."""
    parents = torch.tensor([[0, 0, 0, 1, 3], [0, 0, 0, 1, 3]])
    pos = torch.tensor([30, 64])
    positions = pos[:, None] + torch.tensor([0, 1, 1, 2, 3])
    cut = truncate_at_chunk(parents, positions, pos, 32)
    assert cut.tolist() == [[0, 0, 0, -1, -1], [0, 0, 0, 1, 3]]


@pytest.mark.parametrize(
    "dtype, topk, nodes",
    [("float32", 2, 6), ("float32", 4, 16), pytest.param("bfloat16", 4, 16, marks=NEEDS_CPU_OPS)],
)
def test_greedy_llama4_trees_across_chunk_boundaries_equal_plain_decoding(
    tmp_path, tokenizer_dir, dtype, topk, nodes
):
    """Llama 4 (chunk 24, three chunked RoPE layers and a NoPE one, top-1 MoE) with a draft tree beside
    n-gram lookup on prompts that repeat themselves, so that lookup's chains are accepted, across the chunk
    boundaries at 24, 48, 72, ...: greedy tokens equal plain decoding's, batch 1 and 4, up to a near tie
    (fp32 rounding; in bf16 the tree's rows take the AVX-512 decode attention with the root's chunk, and
    the MoE's few-token path computes 16 rows in another order than one)."""
    target = save_hf_model(build_hf_model(llama4_hf_config(), seed=5), tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d", draft_vocab=200)
    kw = dict(dtype=dtype, max_batch=4, max_seq_len=160)
    plain = LLM(target, **kw)
    tree = LLM(target, draft=draft, num_draft_tokens=3, speculative_eagle_topk=topk, prompt_lookup_max=3,
               speculative_num_draft_tokens=nodes, adaptive_draft_length=False, **kw)  # fmt: skip
    prompts = [torch.randint(5, 384, (n,)).tolist() * 3 for n in (7, 13, 5, 11)]
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    atol = 1e-4 if dtype == "float32" else 5e-2  # bf16: logits of unit scale, 2^-8 relative, summed
    for batch in (prompts[:1], prompts):
        got = tree.generate(batch, params)
        for prompt, mine, ref in zip(batch, got, want, strict=False):
            assert greedy_divergence_is_a_near_tie(plain.model, prompt, mine.token_ids, ref, atol)
        assert sum(c.acceptance_rates[1] for c in got) > 0, "no path accepted past the first level"


def test_a_llama4_tree_after_a_2000_token_prompt_fills_the_context_across_a_chunk_boundary(
    tmp_path, tokenizer_dir
):
    """Real sizes: chunk 40, two prompts of 2,000 tokens (a 50-token passage repeated, so that lookup's
    chains are accepted), decoded by a tree beside n-gram lookup until the context (2,200) is full, across
    the chunk boundaries at 2,040 .. 2,160: greedy tokens equal plain decoding's, up to an fp32 near tie
    (without tree.truncate_at_chunk they differ)."""
    config = llama4_hf_config(attention_chunk_size=40, max_position_embeddings=4096)
    target = save_hf_model(build_hf_model(config, seed=6), tmp_path / "t", tokenizer_dir)
    draft = write_random_draft(target, tmp_path / "d", draft_vocab=200)
    kw = dict(dtype="float32", max_batch=2, max_seq_len=2200)
    plain = LLM(target, **kw)
    tree = LLM(target, draft=draft, num_draft_tokens=3, speculative_eagle_topk=4, prompt_lookup_max=3,
               speculative_num_draft_tokens=16, adaptive_draft_length=False, **kw)  # fmt: skip
    prompts = [(torch.randint(5, 384, (50,)).tolist() * 40)[:2000] for _ in range(2)]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    got = tree.generate(prompts, params)
    for prompt, mine, ref in zip(prompts, got, want, strict=True):
        assert len(mine.token_ids) == 200 and mine.finish_reason == "length"
        assert greedy_divergence_is_a_near_tie(plain.model, prompt, mine.token_ids, ref)
    assert sum(c.acceptance_rates[1] for c in got) > 0, "no path accepted past the first level"
