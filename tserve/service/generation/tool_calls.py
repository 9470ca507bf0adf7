"""Tool calls on /v1/chat/completions (OpenAI's `tools` and `tool_choice`): what constrains the output, how the
output becomes `tool_calls`, and how a stream of text becomes argument deltas.

- `required`: the output is a JSON array of calls, each `{"name": one of the tools, "arguments": an object of
  that tool's parameters}` (one call when `parallel_tool_calls` is false), enforced by the grammar mask.
- a named function: the output is that function's arguments object, enforced likewise; it streams as argument
  deltas as the tokens come.
- `auto`: the model chooses; what the chat template's tool format emits is parsed: Hermes / Qwen
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, or Llama 3's bare JSON object
  `{"name": ..., "parameters": ...}` (after an optional `<|python_tag|>`). Text that is not a call stays content.
- `none` (and no `tools`): plain text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from tserve.model.decoding.structured import Constraint

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolMode:
    """What a request's `tools` and `tool_choice` ask for: mode `none`, `auto`, `required` or `named`."""

    mode: str
    names: tuple[str, ...] = ()
    constraint: Constraint | None = None

    @property
    def constrained(self) -> bool:
        return self.constraint is not None


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
              parallel: bool | None) -> ToolMode:
    """The request's tool mode (raises ValueError for a choice that names no given tool). OpenAI's default:
    `auto` with tools, `none` without."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return ToolMode("none")
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if len(functions) != len(tools):
        raise ValueError("tools must have distinct function names")
    choice = tool_choice or "auto"
    if choice in ("none", "auto"):
        return ToolMode(choice, tuple(functions))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(f)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, f in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | (
            {"maxItems": 1} if parallel is False else {})
        return ToolMode("required", tuple(functions), Constraint("json", json.dumps(schema)))
    name = choice["function"]["name"]
    if name not in functions:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolMode("named", (name,), Constraint("json", json.dumps(_parameters(functions[name]))))


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_output(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer. Constrained modes parse their own format; `auto` looks for the
    templates' formats and leaves other text as content."""
    if mode.mode == "named":
        return None, [ToolCall(mode.names[0], _compact(json.loads(text)))]
    if mode.mode == "required":
        return None, [ToolCall(c["name"], _compact(c["arguments"])) for c in json.loads(text)]
    if mode.mode != "auto":
        return text, []
    calls = []
    for block in _HERMES.findall(text):
        call = _call(block)
        if call is not None:
            calls.append(call)
    if calls:
        rest = _HERMES.sub("", text).strip()
        return rest or None, calls
    stripped = text.strip()
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG):].strip()
    for part in (p for p in re.split(r";\s*(?=\{)", stripped) if p):  # Llama 3.x: calls joined by ';'
        call = _call(part)
        if call is None or call.name not in mode.names:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], _compact(args)) if isinstance(args, dict) else None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


class ToolStream:
    """One choice's stream in a tool mode: the events' text becomes chat deltas. A named function's
    arguments stream as they come; `required` and `auto` hold the text until it is known to be calls (auto
    lets plain text through as soon as it cannot begin a call)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode, self.text, self.held, self.streaming_text = mode, "", "", False
        self.call = ToolCall(mode.names[0], "") if mode.mode == "named" else None

    def deltas(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas for this event's text, and the finish reason to report."""
        self.text += text
        if self.mode.mode == "named":
            out = []
            if self.text == text and text:  # the first text: the call's head
                out.append({"tool_calls": [self.call.openai(0) | {"function": {"name": self.call.name,
                                                                                "arguments": ""}}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            # "stop" is the grammar completing the arguments, or a stop string cutting them: only the first is a
            # call, as the whole answer's parse says (a cut call is answered as text there).
            return out, ("tool_calls" if finish_reason == "stop" and _is_json(self.text) else finish_reason)
        if self.streaming_text:
            return ([{"content": text}] if text else []), finish_reason
        self.held += text
        if self.mode.mode == "auto" and not _may_begin_call(self.held):
            self.streaming_text, held, self.held = True, self.held, ""
            return [{"content": held}], finish_reason
        if finish_reason is None:
            return [], None
        try:
            content, calls = parse_output(self.mode, self.held)
        except (json.JSONDecodeError, TypeError, KeyError):  # cut by max_tokens: what came, as text
            return [{"content": self.held}], finish_reason
        out = [{"content": content}] if content else []
        for k, call in enumerate(calls):
            out.append({"tool_calls": [call.openai(k) | {"function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        # calls found: "tool_calls", however the answer ended (text after them cut by max_tokens), as the whole
        # answer's message with its calls says
        return out, ("tool_calls" if calls else finish_reason)


def _may_begin_call(text: str) -> bool:
    s = text.lstrip()
    return any(marker.startswith(s) or s.startswith(marker) for marker in ("<tool_call>", _PYTHON_TAG, "{")) \
        or not s
