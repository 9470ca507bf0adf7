"""Request bodies of structured output and tool calls (OpenAI's `response_format`, `tools`, `tool_choice`,
tool messages; vLLM's `structured_outputs`), and the base every request body shares."""

from __future__ import annotations

import json
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError


class RequestBody(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); NaN and inf are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and false as 0; OpenAI's API refuses a boolean where a number goes
        if expected := _number_expected(cls.model_fields[info.field_name].annotation, value):
            raise PydanticCustomError("bool_for_number", "expected {expected}, but got a boolean instead",
                                      {"expected": expected})
        return value


def _number_expected(annotation: Any, value: Any) -> str | None:
    """What a boolean in `value` stands in for where `annotation` wants a number ("an integer" or "a number"),
    looking into lists and the values of objects; None when `value` holds no boolean in such a place."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    if isinstance(value, bool):
        if bool in options:
            return None
        return "an integer" if int in options else "a number" if float in options else None
    if isinstance(value, list | dict):
        items = value if isinstance(value, list) else list(value.values())
        for option in options:
            if get_origin(option) is type(value):
                item_type = get_args(option)[-1]
                for item in items:
                    if isinstance(item, bool | list | dict) and (expected := _number_expected(item_type, item)):
                        return expected
    return None


class JsonSchemaFormat(RequestBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema (default: any JSON value)")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's `response_format`: `text`, `json_object` (any JSON object) or `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema: {name, schema}")
        return self


class StructuredOutputs(RequestBody):
    """Extension (vLLM's names): exactly one of a JSON schema, a regex, a list of choices or a grammar (Lark, or
    GBNF / EBNF with `::=` rules)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = Field(None, description="true: any JSON object")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        # given, not truthy: `"json": {}` is the empty schema (any JSON value), a constraint like any other
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object")
        return self


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content (text parts one per line, as vLLM joins them), and
        a call's arguments as an object (as transformers passes them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content if not isinstance(self.content, list)
                               else "\n".join(p.text for p in self.content)}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction
