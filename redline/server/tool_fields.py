"""The chat request's tool fields (OpenAI's): tools, tool_choice, parallel_tool_calls, read into one
ToolUse (tool_calls/tool_use.py) for the model's call format. Mixed into the chat body
(server/protocol.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from redline.server.errors import invalid
from redline.structured_spec import StructuredOutputs
from redline.tool_calls.formats import ToolFormat
from redline.tool_calls.tool_use import ToolUse

MAX_TOOLS = 128
NonEmpty = Annotated[str, Field(min_length=1)]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Function(Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError('must be a JSON Schema of an object ("type": "object")')
        return schema


class Tool(Body):
    type: Literal["function"]
    function: Function


class NamedFunction(Body):
    name: NonEmpty


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default "auto" with tools, "none" without'
    )
    parallel_tool_calls: bool | None = Field(True, description="pythonic formats (Llama 4): several calls")

    def tool_use(self, format: ToolFormat) -> ToolUse | None:
        """The tools the model may call, and how (None: tool_choice "none", or no tools)."""
        choice = self.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        if self.tools is None:
            if name not in (None, "none"):
                raise invalid("tool_choice", "needs tools")
            return None
        if name == "none":
            return None
        functions = tuple(t.function.model_dump(exclude_none=True) for t in self.tools)
        try:
            return ToolUse(functions, name or "auto", self.parallel_tool_calls is not False, format)
        except ValueError as e:
            raise invalid("tool_choice" if "tool_choice" in str(e) else "tools", str(e)) from None


def tool_constraint(tools: ToolUse | None) -> StructuredOutputs | None:
    """What tool_choice "required" or a named function holds the output to (None: nothing); a parameters
    schema the grammar cannot be built from is the tools' 400."""
    try:
        return None if tools is None else tools.constraint()
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise invalid(
            "tools", f"a function's parameters are a JSON Schema redline cannot read: {e}"
        ) from None
