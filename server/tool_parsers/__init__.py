"""Tool-call parsing of model output, one module per format, streaming and non-streaming.

Each format is a class with the `ToolCallParser` interface (base.py), constructed per choice with the request's
tools; `TOOL_PARSERS` names them as vLLM's --tool-call-parser does. `parse_tool_calls` runs a format's streaming
machine over a whole output at once, so a streamed response and a non-streamed one agree exactly.
"""

from __future__ import annotations

from collections.abc import Callable

from flotilla.server.tool_parsers.base import (
    CallsOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    new_tool_call_id,
)
from flotilla.server.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_tool_calls_schema
from flotilla.server.tool_parsers.glm import Glm45ToolParser
from flotilla.server.tool_parsers.hermes import TOOL_CALL_END, TOOL_CALL_START, HermesToolParser
from flotilla.server.tool_parsers.sectioned import DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser

__all__ = [
    "TOOL_CALL_END", "TOOL_CALL_START", "TOOL_PARSERS", "CallsOutput", "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser", "Glm45ToolParser", "HermesToolParser", "KimiK2ToolParser", "NamedToolParser",
    "RequiredToolParser", "ToolCall", "ToolCallDelta", "ToolCallParser", "new_tool_call_id", "parse_tool_calls",
    "required_tool_calls_schema",
]

TOOL_PARSERS: dict[str, type[CallsOutput]] = {
    "hermes": HermesToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,
}
"""Tool-call formats by vLLM's --tool-call-parser names (glm47: GLM-4.7 and GLM-5, the same reader as glm45)."""


def parse_tool_calls(text: str, parser: Callable[[], ToolCallParser] = HermesToolParser
                     ) -> tuple[str | None, list[ToolCall]]:
    """Split a complete output into (content without the calls, or None if empty; the calls in order).

    Runs the streaming parser over the whole text, so the result is exactly what a stream would show.
    """
    p = parser()
    head, _ = p.feed(text)
    tail, _ = p.finish()
    content = head + tail
    return (content or None), p.tool_calls
