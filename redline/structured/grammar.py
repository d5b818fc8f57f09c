"""Compiling structured-output specs into xgrammar grammars over a model's vocabulary, cached.

xgrammar (the pip package) reads the vocabulary as the Hugging Face tokenizer stores it: every token's
string by id, and the tokenizer's kind (byte-level BPE as in Llama 3 and SmolLM2, byte-fallback
SentencePiece, raw), which it finds in tokenizer.json itself. Token ids past the tokenizer's (a model's
padded embedding rows) are never allowed. The model's stop tokens end a grammar: a matcher allows them
exactly where the output is complete.

A spec that does not compile (a malformed schema, a regex xgrammar cannot read) raises StructuredError
naming the problem; the server answers it with a 400. xgrammar imports only when a request asks for
structured output, so the engine runs without it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from redline.structured_spec import StructuredOutputs
from redline.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

CACHED = 256  # compiled grammars kept (least recently used dropped)
MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar's text: compiling is host work on the serving path
# JSON as json.dumps writes it, '{"a": 1, "b": [2, 3]}': free whitespace lets a model pad forever (small
# models do), and one layout keeps the grammar's choices to the values
SEPARATORS = (", ", ": ")


class StructuredError(ValueError):
    """A structured-output spec that cannot be compiled (or xgrammar missing)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        raise StructuredError(
            "structured outputs need the xgrammar package: pip install xgrammar (or redline[structured])"
        ) from error
    return xgrammar


class GrammarCompiler:
    """One per engine: the vocabulary's xgrammar description and the compiled grammars, by spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: frozenset[int]):
        xgr = _xgrammar()
        backend = tokenizer.backend
        vocab = backend.get_vocab(with_added_tokens=True)  # token string -> id
        encoded = [""] * vocab_size
        for token, index in vocab.items():
            if index < vocab_size:
                encoded[index] = token
        kind = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgr.TokenizerInfo(encoded, kind["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_ids) or None,
                                 add_prefix_space=kind["add_prefix_space"])  # fmt: skip
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached here, by spec
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the server validates requests on its own thread

    def compile(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """The spec's grammar, compiled once (later asks for the same spec hit the cache)."""
        key = spec.key
        if len(key[1]) > MAX_SPEC_CHARS:
            kind = key[0].replace("_strict", "")
            raise StructuredError(f"the structured output's {kind} is {len(key[1]):,} characters: at most "
                                  f"{MAX_SPEC_CHARS:,}")  # fmt: skip
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        c = self._compiler
        try:
            if spec.json is not None or spec.json_object:
                schema = json.dumps({"type": "object"}) if spec.json_object else spec.key[1]
                grammar = _xgrammar().Grammar.from_json_schema(
                    schema, any_whitespace=False, separators=SEPARATORS,
                    strict_mode=spec.strict and not spec.json_object)  # fmt: skip
                return c.compile_grammar(escaped_control_characters(str(grammar)))
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return c.compile_grammar(f"root ::= {literals}")
            assert spec.grammar is not None
            return c.compile_grammar(spec.grammar)
        except Exception as error:  # xgrammar raises RuntimeError / ValueError / its own kinds
            kind = spec.key[0].replace("_strict", "")
            message = f"the structured output's {kind} does not compile: {_said(error)}"
            raise StructuredError(message) from error


def _said(error: Exception) -> str:
    """What xgrammar's error says, without where in its sources it was raised: '[13:40:37]
    /project/cpp/regex_converter.cc:94: Regex parsing error at position 3: ...' -> 'Regex parsing error at
    position 3: ...'."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", lines[0])


# xgrammar 0.2.9 writes a string with minLength / maxLength as repetitions of this character class, which
# lets raw control characters (U+0000 .. U+001F) into the string: '{"m": "a\x17"}', which JSON forbids
# and json.loads refuses. Its unbounded strings already exclude them.
BOUNDED_STRING_CHARACTER = '[^\\"\\\\\\r\\n]'
JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def escaped_control_characters(ebnf: str) -> str:
    """The JSON schema grammar's EBNF with bounded strings' characters as JSON allows them unescaped:
    root_prop_0_characters ::= (([^\\"\\\\\\r\\n])) -> (([^\\0-\\x1f\\"\\\\]))."""
    return ebnf.replace(BOUNDED_STRING_CHARACTER, JSON_STRING_CHARACTER)
