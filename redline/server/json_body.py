"""A request body parsed as JSON within bounds, so that no body can make the server fail (a 5xx) before
its fields are even read.

Python's json module takes what the bounds below refuse, and each once gave a 500:
- an integer literal of more than 4,300 digits raises ValueError (Python's limit on int(str));
- arrays nested about 1,000 deep raise RecursionError, and anything that walks the value recursively
  afterwards (validation, a JSON schema compiler) fails on far less;
- "\\ud800" decodes to a lone surrogate, which is not a Unicode scalar value: the tokenizer (Rust) and any
  UTF-8 encoder refuse it.
Each is a 400 naming the limit and, for text, the field ("messages[0].content").
"""

from __future__ import annotations

import json
import re
from typing import Any

from redline.server.errors import APIError

MAX_INTEGER_DIGITS = 100  # a 64-bit seed has 20; JSON has no other use for longer ones
MAX_DEPTH = 64  # arrays and objects inside each other; a response_format schema needs far fewer
_SURROGATE = re.compile("[\ud800-\udfff]")


class _TooManyDigits(ValueError):
    pass


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _TooManyDigits
    return int(literal)


def parse_json(body: bytes) -> Any:
    """The body's JSON value (UTF-8), or a 400 saying what is wrong with it."""
    try:
        value = json.loads(body, parse_int=_bounded_int)
    except _TooManyDigits:
        raise APIError(400, f"request body holds an integer of more than {MAX_INTEGER_DIGITS} digits",
                       reason="bad_json") from None  # fmt: skip
    except RecursionError:
        raise _too_deep() from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", reason="bad_json") from e
    check_value(value)
    return value


def check_value(value: Any) -> None:
    """Walks a parsed value without recursion: a 400 for nesting beyond MAX_DEPTH or a string (a key or a
    value) holding a lone surrogate, named by its path. Example: {"messages": [{"content": "\\ud800"}]}
    is refused as "messages[0].content"."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]  # (value, its path, its depth)
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict | list):
            if depth >= MAX_DEPTH:
                raise _too_deep()
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                child_path = (f"{path}.{key}" if path else key) if isinstance(key, str) else f"{path}[{key}]"
                if isinstance(key, str):
                    _check_text(key, child_path)
                stack.append((child, child_path, depth + 1))


def _check_text(text: str, path: str) -> None:
    if not text.isascii() and (found := _SURROGATE.search(text)):
        path = path.encode("utf-8", "backslashreplace").decode()  # a key's own surrogate: "\\ud800key"
        where = f"{path}: " if path else ""
        message = (f"{where}text holds a lone surrogate (\\u{ord(found.group()):04x} at character "
                   f"{found.start()}); text must be Unicode scalar values")  # fmt: skip
        raise APIError(400, message, path or None, reason="bad_field")


def _too_deep() -> APIError:
    message = f"request body nests arrays and objects more than {MAX_DEPTH} deep"
    return APIError(400, message, reason="bad_json")
