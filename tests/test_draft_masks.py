"""Row rules on the draft's proposals (structured/draft_masks.py): the mask on the draft's vocabulary, the
host callback's masks after a step's emitted tokens, and the engine's proposals obeying a grammar, chain
and tree, greedy and sampled, eager and compiled, with the output unchanged."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model
from test_structured import PHONE, SPECS, allowed_ids, masked_near_tie, phone_rows

from redline import LLM, SamplingParams
from redline.structured.draft_masks import DraftVocabulary, draft_allowed, install, rule_bits, rule_masked
from redline.structured.grammar import GrammarCompiler
from redline.structured.matcher import RequestGrammar, chain_parents, path_to, words
from redline.structured.rules import TokenRules
from redline.structured.token_controls import BadWords
from redline.structured_spec import StructuredOutputs
from redline.tokenizer import Tokenizer
from redline.train.random_init import write_random_draft

pytest.importorskip("xgrammar")


def test_the_draft_mask_reads_each_draft_tokens_bit_of_its_target_id():
    """Fresh random masks and vocabulary maps against a per-token loop; a row that allows no draft token
    stays unmasked."""
    vocab, draft_vocab = 300, 90
    to_target = torch.randperm(vocab)[:draft_vocab].sort().values
    v = DraftVocabulary.of(to_target, vocab)
    bits = torch.randint(-(2**31), 2**31, (2, 3, v.words), dtype=torch.int32)
    bits[1, 2] = 0  # allows nothing
    logits = torch.randn(2, 3, draft_vocab)
    got = draft_allowed(logits, bits, v.word, v.bit)
    for b in range(2):
        for f in range(3):
            for d, t in enumerate(to_target.tolist()):
                allowed = (int(bits[b, f, t // 32]) >> (t % 32)) & 1 or (b, f) == (1, 2)
                assert got[b, f, d] == (logits[b, f, d] if allowed else float("-inf"))


@pytest.fixture
def phone(tokenizer_dir):
    """PHONE's rules after "12" over a 400-token vocabulary, and a token-ids helper."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    tok = lambda text: tokenizer.encode(text, add_special_tokens=False)
    compiler = GrammarCompiler(tokenizer, 400, tokenizer.eos_token_ids)
    grammar = RequestGrammar(compiler.compile(StructuredOutputs(regex=PHONE)), 400)
    grammar.commit(tok("12"))
    return tokenizer, tok, TokenRules(400, grammar, None)


def test_the_callback_masks_what_follows_the_emitted_tokens_and_the_proposals(phone):
    """Slot 1 under PHONE has committed "12"; its step emitted ["1", "-"] (one draft accepted, then the
    bonus); proposal paths ["1"], ["a"] and ["1", "2", "3", "4"]: masks after "121-1", all-allowed after
    the refused "a" and after the grammar ended inside the path ("121-1234", then the stop token). Slot 0
    has no rules, a row of slot 1 that emits nothing (slot -1) neither. The matcher is where it was
    afterwards."""
    tokenizer, tok, rules = phone
    [one], [dash], [a] = tok("1"), tok("-"), tok("a")
    digits = [tok(d)[0] for d in "234"]
    eos = min(tokenizer.eos_token_ids)
    tokens = torch.tensor([[7, 7], [one, dash]])
    paths = [[[5], [6], [6]], [[one], [a], [one, *digits, eos][:4]]]
    everything = set(range(400))
    for _ in range(2):  # the second time from the same committed state
        out = rule_bits([0, 1], tokens.tolist(), [0, 1], paths, {1: rules}, words(400))
        assert [allowed_ids(out[0, f], 400) for f in range(3)] == [everything] * 3
        assert [allowed_ids(out[1, f], 400) for f in range(2)] == phone_rows(tokenizer, ["121-1", None], 400)
        assert allowed_ids(out[1, 2], 400) == phone_rows(tokenizer, ["121-1234"], 400)[0]
    ended = rule_bits([1], [[one, dash]], [1], [[[one, *digits, eos]]], {1: rules}, words(400))
    assert allowed_ids(ended[0, 0], 400) == everything
    idle = rule_bits([-1], [[one, dash]], [1], [[[one]]], {1: rules}, words(400))
    assert allowed_ids(idle[0, 0], 400) == everything


def test_bad_words_alone_mask_the_proposals_after_their_prefix(phone):
    """Rules of bad words only (no grammar): "ab" bans b after a, also where the a was emitted this step
    and b is the next proposal."""
    _, tok, _ = phone
    [a], [b] = tok("a"), tok("b")
    rules = TokenRules(400, None, BadWords([(a, b)]))
    out = rule_bits(
        [0],
        [[a]],
        [0],
        [
            [
                [],
            ]
        ],
        {0: rules},
        words(400),
    )
    assert b not in allowed_ids(out[0, 0], 400) and a in allowed_ids(out[0, 0], 400)
    out = rule_bits([0], [[b]], [0], [[[a], [b]]], {0: rules}, words(400))
    assert b not in allowed_ids(out[0, 0], 400) and b in allowed_ids(out[0, 1], 400)


def test_the_op_masks_by_the_rules_installed_on_its_own_thread(phone):
    """Installed on this thread: the op masks slot 1's row; on another thread (a compile thread's warm-up)
    it sees no rules and copies the logits."""
    tokenizer, tok, rules = phone
    [one], [dash] = tok("1"), tok("-")
    v = DraftVocabulary.of(torch.arange(400), 400)
    logits = torch.randn(1, 1, 400)
    emitted, path = torch.tensor([[one, dash]]), torch.tensor([[[one]]])
    args = (logits, torch.tensor([1]), emitted, torch.tensor([1]), path, v.word, v.bit, v.words)
    install({1: rules})
    try:
        masked = rule_masked(*args)
        elsewhere: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: elsewhere.append(rule_masked(*args)))
        thread.start()
        thread.join()
    finally:
        install({})
    allowed = phone_rows(tokenizer, ["121-1"], 400)[0]
    assert set(masked[0, 0].isfinite().nonzero()[:, 0].tolist()) == allowed
    assert torch.equal(elsewhere[0], logits) and torch.equal(rule_masked(*args), logits)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("draft_masks")
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=5), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d", draft_vocab=200)


def proposals_checked(monkeypatch, draft_ids: set[int], topk: int) -> list[int]:
    """Before each step's masks, checks the step's proposals (pending's rows 1..) against the request's
    grammar: every proposal whose parent's mask allows at least `topk` draft tokens (a tree keeps a node's
    top `topk` children, masked ones among them when fewer are allowed) is one the grammar takes. Returns
    [proposals checked], filled as the engine runs."""
    checked = [0]
    masks = TokenRules.masks

    def checking(self, pending, tree, out):
        matcher = self.grammar.matcher
        parents = tree if tree is not None else chain_parents(len(pending))
        bits = torch.zeros(1, words(self.vocab_size), dtype=torch.int32)
        for row in range(1, len(pending)):
            *before, last = [pending[r] for r in path_to(row, parents)]
            taken = 0
            for token in before:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                taken += 1
            if taken == len(before) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bits, 0)
                if len(allowed_ids(bits[0], self.vocab_size) & draft_ids) >= topk:
                    assert matcher.accept_token(last), f"proposal {last} at row {row} breaks the grammar"
                    checked[0] += 1
                    taken += 1
            if taken:
                matcher.rollback(taken)
        return masks(self, pending, tree, out)

    monkeypatch.setattr(TokenRules, "masks", checking)
    return checked


@pytest.mark.parametrize("drafting", ["chain", "tree", "compiled chain"])
def test_the_drafts_proposals_obey_the_grammar_and_the_output_is_unchanged(models, monkeypatch, drafting):
    """A random EAGLE-3 draft proposes K = 3 (or a tree, topk 2, 6 rows) under a regex, a choice and a
    JSON schema, greedy and sampled, batched, the proposals after each first token too (made in the
    prefill, one prompt a forward): each proposal the rules allow a choice for obeys them, and greedy
    output is plain decoding's. Compiled: two slots (rows 4 would add two graphs to the four, the costliest,
    for the same code; the third prompt waits for a slot)."""
    target, draft = models
    slots = 2 if drafting == "compiled chain" else 4
    kw = dict(dtype="float32", max_batch=slots, max_seq_len=256, max_num_batched_tokens=16)  # a prompt a
    # plan: later prompts' prefill rows are not their slots
    spec_kw = dict(draft=draft, num_draft_tokens=3, adaptive_draft_length=False,
                   compile=drafting == "compiled chain")  # fmt: skip
    if drafting == "tree":
        spec_kw.update(speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    plain, fast = LLM(target, **kw), LLM(target, **kw, **spec_kw)
    assert fast.runner.masks_drafts
    draft_ids = set(fast.draft.to_target(torch.arange(200)).tolist())
    checked = proposals_checked(monkeypatch, draft_ids, 2 if drafting == "tree" else 1)
    prompts = [torch.randint(5, 384, (n,)).tolist() for n in (6, 9, 4)]
    greedy = [SamplingParams(max_tokens=100, structured=s) for s in SPECS]
    want, got = plain.generate(prompts, greedy), fast.generate(prompts, greedy)
    for spec, prompt, mine, ref in zip(SPECS, prompts, got, want, strict=True):
        assert masked_near_tie(plain, spec, prompt, mine.token_ids, ref.token_ids)
        assert mine.finish_reason == "stop"
    sampled = [SamplingParams(max_tokens=100, temperature=1.0, seed=i, structured=s)
               for i, s in enumerate(SPECS)]  # fmt: skip
    assert all(c.finish_reason == "stop" for c in fast.generate(prompts, sampled))
    assert checked[0] > 30


def test_a_bias_that_leaves_the_grammar_nothing_keeps_the_grammar_on_the_draft_too(models, monkeypatch):
    """allowed_token_ids none of which the grammar allows: every row keeps its mask alone (the grammar
    wins), in the draft's proposals as in verification (masked before the bias: no row of -inf only),
    greedy and sampled: the proposals still obey the grammar."""
    target, draft = models
    fast = LLM(target, dtype="float32", max_batch=2, max_seq_len=256, draft=draft, num_draft_tokens=3,
               adaptive_draft_length=False)  # fmt: skip
    checked = proposals_checked(monkeypatch, set(fast.draft.to_target(torch.arange(200)).tolist()), 1)
    letters = fast.tokenizer.encode(" maybe so", add_special_tokens=False)
    prompt = torch.randint(5, 384, (8,)).tolist()
    for temperature in (0.0, 1.0):
        phone = StructuredOutputs(regex=PHONE)
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=3, structured=phone,
                                allowed_token_ids=letters)  # fmt: skip
        [out] = fast.generate([prompt], params)
        assert out.finish_reason == "stop" and re.fullmatch(PHONE, out.text), out.text
    assert checked[0] > 5
