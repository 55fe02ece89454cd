"""What every tool-call format shares: the call types the response builders read, the parser protocol, and the
output side of a streaming parser (content pieces, calls, deltas merged per call index).

A format's parser is fed the detokenized text of one choice, delta by delta, and returns what the client sees for
each: the content outside the calls, and OpenAI tool-call deltas (a header with index, id and name, then argument
fragments whose concatenation is the call's ``arguments`` string). Every format follows the same rules: no fragment
of a tag leaks (a suffix that could start one is held back until the next delta settles it), whitespace that only
separates calls from the text is dropped, and a call that cannot be read goes to the client as content, so nothing
the model wrote is lost.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, ClassVar, Protocol

import msgspec


def new_tool_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A complete tool call, as returned in a non-streaming chat.completion message."""

    id: str
    """Tool call id (``call_<hex>``, or the model's own where its format names calls); the client echoes it back in
    the tool message."""
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


def partial_suffix(text: str, tag: str) -> int:
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


def first_of(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """(position, tag) of the earliest of ``tags`` in ``text`` from ``start``; (-1, None) when none is there."""
    best, found = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    return best, found


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could still begin one of ``tags``."""
    return max(partial_suffix(text, tag) for tag in tags)


_JSON_STRUCTURE = re.compile(r'[{}\[\]"]')
_JSON_STRING_STOP = re.compile(r'["\\]')


class JsonValueScanner:
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


class OpenCall:
    """A call being parsed: its id, name and the argument text emitted so far."""

    __slots__ = ("id", "name", "parts")

    def __init__(self, name: str, call_id: str | None = None) -> None:
        self.id = call_id or new_tool_call_id()
        self.name = name
        self.parts: list[str] = []


class CallsOutput:
    """The output side of a streaming parser: content and call deltas gathered during one feed, and every call.

    A format's class is built per choice with the request's tools (``tools=``); only a format whose text does not
    say a value's type (GLM's) reads them."""

    TAGS: ClassVar[tuple[str, ...]] = ()
    """The markup the format writes around calls (the server checks whether the tokenizer calls them special
    tokens, which skip_special_tokens would drop before parsing)."""

    def __init__(self) -> None:
        self._calls: list[OpenCall] = []
        self._content: list[str] = []
        self._deltas: dict[int, ToolCallDelta] = {}

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=c.id, name=c.name, arguments="".join(c.parts)) for c in self._calls]

    _buf: str
    """Text received but not yet settled (the format's parser holds it)."""
    _skip_ws: bool
    """Just after a closing tag: the whitespace that follows it separates calls, it is not content."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._run(final=True)
        return self._take()

    def _run(self, final: bool) -> None:
        """Advance the format's state machine over the buffer (final: no more text comes)."""
        raise NotImplementedError

    def _unskipped(self) -> str | None:
        """The buffer without the whitespace after a closing tag; None (the buffer emptied) while only whitespace has
        come."""
        buf = self._buf
        if self._skip_ws:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return None
            self._skip_ws = False
        return buf

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content = "".join(self._content)
        deltas = list(self._deltas.values())
        self._content.clear()
        self._deltas.clear()
        return content, deltas

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _open_call(self, name: str, call_id: str | None = None) -> OpenCall:
        call = OpenCall(name, call_id)
        index = len(self._calls)
        self._calls.append(call)
        self._deltas[index] = ToolCallDelta(index=index, id=call.id, name=name)
        return call

    def _emit_args(self, text: str) -> None:
        """Argument text of the last opened call."""
        if not text:
            return
        index = len(self._calls) - 1
        self._calls[index].parts.append(text)
        delta = self._deltas.get(index)
        if delta is None:
            self._deltas[index] = ToolCallDelta(index=index, arguments=text)
        else:
            delta.arguments += text
