"""Tokenizer, chat templates, streaming detokenization and stop strings, checked against transformers."""

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from redline.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, TokenizerError
from redline.train.bpe import LLAMA3_CHAT_TEMPLATE, SPECIAL_TOKENS, train_bpe_tokenizer

transformers = pytest.importorskip("transformers")

MULTIBYTE_TEXTS = [
    "héllo wörld — 日本語 🙂🚀",
    "naïve café, Ελληνικά, русский, 中文字符 👍🏽",
    "emoji: 🙂🚀🎉",
]
UNSEEN_TEXT = "漢字かな交じり文🦀🧪"
SAMPLE_TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "def f(x):\n    return x + 1\n",
    *MULTIBYTE_TEXTS,
    "<|eot_id|> inside text <|begin_of_text|>",
    UNSEEN_TEXT,
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant.  "},
    {"role": "user", "content": "What is 2 + 2? 日本語 🙂"},
    {"role": "assistant", "content": "  It is 4."},
    {"role": "user", "content": "And json.dumps({'a': 1})?"},
]


def training_texts() -> list[str]:
    stdlib_dir = Path(os.path.dirname(json.__file__))
    sources = [path.read_text(encoding="utf-8") for path in sorted(stdlib_dir.glob("*.py"))]
    return sources + MULTIBYTE_TEXTS * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(training_texts(), vocab_size=700, out_dir=out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def copy_model_dir(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def with_template(model_dir: Path, template: str, **special_tokens: str) -> Tokenizer:
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    return Tokenizer(backend, chat_template=template, **special_tokens)


def hf_input_ids(output) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list."""
    return list(output["input_ids"] if isinstance(output, dict | transformers.BatchEncoding) else output)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


# --- training ---------------------------------------------------------------------------------------------


def test_training_is_deterministic_and_special_tokens_come_first(model_dir: Path, tmp_path: Path) -> None:
    train_bpe_tokenizer(training_texts(), vocab_size=700, out_dir=tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert [backend.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert backend.get_vocab_size() == 700


def test_special_tokens_and_vocab(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.vocab_size == len(hf_tokenizer) == 700
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.bos_token_id == 0 == hf_tokenizer.bos_token_id
    assert tokenizer.eos_token_ids == frozenset({4})


def test_extra_eos_ids_from_model_config(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=[1, 4, 9])
    assert tokenizer.eos_token_ids == frozenset({1, 4, 9})


# --- encode / decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_encode_decode_match_transformers(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    bare_ids = tokenizer.encode(text, add_special_tokens=False)
    assert bare_ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == [tokenizer.bos_token_id, *bare_ids]
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert tokenizer.decode(ids) == text.replace("<|eot_id|>", "").replace("<|begin_of_text|>", "")


def test_add_bos_token_config_does_not_double_bos(model_dir: Path, tmp_path: Path) -> None:
    directory = copy_model_dir(model_dir, tmp_path)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "add_bos_token": True}))
    ids = Tokenizer.from_dir(directory).encode("Hello world")
    assert ids[0] == 0 and ids[1] != 0  # the post-processor already added bos

    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").write_text(json.dumps({**tokenizer_json, "post_processor": None}))
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.encode("Hello world") == ids
    assert tokenizer.encode("Hello world", add_special_tokens=False) == ids[1:]


# --- chat templates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(tokenizer: Tokenizer, hf_tokenizer, add_generation_prompt: bool) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    expected_text = hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected_text
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == add_generation_prompt

    ids = tokenizer.encode_chat(CONVERSATION, add_generation_prompt=add_generation_prompt)
    expected_ids = hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    assert ids == hf_input_ids(expected_ids)
    assert ids.count(tokenizer.bos_token_id) == 1


FEATURE_TEMPLATES = [
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }};{% endfor %}",
    "{% if tools is not none %}tools{% else %}none{% endif %} {{ eos_token }} {{ custom | default('-') }}",
    "{{ strftime_now('%Y') }}\n  {% if add_generation_prompt %}\n    gen\n  {% endif %}\n",
    "{% for m in messages %}{{ m.name is defined }}{% endfor %}",
]


@pytest.mark.parametrize("template", FEATURE_TEMPLATES)
def test_template_features_match_transformers(model_dir: Path, hf_tokenizer, template: str) -> None:
    messages = [*CONVERSATION, {"role": "user", "content": "x", "name": None}]
    tokenizer = with_template(model_dir, template, eos_token="<|eot_id|>")
    rendered = tokenizer.apply_chat_template(messages, custom="value")
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, custom="value"
    )
    assert rendered == expected


def test_chat_template_jinja_file_takes_precedence(model_dir: Path, tmp_path: Path) -> None:
    directory = copy_model_dir(model_dir, tmp_path)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    rendered = Tokenizer.from_dir(directory).apply_chat_template(CONVERSATION)
    assert rendered == "[system][user][assistant][user]"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert rendered == hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)


def test_named_chat_templates_use_default(model_dir: Path, tmp_path: Path) -> None:
    directory = copy_model_dir(model_dir, tmp_path)
    config_path = directory / "tokenizer_config.json"
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": LLAMA3_CHAT_TEMPLATE},
    ]
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": templates}))
    rendered = Tokenizer.from_dir(directory).apply_chat_template(CONVERSATION)
    assert rendered == Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)


def test_missing_chat_template_is_a_clear_error(model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(model_dir / "tokenizer.json", directory)
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.bos_token is None and tokenizer.eos_token_ids == frozenset()
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_raise_exception_in_template(model_dir: Path) -> None:
    strict = with_template(model_dir, "{{ raise_exception('only users may speak') }}")
    with pytest.raises(TokenizerError, match="only users may speak"):
        strict.apply_chat_template(CONVERSATION)


# --- loading errors ---------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("filename", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_files(model_dir: Path, tmp_path: Path, filename: str) -> None:
    directory = copy_model_dir(model_dir, tmp_path)
    (directory / filename).write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=filename.replace(".", r"\.")) as error:
        Tokenizer.from_dir(directory)
    assert str(directory) in str(error.value)


# --- streaming detokenization -----------------------------------------------------------------------------


def test_random_ids_stream_to_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            pieces = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ids)
            full_text = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(pieces) == full_text
            if "\ufffd" not in full_text:
                assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", [*MULTIBYTE_TEXTS, UNSEEN_TEXT])
def test_multibyte_characters_are_never_split(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token_id) for token_id in ids]
    assert "".join(pieces) == detokenizer.text == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert detokenizer.flush() == ""


def test_characters_split_over_byte_tokens_are_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(UNSEEN_TEXT, add_special_tokens=False)
    assert len(ids) > len(UNSEEN_TEXT)  # not in the training data, so mostly single-byte tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token_id) for token_id in ids]
    assert "" in pieces
    assert [piece for piece in pieces if piece] == list(UNSEEN_TEXT)


@pytest.mark.parametrize("text", [*MULTIBYTE_TEXTS, UNSEEN_TEXT])
def test_token_bytes_join_to_the_texts_utf8(tokenizer: Tokenizer, text: str) -> None:
    """Byte-level BPE: each token's own bytes (what chat logprobs report), even the bytes of part of a
    character, join to the text's UTF-8."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_prompt_context_gives_right_first_piece(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("The answer is")
    generated_ids = tokenizer.encode(" forty-two 🙂", add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_ids), generated_ids)
    assert "".join(pieces) == " forty-two 🙂"
    assert pieces[0].startswith(" ")


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Metaspace ("▁word") tokenizer, whose decoder drops the sequence's first leading space."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(training_texts(), trainer=trainer)
    directory = tmp_path_factory.mktemp("metaspace")
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_dir(directory)


def test_sentencepiece_style_leading_spaces(sentencepiece_style_tokenizer: Tokenizer) -> None:
    tokenizer = sentencepiece_style_tokenizer
    generated_ids = tokenizer.encode("hello world, the json decoder")
    assert len(generated_ids) > 5
    pieces = stream(IncrementalDetokenizer(tokenizer), generated_ids)
    assert "".join(pieces) == tokenizer.decode(generated_ids) == "hello world, the json decoder"

    prompt_ids = tokenizer.encode("Say")
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_ids), generated_ids)
    assert "".join(pieces) == " hello world, the json decoder"
    # token bytes: "▁" is a space (the decoder drops the sequence's first)
    assert b"".join(tokenizer.token_bytes(i) for i in generated_ids) == b" hello world, the json decoder"


# --- stop strings -----------------------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            return emitted, True
    return [*emitted, matcher.flush()], False


def test_no_stops_pass_through() -> None:
    assert feed_all(StopStringMatcher([]), ["a", "b c", ""]) == (["a", "b c", "", ""], False)


def test_stop_inside_one_piece() -> None:
    assert feed_all(StopStringMatcher(["STOP"]), ["hello ", "wor STOP ld", "never"]) == (
        ["hello ", "wor "],
        True,
    )


def test_stop_spanning_pieces() -> None:
    emitted, stopped = feed_all(StopStringMatcher(["<end>"]), ["abc<", "e", "nd", "> tail"])
    assert stopped and emitted == ["abc", "", "", ""]


def test_prefix_that_is_not_a_stop_is_released() -> None:
    matcher = StopStringMatcher(["<end>"])
    assert matcher.feed("x <en") == ("x ", False)
    assert matcher.feed("try") == ("<entry", False)
    assert matcher.feed("<") == ("", False)
    assert matcher.flush() == "<"
    assert matcher.flush() == ""


def test_earliest_stop_wins() -> None:
    emitted, stopped = feed_all(StopStringMatcher(["world", "lo w", "o"]), ["hel", "lo world"])
    assert stopped and "".join(emitted) == "hel"
    emitted, stopped = feed_all(StopStringMatcher(["\n\n", "User:"]), ["Sure. User: hi\n\nbye"])
    assert stopped and emitted == ["Sure. "]
