"""A chat request's tools: what the chat template renders, the constraint that tool_choice "required" or
a named function puts on the output, and the output read back as content or calls, whole or streamed.

tool_choice (OpenAI's): "none" (no tools rendered, no calls read), "auto" (the model chooses: its text is
read as calls when it is wholly calls in the model's format, as content otherwise), "required" (at
least one call: the output is held to the format's grammar over all the tools) or a function's name (a
call of that one). parallel_tool_calls lets the pythonic format write several calls; Llama 3's JSON
format writes one per message.
"""

from __future__ import annotations

import contextlib
import json
import keyword
from dataclasses import dataclass

from redline.structured_spec import StructuredOutputs
from redline.tool_calls.formats import ToolCall, ToolFormat


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[dict, ...]  # OpenAI function objects: {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required" or a tool's name ("none" makes no ToolUse)
    parallel: bool
    format: ToolFormat

    def __post_init__(self) -> None:
        names = [tool["name"] for tool in self.tools]
        if self.choice not in ("auto", "required", *names):
            raise ValueError(f"tool_choice names {self.choice!r}, which is not among the tools ({names})")
        if self.format.name == "pythonic":
            arguments = [name for tool in self.tools for name in _argument_names(tool)]
            if not all(_python_name(name) for name in [*names, *arguments]):
                raise ValueError("this model writes calls as Python (Llama 4): tool and parameter names must "
                                 "be identifiers, not keywords")  # fmt: skip

    @property
    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's request shape)."""
        return [{"type": "function", "function": tool} for tool in self.tools]

    def constraint(self) -> StructuredOutputs | None:
        """What the output must match: a call of any tool ("required"), of the named one, or nothing."""
        if self.choice == "auto":
            return None
        tools = [t for t in self.tools if self.choice == "required" or t["name"] == self.choice]
        return self.format.constraint(tools, self.parallel and self.choice == "required")

    def read(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, calls, finish_reason) of a whole output: one that ended on its stop and is wholly calls
        of the tools is calls, with no content, finish "tool_calls"; any other (cut by max_tokens,
        cancelled, failed) is its text, with its own finish."""
        calls = self.format.parse(text) if finish_reason == "stop" else None
        names = {tool["name"] for tool in self.tools}
        if calls and all(call.name in names for call in calls):
            return None, calls, "tool_calls"
        return text, [], finish_reason


def _argument_names(tool: dict) -> list[object]:
    """The names of a tool's parameters (its schema's top-level properties; none when it has no such)."""
    parameters = tool.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return list(properties) if isinstance(properties, dict) else []


def _python_name(name: object) -> bool:
    """A name a Python call can use: get_weather, city (not first-name, class)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


class ToolStream:
    """A streamed output's text as it comes: passed on as content at once unless it may be a call (then
    held, and read as calls or content at the end)."""

    def __init__(self, use: ToolUse):
        self.use, self.held, self.passing = use, "", False

    def feed(self, piece: str) -> str:
        """The content to send now."""
        if self.passing:
            return piece
        self.held += piece
        if self.use.choice == "auto" and not self.use.format.might_be_call(self.held):
            self.passing, piece, self.held = True, self.held, ""
            return piece
        return ""

    def finish(self, finish_reason: str) -> tuple[str, list[ToolCall], str]:
        """The content still held (when it was not calls), the calls and the finish (ToolUse.read)."""
        if self.passing:
            return "", [], finish_reason
        content, calls, finish_reason = self.use.read(self.held, finish_reason)
        return content or "", calls, finish_reason


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool calls with their arguments as objects
    (Llama's templates write `arguments | tojson`), OpenAI's being JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = message | {"tool_calls": [_with_object_arguments(call) for call in calls]}
        out.append(message)
    return out


def _with_object_arguments(call: dict) -> dict:
    function = call.get("function", {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # if not JSON: left as the text the client sent
            arguments = json.loads(arguments)
    return call | {"function": function | {"arguments": arguments}}
