"""What a request's output must match: a JSON schema, any JSON object, a regular expression, one of some
strings, or an EBNF grammar (vLLM's StructuredOutputsParams: json, json_object, regex, choice, grammar).

Exactly one is given. `key` is what the compiled grammar is cached under (structured/grammar.py): the
same schema asked twice compiles once (the same text: JSON's properties keep their order, which the
output follows).

Example: StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}},
"required": ["n"]}) lets the model write {"n": 12} or {"n": -3} and nothing else, then its stop token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict | str | None = None  # a JSON schema (a dict, or its text)
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF: llama.cpp's dialect, as xgrammar reads it)
    strict: bool = True  # json: additionalProperties false unless the schema says otherwise (OpenAI strict)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) or "none")
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured json must be a JSON schema: an object or its text")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the compiled-grammar cache's key."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return ("json_strict" if self.strict else "json", schema)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        assert self.grammar is not None
        return ("grammar", self.grammar)
