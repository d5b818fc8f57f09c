"""How Llama models write tool calls, read back into OpenAI's shape, and the constraint that makes them
write one.

- Llama 3.1 / 3.2 / 3.3, JSON: `{"name": "get_weather", "parameters": {"city": "Paris"}}`, after the
  `<|python_tag|>` token or not (a special token: not in the text), several separated by ";".
- Llama 4's pythonic (Meta's documented format, vLLM's Llama 4 template; Meta's own Llama 4 template
  writes JSON calls as Llama 3 does): `[get_weather(city="Paris"), now()]`, read with Python's own parser
  (literal values only: nothing is evaluated).

Which one a model writes is read from its chat template (format_for), unless the user names it.

A call's arguments come back as a JSON object's text (OpenAI's `function.arguments`). A text that is not
wholly calls is plain content (a tool_choice "auto" answer).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from redline.structured_spec import StructuredOutputs
from redline.tokenizer import Tokenizer
from redline.tool_calls.pythonic_grammar import pythonic_calls_grammar

logger = logging.getLogger(__name__)
PYTHON_TAG = "<|python_tag|>"  # Llama 3's, before a call; Llama 4 wraps code in these:
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


class Llama3Json:
    name = "llama3_json"

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls the text holds, or None when it is not wholly calls. '{"name": "f", "parameters":
        {"x": 1}}; {"name": "g", "parameters": {}}' -> [f({"x": 1}), g({})]."""
        rest, calls, decoder = text.strip().removeprefix(PYTHON_TAG).strip(), [], json.JSONDecoder()
        while rest:
            try:  # ValueError: JSON's own, and an integer past Python's 4,300 digits
                value, end = decoder.raw_decode(rest)
            except ValueError:
                return None
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return None
            arguments = _json_object(value.get("parameters", value.get("arguments")))
            if arguments is None:
                return None
            calls.append(ToolCall(value["name"], arguments))
            rest = rest[end:].strip().removeprefix(";").strip()
        return calls or None

    def might_be_call(self, prefix: str) -> bool:
        """Whether streamed text so far may still turn out to be a call (it is held back until it is
        known): nothing yet but whitespace, or an object's start."""
        return prefix.strip().removeprefix(PYTHON_TAG).lstrip()[:1] in ("", "{")

    def constraint(self, tools: list[dict], parallel: bool) -> StructuredOutputs:
        """One call of one of the tools (Llama 3's format holds one per message), its parameters valid for
        the tool's schema. Each schema's $defs move to the root, renamed per tool (tool 0's "#/$defs/U" is
        "#/$defs/t0_U"), as the parameters sit one level down in the call's schema."""
        calls, defs = [], {}
        for i, tool in enumerate(tools):
            parameters = _refs_renamed(tool.get("parameters") or {"type": "object"}, f"t{i}_")
            for key in ("$defs", "definitions"):
                defs |= {f"t{i}_{name}": schema for name, schema in (parameters.pop(key, None) or {}).items()}
            calls.append({
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, "parameters": parameters},
                "required": ["name", "parameters"],
            })  # fmt: skip
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return StructuredOutputs(json=schema | ({"$defs": defs} if defs else {}))


class Pythonic:
    name = "pythonic"

    def parse(self, text: str) -> list[ToolCall] | None:
        """'[f(x=1, y="a"), g()]' -> [f({"x": 1, "y": "a"}), g({})]; None when the text is anything else."""
        body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
                return None
            try:  # TypeError: a dict whose key is a list; ValueError: anything but a literal
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            text = None if None in arguments else _json_object(arguments)  # None: f(**x)
            if text is None:
                return None
            calls.append(ToolCall(node.func.id, text))
        return calls

    def might_be_call(self, prefix: str) -> bool:
        return prefix.strip().removeprefix(PYTHON_START).lstrip()[:1] in ("", "[")

    def constraint(self, tools: list[dict], parallel: bool) -> StructuredOutputs:
        """A list of calls (one unless parallel) of the tools, each argument a literal of its schema's
        type (pythonic_grammar.py)."""
        return StructuredOutputs(grammar=pythonic_calls_grammar(tools, parallel))


def _refs_renamed(node: Any, prefix: str) -> Any:
    """A copy of a schema whose local references carry `prefix`: "#/$defs/U" and "#/definitions/U" ->
    "#/$defs/t0_U" (prefix "t0_")."""
    if isinstance(node, list):
        return [_refs_renamed(item, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _refs_renamed(value, prefix) for key, value in node.items()}
    ref = out.get("$ref")
    for root in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(root):
            out["$ref"] = "#/$defs/" + prefix + ref[len(root) :]
    return out


def _json_object(value: Any) -> str | None:
    """A dict's JSON text, or None when it is not a dict of JSON values: {"x": (1, 2)} -> '{"x": [1, 2]}';
    sets, bytes, complex numbers, non-string keys, inf and NaN are not JSON."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        return None
    try:  # json.dumps raises TypeError on what it cannot write (no default), ValueError on inf and NaN
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


FORMATS = {"llama3_json": Llama3Json(), "pythonic": Pythonic()}
ToolFormat = Llama3Json | Pythonic


def format_for(family: str, parser: str | None = None, written: ToolFormat | None = None) -> ToolFormat:
    """The format `parser` names ("llama3_json", "pythonic"); else the one the model's chat template
    writes an earlier call in (`written`: template_format's), the format the model learned; else its
    family's: Llama 4's pythonic, Llama 3's JSON. Meta's own Llama 4 template writes JSON calls, vLLM's
    Llama 4 template pythonic ones."""
    if parser is not None:
        return FORMATS[parser]
    return written or FORMATS["pythonic" if family == "llama4" else "llama3_json"]


def template_format(tokenizer: Tokenizer) -> ToolFormat | None:
    """How the chat template renders an assistant's call probe_tool(probe_argument=7): with the arguments
    as a JSON object ('"probe_argument": 7', which the tool's own schema never holds) Llama 3's JSON,
    'probe_tool(probe_argument=7)' pythonic; None for a template that writes neither (one that knows no
    tools), raises, or is missing."""
    schema = {"type": "object", "properties": {"probe_argument": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "probe_tool", "parameters": schema}}
    call = {"id": "call_0", "type": "function",
            "function": {"name": "probe_tool", "arguments": {"probe_argument": 7}}}  # fmt: skip
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(messages, False, tools=[tool])
    except Exception as error:  # a template that cannot render a call (TokenizerError, or its own bug)
        logger.info("the chat template renders no tool call (%s): the family's format", error)
        return None
    if "probe_tool(probe_argument=7)" in text:
        return FORMATS["pythonic"]
    return FORMATS["llama3_json"] if re.search(r'"probe_argument":\s*7', text) else None
