"""Tool-call parsing of model output in the Hermes / Qwen format, streaming and non-streaming.

The model writes a call as ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number
of times, with ordinary text around the calls. `HermesToolParser` is an incremental state machine fed
the detokenized text deltas; it returns what the client should see for each delta: content outside the
calls, and OpenAI tool-call deltas (a header with index, id and name, then argument fragments whose
concatenation is the call's ``arguments`` string). `parse_tool_calls` runs the same machine over the
whole text at once, so a streamed response and a non-streamed one agree exactly, whatever the chunking.

Rules (each chosen so that the decision depends only on text already seen, never on future chunks):

- No fragment of a tag leaks: a suffix that could be the start of ``<tool_call>`` / ``</tool_call>`` is
  held back until the next delta settles it.
- Streaming arguments: once the body starts with ``{"name": "<name>", "arguments": {`` the call is
  committed: its header goes out and the raw text of the arguments object streams as it arrives, up to
  the brace that closes it (tracked by a small JSON scanner) or the closing tag, whichever comes first.
  The arguments are the model's own JSON text; a model that breaks its JSON after that point (or runs
  out of tokens) yields a call whose arguments are not valid JSON, which is what OpenAI documents.
- Other bodies (keys in another order, arguments given as a string, no arguments) wait for the closing
  tag and are decoded whole; a body that is not ``{"name": str, ...}`` JSON goes to the client as
  plain content, tags included, so nothing the model wrote is lost and nothing crashes.
- Whitespace that only separates calls from each other or from the text (the newlines around the
  tags) is dropped; other text is passed through unchanged.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)',
    re.DOTALL,
)
"""The committed-call prefix: the lookahead on '{' makes a match on a partial body a match on the whole."""

_JSON_STRUCTURE = re.compile(r'[{}\[\]"]')
_JSON_STRING_STOP = re.compile(r'["\\]')

_CONTENT, _HEAD_PHASE, _ARGS, _TAIL = range(4)


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A complete tool call, as returned in a non-streaming chat.completion message."""

    id: str
    """Tool call id (``call_<hex>``); the client echoes it back in the tool message."""
    name: str
    """Function name as the model wrote it."""
    arguments: str
    """Arguments as a JSON string (the model's text; not guaranteed to be valid JSON)."""

    def to_openai(self) -> dict[str, Any]:
        """The ``message.tool_calls[i]`` object of a chat.completion."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """One call's change within one text delta: the header (id, name) once, then argument text."""

    index: int
    """Position of the call in the choice's tool_calls list, 0-based."""
    id: str | None = None
    """Set on the call's first delta only."""
    name: str | None = None
    """Set on the call's first delta only."""
    arguments: str = ""
    """Argument text added by this delta ('' on a header without arguments yet)."""

    def to_openai(self) -> dict[str, Any]:
        """The ``delta.tool_calls[i]`` object of a chat.completion.chunk."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolCallParser(Protocol):
    """What the chat response builders need from a tool-call format (one instance per choice)."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume a text delta; return the content to emit and the tool-call deltas, merged per index."""
        ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: release everything held back."""
        ...

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls found so far, with their full arguments."""
        ...


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (0 if none)."""
    first = tag[0]
    start = max(0, len(text) - len(tag) + 1)
    while True:
        i = text.find(first, start)
        if i < 0:
            return 0
        if tag.startswith(text[i:]):
            return len(text) - i
        start = i + 1


def _decode_call_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON string) of a whole call body, or None when it is not a usable call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return name, args
    return name, json.dumps(args, ensure_ascii=False)


class _JsonValueScanner:
    """Finds where a JSON object/array ends in text that arrives in pieces (strings and escapes aware).

    Only structural characters are visited (regex jumps over the rest), so the cost is per bracket and
    quote, not per character.
    """

    __slots__ = ("depth", "done", "escaped", "in_string")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """Consume ``text``; return how many leading characters belong to the value (sets ``done``)."""
        i, n = 0, len(text)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                    i += 1
                    continue
                m = _JSON_STRING_STOP.search(text, i)
                if m is None:
                    return n
                j = m.start()
                if text[j] == "\\":
                    self.escaped = True
                else:
                    self.in_string = False
                i = j + 1
                continue
            m = _JSON_STRUCTURE.search(text, i)
            if m is None:
                return n
            j = m.start()
            c = text[j]
            if c == '"':
                self.in_string = True
            elif c == "{" or c == "[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return j + 1
            i = j + 1
        return n


class _Call:
    __slots__ = ("id", "name", "parts")

    def __init__(self, name: str) -> None:
        self.id = new_tool_call_id()
        self.name = name
        self.parts: list[str] = []


class HermesToolParser:
    """Incremental parser of ``<tool_call>{json}</tool_call>`` blocks for one choice (see module doc)."""

    def __init__(self) -> None:
        self._buf = ""
        """Text received but not yet settled (a held-back tag prefix, whitespace, or a call body)."""
        self._phase = _CONTENT
        self._skip_ws = False
        """Just after a closing tag: the whitespace that follows it separates, it is not content."""
        self._ws_before_tag = ""
        """Whitespace dropped before an opening tag; given back if the call turns out malformed."""
        self._end_search_from = 0
        """In a call body, where the closing-tag search resumes (keeps long bodies linear)."""
        self._scanner = _JsonValueScanner()
        self._calls: list[_Call] = []
        self._content: list[str] = []
        self._deltas: dict[int, ToolCallDelta] = {}

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=c.id, name=c.name, arguments="".join(c.parts)) for c in self._calls]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._run(final=True)
        return self._take()

    # ---- output ----------------------------------------------------------------------------------

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content = "".join(self._content)
        deltas = list(self._deltas.values())
        self._content.clear()
        self._deltas.clear()
        return content, deltas

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _open_call(self, name: str) -> _Call:
        call = _Call(name)
        index = len(self._calls)
        self._calls.append(call)
        self._deltas[index] = ToolCallDelta(index=index, id=call.id, name=name)
        return call

    def _emit_args(self, text: str) -> None:
        if not text:
            return
        index = len(self._calls) - 1
        self._calls[index].parts.append(text)
        delta = self._deltas.get(index)
        if delta is None:
            self._deltas[index] = ToolCallDelta(index=index, arguments=text)
        else:
            delta.arguments += text

    # ---- the state machine -------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        progressed = True
        while progressed:
            phase = self._phase
            if phase == _CONTENT:
                progressed = self._step_content(final)
            elif phase == _HEAD_PHASE:
                progressed = self._step_head(final)
            elif phase == _ARGS:
                progressed = self._step_args(final)
            else:
                progressed = self._step_tail(final)

    def _close_call(self, rest: str) -> None:
        """A call ended at its closing tag; ``rest`` is the text after the tag."""
        self._buf = rest
        self._phase = _CONTENT
        self._skip_ws = True
        self._ws_before_tag = ""

    def _enter_call(self, rest: str, ws_before: str) -> None:
        self._buf = rest
        self._phase = _HEAD_PHASE
        self._ws_before_tag = ws_before
        self._end_search_from = 0

    def _step_content(self, final: bool) -> bool:
        buf = self._buf
        if self._skip_ws:
            stripped = buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            buf = stripped
            self._skip_ws = False
        i = buf.find(TOOL_CALL_START)
        if i >= 0:
            before = buf[:i]
            text = before.rstrip()
            self._emit_content(text)
            self._enter_call(buf[i + len(TOOL_CALL_START):], before[len(text):])
            return True
        if final:
            self._emit_content(buf)
            self._buf = ""
            return False
        settled = buf[: len(buf) - _partial_suffix(buf, TOOL_CALL_START)].rstrip()
        self._emit_content(settled)
        self._buf = buf[len(settled):]
        return False

    def _step_head(self, final: bool) -> bool:
        buf = self._buf
        end = buf.find(TOOL_CALL_END, self._end_search_from)
        body = buf if end < 0 else buf[:end]
        m = _HEAD.match(body)
        name = self._decode_name(m.group(1)) if m is not None else None
        if name is not None:
            self._open_call(name)
            self._ws_before_tag = ""
            self._buf = buf[m.end():]
            self._scanner = _JsonValueScanner()
            self._phase = _ARGS
            return True
        if end >= 0:
            rest = buf[end + len(TOOL_CALL_END):]
            decoded = _decode_call_body(body)
            if decoded is None:
                self._emit_content(self._ws_before_tag + TOOL_CALL_START + body + TOOL_CALL_END)
                self._buf, self._phase, self._ws_before_tag = rest, _CONTENT, ""
            else:
                self._open_call(decoded[0])
                self._emit_args(decoded[1])
                self._close_call(rest)
            return True
        if final:
            self._emit_content(self._ws_before_tag + TOOL_CALL_START + buf)
            self._buf, self._phase, self._ws_before_tag = "", _CONTENT, ""
            return False
        self._end_search_from = max(0, len(buf) - len(TOOL_CALL_END) + 1)
        return False

    @staticmethod
    def _decode_name(raw: str) -> str | None:
        try:
            name = json.loads('"' + raw + '"')
        except ValueError:
            return None
        return name or None

    def _step_args(self, final: bool) -> bool:
        buf = self._buf
        end = buf.find(TOOL_CALL_END)
        if end >= 0:
            segment = buf[:end]
        elif final:
            segment = buf
        else:
            segment = buf[: len(buf) - _partial_suffix(buf, TOOL_CALL_END)]
        used = self._scanner.feed(segment)
        self._emit_args(segment[:used])
        if self._scanner.done:
            self._buf = buf[used:]
            self._phase = _TAIL
            return True
        if end >= 0:  # the tag closed the call before its arguments did: keep what the model wrote
            self._close_call(buf[end + len(TOOL_CALL_END):])
            return True
        self._buf = buf[used:]
        return False

    def _step_tail(self, final: bool) -> bool:
        """After the arguments: skip the closing brace up to the end tag (or a new call's start tag)."""
        buf = self._buf
        end = buf.find(TOOL_CALL_END)
        start = buf.find(TOOL_CALL_START)
        if start >= 0 and (end < 0 or start < end):
            self._close_call("")
            self._enter_call(buf[start + len(TOOL_CALL_START):], "")
            return True
        if end >= 0:
            self._close_call(buf[end + len(TOOL_CALL_END):])
            return True
        if final:
            self._buf = ""
            return False
        keep = max(_partial_suffix(buf, TOOL_CALL_END), _partial_suffix(buf, TOOL_CALL_START))
        self._buf = buf[len(buf) - keep:] if keep else ""
        return False


TOOL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser}
"""Tool-call formats by name (the server's --tool-call-parser flag); one class per model family."""


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


class NamedToolParser:
    """tool_choice naming a function: the output, constrained to its parameters' schema, is that call's arguments
    (vLLM's way), streamed as argument deltas of the one call."""

    def __init__(self, name: str) -> None:
        self._call = _Call(name)
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
