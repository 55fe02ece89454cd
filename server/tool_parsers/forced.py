"""The parsers of a forced tool_choice: the output is constrained to JSON by a grammar (server/protocol.py
forced_tool_schema), so there is no markup to find, only the calls' arguments to hand on."""

from __future__ import annotations

from typing import Any

import msgspec

from flotilla.server.tool_parsers.base import OpenCall, ToolCall, ToolCallDelta, new_tool_call_id


class NamedToolParser:
    """tool_choice naming a function: the output, constrained to its parameters' schema, is that call's arguments
    (vLLM's way), streamed as argument deltas of the one call."""

    def __init__(self, name: str) -> None:
        self._call = OpenCall(name)
        self._started = False

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=self._call.id, name=self._call.name, arguments="".join(self._call.parts))]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not text and self._started:
            return "", []
        self._call.parts.append(text)
        head = {} if self._started else {"id": self._call.id, "name": self._call.name}
        self._started = True
        return "", [ToolCallDelta(index=0, arguments=text, **head)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("")


class RequiredToolParser:
    """tool_choice "required": the output, constrained to a JSON array of {"name", "parameters"} objects (one per
    call), becomes the calls once it is complete (vLLM's way); each call streams as one delta at the end."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._parts.append(text)
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        try:
            calls = msgspec.json.decode("".join(self._parts))
        except msgspec.DecodeError:  # cut off (max_tokens): no call to report
            return "", []
        self._calls = [ToolCall(id=new_tool_call_id(), name=c["name"], arguments=_encode_args(c.get("parameters")))
                       for c in calls if isinstance(c, dict) and isinstance(c.get("name"), str)]
        return "", [ToolCallDelta(index=i, id=c.id, name=c.name, arguments=c.arguments)
                    for i, c in enumerate(self._calls)]


def _encode_args(parameters: Any) -> str:
    return msgspec.json.encode({} if parameters is None else parameters).decode()


def required_tool_calls_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The JSON schema an output under tool_choice "required" follows: an array of at least one {"name", "parameters"}
    object, each naming one of `tools` (name, parameters schema) with its arguments; at most one unless parallel."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": params or {"type": "object"}},
              "required": ["name", "parameters"]} for name, params in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
