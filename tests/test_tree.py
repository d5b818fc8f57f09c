"""EAGLE-2-style draft trees (speculative/tree.py, tree_verify.py, tree_step.py): the tree's structure, its
attention mask against plain forwards of each row's path, the accepted path's keys moved into place, both
verifications against plain references, and greedy decoding with a tree equal to plain decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import build_hf_model, greedy_divergence_is_a_near_tie, llama3_hf_config, save_hf_model
from test_spec_sampling import chi2, chi2_critical

from redline import LLM, SamplingParams
from redline.draft_tree import TreeShape
from redline.models.build import load_target
from redline.models.eagle3 import aux_layers_of, load_draft
from redline.models.kv_cache import KVCache
from redline.speculative.tree import expand, keep_path, structure, tree_mask
from redline.speculative.tree_step import counts_along_tree
from redline.speculative.tree_verify import greedy_tree_verify, sampled_tree_verify
from redline.train.random_init import write_random_draft


def random_parents(b: int, n: int, steps: int) -> torch.Tensor:
    """[B, N] parents, each row's parent an earlier row at depth < steps (row 0 the root, its own)."""
    parents = torch.zeros(b, n, dtype=torch.int64)
    depth = torch.zeros(b, n, dtype=torch.int64)
    for i in range(b):
        for r in range(1, n):
            choices = [j for j in range(r) if depth[i, j] < steps]
            parents[i, r] = choices[torch.randint(len(choices), ()).item()]
            depth[i, r] = depth[i, parents[i, r]] + 1
    return parents


def path_of(parents: list[int], row: int) -> list[int]:
    """Rows from the root to `row`."""
    path = [row]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_shape_checks_its_sizes():
    assert TreeShape(4, 3, 8).pool == 4 + 2 * 16 and TreeShape(4, 3, 8).reach == 3 + 8
    for bad in ((1, 3, 4), (2, 0, 2), (2, 2, 8), (2, 2, 1)):  # topk 1, no steps, nodes past the pool, too few
        with pytest.raises(ValueError):
            TreeShape(*bad)


def test_structure_gives_depths_and_ancestors():
    depth, bits = structure(torch.tensor([[0, 0, 1, 1, 0]]), steps=2)
    assert depth.tolist() == [[0, 1, 2, 2, 1]]
    assert bits.tolist() == [[0b1, 0b11, 0b111, 0b1011, 0b10001]]
    parents = random_parents(6, 12, 4)
    depth, bits = structure(parents, 4)
    for b in range(6):
        for r in range(12):
            path = path_of(parents[b].tolist(), r)
            assert depth[b, r] == len(path) - 1
            assert bits[b, r] == sum(1 << j for j in set(path) | {0})


def test_counts_along_tree_add_each_rows_branch():
    tokens = torch.tensor([[9, 3, 5, 3]])  # parents [0, 0, 1, 1]: rows 2 and 3 sit under row 1
    _, bits = structure(torch.tensor([[0, 0, 1, 1]]), 2)
    counts = counts_along_tree(torch.zeros(1, 10, dtype=torch.int32), tokens, bits)
    assert counts[0, :, [3, 5, 9]].tolist() == [[0, 0, 0], [1, 0, 0], [1, 1, 0], [2, 0, 0]]


def test_greedy_tree_verify_walks_the_matching_children():
    b, n, steps, vocab = 64, 10, 4, 5
    parents = random_parents(b, n, steps)
    tokens = torch.randint(0, vocab, (b, n))
    choice = torch.randint(0, vocab, (b, n))
    path, n_acc, emitted = greedy_tree_verify(choice, tokens, parents, steps)
    for i in range(b):
        node, want = 0, [0]
        while True:
            kids = [r for r in range(1, n) if parents[i, r] == node and tokens[i, r] == choice[i, node]]
            if not kids:
                break
            node = kids[0]
            want.append(node)
        assert n_acc[i] == len(want) - 1
        assert path[i, : len(want)].tolist() == want and (path[i, len(want) :] == node).all()
        assert emitted[i, : len(want)].tolist() == [choice[i, r].item() for r in want]


def test_sampled_tree_verify_draws_from_the_target():
    """A Markov target (the next token's distribution depends on the last token only) over a fixed tree:
    the first two emitted tokens follow it exactly, whichever rows were accepted, and both the accept and
    the reject paths run."""
    vocab, n, steps, topk = 6, 7, 2, 3
    markov = torch.softmax(torch.randn(vocab, vocab) * 1.5, dim=-1)
    while not 0.2 < markov[4, :3].sum() < 0.8:  # the root's children (0, 1, 2) that likely: both paths run
        markov = torch.softmax(torch.randn(vocab, vocab) * 1.5, dim=-1)
    parents = torch.tensor([[0, 0, 0, 0, 1, 1, 2]])
    tokens = torch.tensor([[4, 0, 1, 2, 3, 5, 0]])  # siblings distinct
    trials = 20000
    p = markov[tokens].expand(trials, n, vocab)  # each row's next-token distribution
    seed = torch.randint(0, 2**31, (trials,))
    positions = (torch.tensor([0, 1, 1, 1, 2, 2, 2]) + 10).expand(trials, n)
    _, n_acc, emitted = sampled_tree_verify(p, tokens.expand(trials, n), parents.expand(trials, n), steps,
                                            topk, seed, positions)  # fmt: skip
    assert 0.1 < (n_acc > 0).float().mean() < 0.9
    stat, df = chi2(torch.bincount(emitted[:, 0], minlength=vocab), markov[4])
    assert stat < chi2_critical(df), f"first token: chi2 {stat:.1f} (df {df})"
    pairs = emitted[n_acc > 0, :2]  # a first token accepted: the second follows it
    for first in range(vocab):
        seconds = pairs[pairs[:, 0] == first, 1]
        if len(seconds) > 200:
            stat, df = chi2(torch.bincount(seconds, minlength=vocab), markov[first])
            assert stat < chi2_critical(df), f"after {first}: chi2 {stat:.1f} (df {df})"


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_verification_equals_eager_on_trees_with_missing_children(rows):
    """Both verifications compiled (inductor, CPU) give the eager paths on 4-row trees of topk 4, where a
    node has fewer children than topk (the masks of absent children are empty): inductor's vectorized
    argmax over such [B, 4] masks returned a row past the last and aborted the process."""
    vocab, n, steps, topk = 7, 4, 3, 4
    greedy, sampled = (torch.compile(f, fullgraph=True) for f in (greedy_tree_verify, sampled_tree_verify))
    for _ in range(4):
        parents = random_parents(rows, n, steps)
        tokens = torch.randint(0, vocab, (rows, n))
        choice = torch.randint(0, vocab, (rows, n))
        want = greedy_tree_verify(choice, tokens, parents, steps)
        for got, expected in zip(greedy(choice, tokens, parents, steps), want, strict=True):
            assert torch.equal(got, expected)
        p = torch.softmax(torch.randn(rows, n, vocab) * 3, dim=-1)
        seed, positions = torch.randint(0, 2**31, (rows,)), torch.arange(n).expand(rows, n) + 5
        args = (p, tokens, parents, steps, topk, seed, positions)
        for got, expected in zip(sampled(*args), sampled_tree_verify(*args), strict=True):
            assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, tokenizer_dir):
    hf = build_hf_model(llama3_hf_config())
    return save_hf_model(hf, tmp_path_factory.mktemp("tree") / "target", tokenizer_dir)


def test_tree_rows_see_their_ancestors_only_and_the_accepted_keys_move_into_place(tiny_target):
    """A 20-token prefix in the cache, then a random tree over it: each row's hidden state equals a plain
    forward of the prefix and the row's path. After keep_path for one of the deepest paths, decoding on
    from the cache equals a plain forward of the prefix, that path and the next token."""
    model = load_target(tiny_target, torch.float32)
    vocab, n, steps, start = model.config.vocab_size, 9, 4, 20
    cache = KVCache(model.config, 1, 128, torch.float32, torch.device("cpu"))
    layers, tables = cache.layers, cache.tables(0, 1)
    prefix = torch.randint(0, vocab, (1, start))
    parents = random_parents(1, n, steps)
    tokens = torch.randint(0, vocab, (1, n))
    with torch.no_grad():
        model(prefix, torch.arange(start)[None], layers, tables, kv_len=64)
        positions, mask = tree_mask(parents, torch.tensor([start]), steps)
        hidden, _ = model(tokens, positions, layers, tables, 64, mask)
        for r in range(n):
            path = path_of(parents[0].tolist(), r)
            seq = torch.cat((prefix, tokens[:, path]), dim=1)
            want, _ = model(seq, torch.arange(seq.shape[1])[None])
            torch.testing.assert_close(hidden[0, r], want[0, -1], atol=1e-5, rtol=0)
        depth, _ = structure(parents, steps)
        deepest = depth[0].argmax().item()
        path = path_of(parents[0].tolist(), deepest)
        padded = torch.tensor([path + [path[-1]] * (steps + 1 - len(path))])
        keep_path(layers, tables, torch.tensor([start]), padded)
        after = start + len(path)
        nxt = torch.randint(0, vocab, (1, 1))
        got, _ = model(nxt, torch.tensor([[after]]), layers, tables, kv_len=64)
        seq = torch.cat((prefix, tokens[:, path], nxt), dim=1)
        want, _ = model(seq, torch.arange(seq.shape[1])[None])
        torch.testing.assert_close(got[0, -1], want[0, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("k", "topk", "nodes", "batch"), [(1, 2, 3, 1), (3, 4, 8, 4), (5, 2, 10, 2), (3, 4, 4, 1)]
)
def test_greedy_with_a_tree_equals_plain_decoding(trained, k, topk, nodes, batch):
    """The tiny target and its trained draft: tokens equal plain greedy decoding (up to an fp32 near tie),
    prompts of several lengths over `batch` slots, with drafts accepted past the first level. Then the
    logits path (penalties and log-probabilities): the tokens of penalized greedy decoding, and the same
    log-probabilities, the path's rows gathered from the tree's. Every step drafts (adaptive draft length
    off: tests/test_draft_length.py mixes in steps without drafts)."""
    target, draft = trained / "target", trained / "draft"
    kw = dict(dtype="float32", max_batch=batch, max_seq_len=256)
    plain = LLM(target, **kw)
    tree = LLM(target, draft=draft, num_draft_tokens=k, speculative_eagle_topk=topk,
               speculative_num_draft_tokens=nodes, adaptive_draft_length=False, **kw)  # fmt: skip
    vocab = plain.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,)).tolist() for n in (5, 17, 40, 9, 23)]
    greedy = SamplingParams(max_tokens=60, ignore_eos=True)
    penalized = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2, presence_penalty=0.4,
                               frequency_penalty=0.2)  # fmt: skip
    for params in (greedy, penalized):
        want = plain.generate(prompts, params)
        got = tree.generate(prompts, params)
        for prompt, mine, ref in zip(prompts, got, want, strict=True):
            penalties = dict(presence=params.presence_penalty, frequency=params.frequency_penalty)
            mine_ids, ref_ids = mine.token_ids, ref.token_ids
            assert greedy_divergence_is_a_near_tie(plain.model, prompt, mine_ids, ref_ids, **penalties)
            if params.logprobs and mine.token_ids == ref.token_ids:
                for a, b in zip(mine.logprobs, ref.logprobs, strict=True):
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
        if k > 1 and nodes - 1 > topk and params is greedy:  # some node lies past the first level
            assert max(c.acceptance_rates[1] for c in got) > 0, "no path accepted past the first level"


def test_the_drafts_tree_expands_each_node_from_its_own_branch(tiny_target, tmp_path):
    """Every node the draft's tree keeps is among the top-k of the draft run as a chain down its branch
    (fresh cache, causal by position), with the score of that chain: the frontier rows' hidden states,
    positions, slots and mask are each node's own (a node that saw a sibling's key, or a cousin's hidden
    state, would score otherwise)."""
    draft_dir = write_random_draft(tiny_target, tmp_path / "draft", std=1.0)
    target = load_target(
        tiny_target, torch.float32, aux_layers=aux_layers_of(draft_dir, 3)
    )  # llama3_hf_config: 3 layers
    draft = load_draft(draft_dir, target, torch.float32)
    shape, length = TreeShape(topk=3, steps=4, nodes=24), 2
    layer = draft.config.layer
    tokens = torch.randint(0, layer.vocab_size, (1, length))
    fused = torch.randn(1, length, layer.hidden_size)
    positions = torch.arange(length)[None]

    def root(cache: KVCache) -> torch.Tensor:  # the draft's pass over a prefix: its last row's hidden state
        return draft(tokens, fused, positions, cache.layers[0], cache.tables(0, 1), 64)[:, -1:]

    with torch.no_grad():
        cache = KVCache(layer, 1, 64, torch.float32, torch.device("cpu"))
        h = root(cache)
        at = positions[:, -1:]
        drafted, parents, scores = expand(draft, h, at, cache.layers[0], cache.tables(0, 1), 64, shape,
                                          lambda x, _paths: draft.logits(x))  # fmt: skip
        rows = torch.cat((tokens[:, -1:], drafted), dim=1)[0].tolist()  # row 0 stands for the root
        for r in range(1, shape.nodes):
            branch = path_of(parents[0].tolist(), r)[1:]  # rows below the root, down to r
            chain = KVCache(layer, 1, 64, torch.float32, torch.device("cpu"))
            hidden, score = root(chain), 0.0
            for depth, row in enumerate(branch):
                logp = draft.logits(hidden)[0, 0].log_softmax(-1)
                top = draft.to_target(logp.topk(shape.topk).indices).tolist()
                assert rows[row] in top, f"row {r}: node {row} at depth {depth + 1} is not its parent's top-k"
                score += logp[logp.topk(shape.topk).indices[top.index(rows[row])]].item()
                hidden = draft(torch.tensor([[rows[row]]]), hidden, at + depth + 1, chain.layers[0],
                               chain.tables(0, 1), 64)  # fmt: skip
            assert scores[0, r - 1].item() == pytest.approx(score, abs=1e-4), f"row {r}'s score"


def test_the_config_spells_trees_as_sglang_and_vllm_do():
    import argparse

    from redline.engine_config import EngineConfig, SpeculativeConfig
    from redline.engine_flags import add_engine_args, config_from_args

    text = '{"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "topk": 4, "num_draft_tokens": 8}'
    c = SpeculativeConfig.from_json(text)
    assert c.tree == TreeShape(topk=4, steps=3, nodes=8)
    assert SpeculativeConfig(model="d", topk=2).tree == TreeShape(2, 3, 6)  # num_draft_tokens: 2K
    assert SpeculativeConfig(model="d").tree is None  # topk 1: the chain
    assert SpeculativeConfig(model="d", topk=1, num_draft_tokens=4).tree is None  # SGLang's chain at K = 3
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = "--model m --draft d --speculative-eagle-topk 4 --speculative-num-steps 5"
    config = config_from_args(parser.parse_args([*flags.split(), "--speculative-num-draft-tokens", "12"]))
    assert config.speculative.tree == TreeShape(4, 5, 12) and config.num_draft_tokens == 5
    assert EngineConfig.create("m", draft="d", speculative_eagle_topk=3).speculative.tree == TreeShape(
        3, 3, 6
    )
    assert SpeculativeConfig(model="d", topk=2, prompt_lookup_max=3).tree == TreeShape(2, 3, 6)  # n-gram too
    for given, message in [
        (dict(model="d", topk=2, num_draft_tokens=40), r"num_draft_tokens 40 must lie in \[2, 11\]"),
        (dict(model="d", num_draft_tokens=8), "give topk > 1"),
        (dict(method="ngram", topk=2), r'need an EAGLE-3 draft \(method "eagle3"\)'),
        (dict(model="d", topk=0), "topk must be at least 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**given)
