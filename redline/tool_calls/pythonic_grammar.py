"""An EBNF grammar (xgrammar's dialect) of pythonic tool calls whose arguments are literals of their
JSON schemas' types: what tool_choice "required" or a named function holds a Llama 4 model to.

Each tool's call writes its required parameters in the schema's order, then any of its optional ones in
order; each value is a Python literal of the parameter's type (a string, an integer, a number, True /
False, None, a list of the item type, a dict with the object's properties, one of an enum's values), so
the arguments read back (ast) as JSON valid for the schema's types, properties, required keys, enums,
maxLength / minLength and maxItems. Not enforced: pattern, minimum / maximum, minItems, $ref (a value
of any type), required names missing from properties.

Example: get_weather(city: string, required; days: integer) ->
    value_0 ::= "city=" string (", " "days=" integer)?
    call_0 ::= "get_weather(" value_0 ")"
so the model may write get_weather(city="Oslo") or get_weather(city="Oslo", days=3).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# a string's character: no raw line ends or NUL (Python refuses them in a literal), and only the escapes
# Python reads as JSON does (not \/; \u left out for brevity)
CHAR = r'[^"\\\n\r\x00] | "\\" ["\\bfnrt]'
SCALARS = {
    "string": r'"\"" char* "\""',
    "integer": r'"-"? ("0" | [1-9] [0-9]*)',
    "number": r'"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]{1,2})?',  # 1e999 is inf
    "boolean": '"True" | "False"',
    "null": '"None"',
}
ANY = "any_value"


def pythonic_calls_grammar(tools: list[dict], parallel: bool) -> str:
    """tools: OpenAI function objects ({"name", "parameters"}); the grammar of "[call]" ("[call, call,
    ...]" when parallel)."""
    rules: list[str] = []
    calls = []
    for i, tool in enumerate(tools):
        args = _fields(tool.get("parameters") or {}, lambda name: f"{name}=", rules)
        rules.append(f'call_{i} ::= "{tool["name"]}(" {args} ")"')
        calls.append(f"call_{i}")
    rules.append(f"call ::= {' | '.join(calls)}")
    rules.append('root ::= "[" call (", " call)* "]"' if parallel else 'root ::= "[" call "]"')
    rules += [f"{name} ::= {rule}" for name, rule in SCALARS.items()] + [f"char ::= {CHAR}"]
    rules.append(f'{ANY} ::= string | number | boolean | null | "[" ({ANY} (", " {ANY})*)? "]" '
                 f'| "{{" (string ": " {ANY} (", " string ": " {ANY})*)? "}}"')  # fmt: skip
    return "\n".join(rules)


def _value(schema: Any, rules: list[str]) -> str:
    """The rule a value of `schema` matches (added to rules when it needs one of its own)."""
    if not isinstance(schema, dict):
        return ANY
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return _new(rules, " | ".join(_quoted(_python(v)) for v in values))
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return _new(rules, " | ".join(_value(option, rules) for option in options))
    kind = schema.get("type")
    if isinstance(kind, list):
        return _new(rules, " | ".join(_value({**schema, "type": k}, rules) for k in kind))
    if kind == "string" and ("maxLength" in schema or "minLength" in schema):  # "a{0,12}"
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return _new(rules, f'"\\"" char{{{low},{"" if high is None else int(high)}}} "\\""')
    if kind in SCALARS:
        return kind
    if kind == "array":  # maxItems 3: "[" (item (", " item){0,2})? "]"
        item, most = _value(schema.get("items"), rules), schema.get("maxItems")
        if most is not None and int(most) < 1:
            return _new(rules, '"[]"')
        more = "*" if most is None else f"{{0,{int(most) - 1}}}"
        return _new(rules, f'"[" ({item} (", " {item}){more})? "]"')
    if kind == "object" and "properties" in schema:
        return _new(rules, f'"{{" {_fields(schema, lambda name: json.dumps(name) + ": ", rules)} "}}"')
    if kind == "object":
        return _new(rules, f'"{{" (string ": " {ANY} (", " string ": " {ANY})*)? "}}"')
    return ANY


def _fields(schema: dict, key: Callable[[str], str], rules: list[str]) -> str:
    """An argument list (key: 'city=') or a dict's items (key: '"city": '): the required properties in order,
    then the optional ones, each optional, in order. With no required ones, the first written may be
    any optional one (and then only later ones follow): ("" | o1 (", " o2)? | o2)."""
    properties = schema.get("properties") or {}
    required = [p for p in properties if p in set(schema.get("required") or [])]
    optional = [p for p in properties if p not in required]
    item = lambda name: f"{_quoted(key(name))} {_value(properties[name], rules)}"
    tail = lambda names: " ".join(f'(", " {item(n)})?' for n in names)
    if required:
        head = ' ", " '.join(item(n) for n in required)
        return _new(rules, f"{head} {tail(optional)}".strip())
    starts = [f"{item(n)} {tail(optional[i + 1 :])}".strip() for i, n in enumerate(optional)]
    return _new(rules, " | ".join(['""', *starts]))


def _new(rules: list[str], body: str) -> str:
    name = f"value_{len(rules)}"
    rules.append(f"{name} ::= {body}")
    return name


def _python(value: Any) -> str:
    """An enum value as a Python literal: "a" -> '"a"', True -> 'True', None -> 'None', 2 -> '2',
    {"a": [True]} -> '{"a": [True]}'."""
    if value is True or value is False or value is None:
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_python(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _quoted(text: str) -> str:
    return f'"{_escape(text)}"'


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
