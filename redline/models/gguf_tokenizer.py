"""tokenizer.json and tokenizer_config.json rebuilt from a GGUF's vocabulary (llama.cpp's `tokenizer.ggml.*`).

A GGUF stores a byte-level BPE as its token strings (ids in order), its merges ("Ġ t"), a type per token
and the name of the pre-tokenizer (`tokenizer.ggml.pre`) whose regexes llama.cpp applies before BPE. We
write the Hugging Face `tokenizers` form of the same tokenizer: the BPE model, the split of the
pre-tokenizer the original tokenizer.json used, control tokens as special added tokens, bos added when
the file says llama.cpp adds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import tokenizers

from redline.models.gguf_reader import GGUFFile

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` family splits text, as llama.cpp's llama-vocab.cpp runs it."""

    steps: tuple[dict[str, Any], ...]  # tokenizers pre-tokenizers, applied in order
    ignore_merges: bool  # a word that is itself a token is taken whole (llama.cpp: Llama 3 family)
    add_bos: bool  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    clean_spaces: bool  # clean_up_tokenization_spaces in decode (llama.cpp's clean_spaces)


_LLAMA3 = PreTokenizer((_split(_LLAMA3_SPLIT), _byte_level(use_regex=False)), True, True, True)
# StarCoder / SmolLM: every digit alone (llama.cpp's first regex, \p{N}), then GPT-2's split.
_DIGITS_GPT2 = PreTokenizer(
    ({"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)), False, False, False
)
_GPT2 = PreTokenizer((_byte_level(use_regex=True),), False, False, True)

PRE_TOKENIZERS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), _LLAMA3),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), _DIGITS_GPT2),
    **dict.fromkeys(("gpt-2", "mpt", "olmo"), _GPT2),
}


def _pre_tokenizer(gguf_file: GGUFFile) -> PreTokenizer:
    name = gguf_file.value("tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise gguf_file.error(
            f"tokenizer.ggml.pre {name!r} is not supported; redline rebuilds "
            + ", ".join(sorted(PRE_TOKENIZERS))
        )
    return PRE_TOKENIZERS[name]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (tokenizers' ByteLevel alphabet): b" " -> "Ġ"."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}  # "!".."~", "¡".."¬", "®".."ÿ"
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _vocab_spelling(tokens: list[str]) -> list[str]:
    """Token strings as the BPE vocabulary spells them. Normal tokens are stored byte-level spelled
    ("Ġthe"); llama.cpp's converter stores user-defined ones decoded ("  " for "ĠĠ"): spell those again."""
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    return [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]


def _vocab(gguf_file: GGUFFile, spelled: list[str], types: list[int]) -> dict[str, int]:
    """The BPE vocabulary, spelling -> id. A user-defined token spelled like a normal one ("  " and "ĠĠ")
    keeps its id as an added token only; any other repeated spelling is an error."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(spelled):
        if token not in vocab:
            vocab[token] = i
        elif types[i] not in (_CONTROL, _USER_DEFINED):
            raise gguf_file.error(f"tokenizer.ggml.tokens holds {token!r} twice (ids {vocab[token]} and {i})")
    return vocab


def _merges(gguf_file: GGUFFile) -> list[list[str]]:
    merges = []
    for merge in gguf_file.value("tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise gguf_file.error(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        merges.append(pair)
    return merges


def _special(gguf_file: GGUFFile, tokens: list[str], name: str) -> str | None:
    token_id = gguf_file.token_id(name)
    return None if token_id is None else tokens[token_id]


def add_bos_eos(gguf_file: GGUFFile) -> tuple[bool, bool]:
    """Whether llama.cpp adds bos / eos around an encoded text for this file."""
    add_bos = gguf_file.value("tokenizer.ggml.add_bos_token", _pre_tokenizer(gguf_file).add_bos)
    return bool(add_bos), bool(gguf_file.value("tokenizer.ggml.add_eos_token", False))


def _post_processor(
    gguf_file: GGUFFile, tokens: list[str]
) -> tokenizers.processors.TemplateProcessing | None:
    """Adds bos (and eos) as Llama 3's tokenizer.json does: single "<bos> $A", pair "<bos> $A <bos> $B"."""
    wanted = [name for name, add in zip(("bos", "eos"), add_bos_eos(gguf_file), strict=True) if add]
    ids = {name: i for name in wanted if (i := gguf_file.token_id(name)) is not None}
    if not ids:
        return None
    bos, eos = ([tokens[ids[name]]] if name in ids else [] for name in ("bos", "eos"))
    single = [*bos, "$A:0", *eos]
    pair = [*single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)]
    special = [(tokens[i], i) for i in ids.values()]
    return tokenizers.processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=special
    )


def tokenizer_json(gguf_file: GGUFFile) -> tokenizers.Tokenizer:
    """The GGUF's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2") as a `tokenizers.Tokenizer`."""
    kind = gguf_file.value("tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise gguf_file.error(
            f"tokenizer.ggml.model {kind!r} is not supported; redline rebuilds byte-level BPE ('gpt2')"
        )
    pre = _pre_tokenizer(gguf_file)
    tokens = gguf_file.value("tokenizer.ggml.tokens")
    types = gguf_file.value("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise gguf_file.error(f"{len(tokens)} tokens but {len(types)} token types")
    vocab = _vocab(gguf_file, _vocab_spelling(tokens), types)
    added = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": token_type == _CONTROL}
        for i, (token, token_type) in enumerate(zip(tokens, types, strict=True))
        if token_type in (_CONTROL, _USER_DEFINED)
    ]  # fmt: skip
    bpe = {"type": "BPE", "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": _merges(gguf_file)}
    spec = {  # the fields left out take tokenizers' defaults: no normalizer, truncation, unk token, dropout
        "version": "1.0",
        "added_tokens": added,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": list(pre.steps)},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": bpe,
    }
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    tokenizer.post_processor = _post_processor(gguf_file, tokens)
    return tokenizer


def tokenizer_config(gguf_file: GGUFFile, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name, whether bos / eos are added, the chat template."""
    tokens = gguf_file.value("tokenizer.ggml.tokens")
    add_bos, add_eos = add_bos_eos(gguf_file)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _special(gguf_file, tokens, "bos"),
        "eos_token": _special(gguf_file, tokens, "eos"),
        "unk_token": _special(gguf_file, tokens, "unknown"),
        "pad_token": _special(gguf_file, tokens, "padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": _pre_tokenizer(gguf_file).clean_spaces,
    }
    template = gguf_file.value("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config
