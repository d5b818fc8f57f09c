"""The request fields that ask for structured output, as OpenAI and vLLM spell them, turned into one
StructuredOutputs (structured_spec.py):

- OpenAI: response_format {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}} (what `client.beta.chat.completions.parse(response_format=Model)` sends);
- vLLM: structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}, and the older
  guided_json / guided_regex / guided_choice / guided_grammar.

At most one of them may ask (two constraints on one output are a 400). A schema or grammar that does not
compile is a 400 too, raised when the request is made (engine/llm.py), naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from redline.server.errors import invalid
from redline.structured_spec import StructuredOutputs

NonEmpty = Annotated[str, Field(min_length=1)]
SchemaName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: SchemaName = Field(description="a-z, A-Z, 0-9, _ and -, up to 64 characters")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="a JSON Schema the output must match")
    strict: bool | None = Field(None, description="true: objects take no property the schema does not name")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's structured_outputs: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | NonEmpty | None = Field(None, alias="json")
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into the completions and chat bodies (server/protocol.py)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | NonEmpty | None = Field(
        None, description="vLLM's, as structured_outputs.json"
    )
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = Field(None, description="EBNF, as xgrammar reads it")

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The one constraint asked for and the field that asked (None, None: free text)."""
        asked: list[tuple[str, StructuredOutputs]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", StructuredOutputs(json_object=True)))
        if fmt is not None and fmt.json_schema is not None:
            strict = bool(fmt.json_schema.strict)
            asked.append(
                ("response_format", StructuredOutputs(json=fmt.json_schema.json_schema, strict=strict))
            )
        if (so := self.structured_outputs) is not None:
            asked.append(("structured_outputs", _of(so)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):  # fmt: skip
            if (value := getattr(self, name)) is not None:
                asked.append((name, StructuredOutputs(**{kind: value})))
        if len(asked) > 1:
            raise invalid(asked[1][0], f"asks for structured output beside {asked[0][0]}: give one")
        return (asked[0][1], asked[0][0]) if asked else (None, None)


def _of(field: StructuredOutputsField) -> StructuredOutputs:
    given = {"json": field.json_, "regex": field.regex, "choice": field.choice, "grammar": field.grammar}
    given = {k: v for k, v in given.items() if v is not None}
    if field.json_object:
        given["json_object"] = True
    if len(given) != 1:
        raise invalid("structured_outputs", "takes exactly one of json, regex, choice, grammar, json_object")
    return StructuredOutputs(**given)
