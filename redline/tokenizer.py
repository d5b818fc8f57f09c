"""Tokenizer (HF tokenizer.json via `tokenizers`), chat templates, streaming detokenization, stop strings."""

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

# Prompt tokens that seed the detokenizer's context, so the first generated token's leading space is right.
PROMPT_CONTEXT_TOKENS = 5


class TokenizerError(ValueError):
    """A tokenizer file is missing or invalid, or a chat template cannot be rendered."""


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config.json stores special tokens either as strings or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def _select_chat_template(template: str | list | None) -> str | None:
    """A template is a string, or a list of named templates of which we use "default"."""
    if isinstance(template, list):
        return {entry.get("name"): entry.get("template") for entry in template}.get("default")
    return template


def _raise_template_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Like transformers' tojson filter: no HTML escaping, with json.dumps' formatting options."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class Tokenizer:
    """A Hugging Face tokenizer: tokenizer.json plus special tokens and chat template from its config."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self._backend, self.chat_template, self.add_bos_token = backend, chat_template, add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.eos_token_ids: frozenset[int] = frozenset(extra_eos_ids) | ({eos_id} - {None})

    @classmethod
    def from_dir(cls, model_dir: str | Path, extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from a model directory."""
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise TokenizerError(f"missing tokenizer file {tokenizer_path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as error:
            raise TokenizerError(f"cannot parse tokenizer file {tokenizer_path}: {error}") from error
        config_path = model_dir / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        except (OSError, ValueError) as error:
            raise TokenizerError(f"cannot read {config_path}: {error}") from error
        jinja = model_dir / "chat_template.jinja"  # wins over the config's template
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=_select_chat_template(template),
            add_bos_token=bool(config.get("add_bos_token", False)),
            extra_eos_ids=extra_eos_ids,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The tokenizers library's object (structured outputs read its vocabulary and kind)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        if wants_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, which may be part of a UTF-8 character (decode gives U+FFFD there):
        byte-level BPE maps its alphabet back to bytes ("Ġ" -> b" ", "âĤ¬" -> "€"'s 3 bytes); SentencePiece
        byte fallback "<0xE2>" is one byte, and "▁" a space. Special tokens are their text."""
        token = self._backend.id_to_token(token_id) or ""
        if token_id in self._special_ids:
            return token.encode()
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in token):
            return bytes(self._byte_decoder[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode()

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def _byte_decoder(self) -> dict[str, int] | None:
        """GPT-2's byte-level alphabet (character -> byte) when the tokenizer decodes byte-level."""
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        if "ByteLevel" not in kinds:
            return None
        # printable Latin-1 bytes stand for themselves; the other 68 take the characters from 256 on
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        others = [b for b in range(256) if b not in printable]
        return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        """The chat template, compiled in the same sandboxed environment transformers uses."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_template_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            return environment.from_string(self.chat_template)
        except jinja2.TemplateError as error:
            raise TokenizerError(f"invalid chat template: {error}") from error

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's chat template exactly as transformers does."""
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables = {"tools": None, "documents": None, **{k: v for k, v in special.items() if v is not None}}
        # transformers drops None-valued keys (e.g. OpenAI's content=None) before rendering.
        messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
        try:
            return self._compiled_chat_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **(variables | extra)
            )
        except jinja2.TemplateError as error:
            raise TokenizerError(f"chat template error: {error}") from error

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat (tools: OpenAI's tool objects, for templates that render them);
        the template writes bos itself, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools=tools), False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces for streaming; never emits half a character."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer, self._skip_special_tokens = tokenizer, skip_special_tokens
        # _ids[:_read_offset] is context that was already emitted (the previous piece, or the prompt's tail):
        # decoding it together with the pending _ids[_read_offset:] gets merges and leading spaces right.
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _pending_text(self) -> str:
        context_text = self._decode(self._ids[: self._read_offset])
        return self._decode(self._ids)[len(context_text) :]

    def _emit(self, piece: str) -> str:
        self._pieces.append(piece)
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return piece

    def push(self, token_id: int) -> str:
        """Add one token; return the text it made final (possibly "")."""
        self._ids.append(token_id)
        piece = self._pending_text()
        if not piece or piece.endswith("\ufffd"):
            return ""
        return self._emit(piece)

    def flush(self) -> str:
        """At the end of generation: the held-back text, even if it ends in an incomplete character."""
        return self._emit(self._pending_text())

    @property
    def text(self) -> str:
        return "".join(self._pieces)


class StopStringMatcher:
    """Finds stop strings in streamed text; holds back text that might be the start of a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""

    def _held_back_length(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def feed(self, piece: str) -> tuple[str, bool]:
        """Return (text safe to emit now, stopped); after stopped is True, feed must not be called again."""
        text = self._held + piece
        found = [index for index in (text.find(stop) for stop in self._stops) if index >= 0]
        if found:
            self._held = ""
            return text[: min(found)], True
        keep = self._held_back_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of generation (no stop string hit): the held-back text."""
        held, self._held = self._held, ""
        return held
