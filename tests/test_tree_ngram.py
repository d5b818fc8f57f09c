"""Draft trees beside n-gram lookup (speculative/tree.py chain_into_tree, emit.py): a row whose tokens hold
a match verifies the lookup's chain ahead of the tree's best nodes, losslessly."""

from __future__ import annotations

import torch
from conftest import greedy_divergence_is_a_near_tie
from test_tree import random_parents

from redline import LLM, SamplingParams
from redline.speculative.tree import chain_into_tree, structure


def test_the_chain_goes_in_front_of_the_trees_first_nodes():
    pending, parents = torch.tensor([[9, 1, 2, 3, 4, 5]]), torch.tensor([[0, 0, 0, 1, 1, 2]])
    tokens, moved = chain_into_tree(pending, parents, torch.tensor([[7, 8]]))
    assert tokens.tolist() == [[9, 7, 8, 1, 2, 3]] and moved.tolist() == [[0, 0, 1, 0, 0, 3]]
    # a chain longer than the tree holds: its first N - 1 tokens
    tokens, moved = chain_into_tree(pending[:, :3], parents[:, :3], torch.tensor([[7, 8, 6]]))
    assert tokens.tolist() == [[9, 7, 8]] and moved.tolist() == [[0, 0, 1]]


def test_the_merged_tree_keeps_each_nodes_path():
    """Random trees and chains: every kept node's path of tokens (root excluded) is what it was in the
    tree, the chain's rows form the chain, and parents come before their children."""
    b, n, steps, k = 16, 10, 4, 3
    parents = random_parents(b, n, steps)
    pending = torch.randint(0, 1000, (b, n))
    chain = torch.randint(1000, 2000, (b, k))
    tokens, moved = chain_into_tree(pending, parents, chain)
    assert (moved[:, 1:] < torch.arange(1, n)).all()
    depth, _ = structure(moved, steps)
    assert depth.max() <= steps

    def path(tok, par, row):
        out = []
        while row != 0:
            out.append(int(tok[row]))
            row = int(par[row])
        return out[::-1]

    for i in range(b):
        for row in range(1, k + 1):
            assert path(tokens[i], moved[i], row) == chain[i, :row].tolist()
        for row in range(1, n - k):
            assert path(tokens[i], moved[i], row + k) == path(pending[i], parents[i], row)


def test_greedy_with_a_tree_beside_lookup_equals_plain_decoding(trained):
    """The tiny target and its trained draft, prompts that repeat themselves (matches for the lookup):
    tokens equal plain greedy decoding (up to an fp32 near tie), batch 1 and 3, and the lookup's chains
    change what the steps accept."""
    target, draft = trained / "target", trained / "draft"
    kw = dict(dtype="float32", max_batch=3, max_seq_len=256)
    tree = dict(
        draft=draft,
        num_draft_tokens=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        adaptive_draft_length=False,
    )  # every step drafts: acceptance comparable
    plain, alone, both = LLM(target, **kw), LLM(target, **tree, **kw), LLM(target, **tree, **kw,
                                                                          prompt_lookup_max=3)  # fmt: skip
    vocab = plain.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,)).tolist() * 3 for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want = plain.generate(prompts, params)
    accepted = {}
    for name, llm in (("alone", alone), ("both", both)):
        for batch in ([prompts[0]], prompts):
            got = llm.generate(batch, params)
            for prompt, mine, ref in zip(batch, got, want, strict=False):
                assert greedy_divergence_is_a_near_tie(plain.model, prompt, mine.token_ids, ref.token_ids)
        accepted[name] = [c.acceptance_length for c in got]
    assert accepted["both"] != accepted["alone"]
