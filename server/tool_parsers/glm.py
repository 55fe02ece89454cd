"""Tool calls in GLM-4.5's XML-like format, which GLM-4.6, GLM-4.7 and GLM-5 keep (vLLM's ``glm45`` and ``glm47``
parsers)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(GLM-4.7 and later write no newlines between the tags; a call without arguments is ``<tool_call>NAME</tool_call>``.)

The arguments become one JSON object, streamed a pair at a time: ``{"city": "Beijing"``, then ``, "days": 3``, then
``}`` at the closing tag. A value is a JSON string when the request's tool schema types that parameter "string" (the
chat templates write strings bare, so ``123`` may be one); otherwise a value that parses as JSON keeps its type and
any other is a string. A call is committed at its first argument key or its closing tag; a body that is not a name
followed by those goes to the client as content, tags included.
"""

from __future__ import annotations

import json
import re

from flotilla.server.protocol_types import ToolDefinition
from flotilla.server.tool_parsers.base import CallsOutput, first_of, held_back

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"

_HEAD = re.compile(r"\s*(?P<name>[\w.\-]+)\s*(?=<arg_key>|</tool_call>)")
"""A call's name, complete once the first key or the closing tag follows it."""
_HEAD_SO_FAR = re.compile(r"\s*(?:[\w.\-]+\s*)?")
"""What a body may hold while its name is still being written (before any tag)."""
_PAIR = re.compile(r"\s*<arg_key>(?P<key>[^<]*)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)

_CONTENT, _HEAD_PHASE, _ARGS = range(3)


def string_parameters(tools: list[ToolDefinition] | None) -> dict[str, frozenset[str]]:
    """Function name -> the names of its parameters whose schema type is "string"."""
    out: dict[str, frozenset[str]] = {}
    for tool in tools or ():
        props = (tool.function.parameters or {}).get("properties")
        if isinstance(props, dict):
            out[tool.function.name] = frozenset(k for k, v in props.items()
                                                if isinstance(v, dict) and v.get("type") == "string")
    return out


def _value_json(value: str, as_string: bool) -> str:
    if not as_string:
        try:
            return json.dumps(json.loads(value), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


class Glm45ToolParser(CallsOutput):
    """Incremental parser of GLM's ``<tool_call>`` blocks for one choice (see module doc)."""

    TAGS = (CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END)

    def __init__(self, tools: list[ToolDefinition] | None = None) -> None:
        super().__init__()
        self._strings = string_parameters(tools)
        self._buf = ""
        """Text received but not settled yet (a held-back tag prefix, whitespace, or an unread part of a call)."""
        self._phase = _CONTENT
        self._skip_ws = False
        """Just after a call: the whitespace that follows it separates, it is not content."""
        self._ws_before = ""
        """Whitespace dropped before an opening tag; given back if the call turns out unreadable."""
        self._pairs = 0
        """Arguments of the open call written so far."""
        self._value_from = 0
        """While a value is being written: where the search for its closing tag resumes (0: not waiting on one)."""

    def _run(self, final: bool) -> None:
        steps = (self._step_content, self._step_head, self._step_args)
        while steps[self._phase](final):
            pass

    def _step_content(self, final: bool) -> bool:
        buf = self._unskipped()
        if buf is None:
            return False
        i = buf.find(CALL_START)
        if i >= 0:
            text = buf[:i].rstrip()
            self._emit_content(text)
            self._ws_before = buf[len(text):i]
            self._buf, self._phase = buf[i + len(CALL_START):], _HEAD_PHASE
            return True
        if final:
            self._emit_content(buf)
            self._buf = ""
            return False
        settled = buf[: len(buf) - held_back(buf, (CALL_START,))].rstrip()
        self._emit_content(settled)
        self._buf = buf[len(settled):]
        return False

    def _step_head(self, final: bool) -> bool:
        buf = self._buf
        m = _HEAD.match(buf)
        if m is not None:
            self._open_call(m["name"])
            self._ws_before, self._pairs = "", 0
            self._buf, self._phase = buf[m.end():], _ARGS
            return True
        so_far = _HEAD_SO_FAR.match(buf).end()
        rest = buf[so_far:]
        if not final and (KEY_START.startswith(rest) or CALL_END.startswith(rest)):
            return False  # the name is still being written, or the tag after it
        end = buf.find(CALL_END)  # not a call: the client gets what the model wrote, up to the closing tag
        if end < 0 and not final:
            return False
        body = buf if end < 0 else buf[: end + len(CALL_END)]
        self._emit_content(self._ws_before + CALL_START + body)
        self._ws_before = ""
        self._buf, self._phase = ("" if end < 0 else buf[end + len(CALL_END):]), _CONTENT
        self._skip_ws = False
        return end >= 0

    def _step_args(self, final: bool) -> bool:
        buf = self._buf
        if not final and self._value_from and buf.find(VALUE_END, self._value_from) < 0:
            self._value_from = max(self._value_from, len(buf) - len(VALUE_END) + 1)
            return False  # a long value still being written: not scanned again from its start
        self._value_from = 0
        pos = 0
        while (m := _PAIR.match(buf, pos)) is not None:
            self._emit_pair(m["key"].strip(), m["value"])
            pos = m.end()
        rest = buf[pos:].lstrip()
        if rest.startswith(CALL_END):
            self._close(rest[len(CALL_END):])
            return True
        if not final:
            if rest.startswith(KEY_START) and self._pair_may_complete(rest):
                self._buf = rest
                return False
            if KEY_START.startswith(rest) or CALL_END.startswith(rest):
                self._buf = rest  # nothing, or the start of a tag
                return False
        # text that is no argument (or the output ended): skipped, to the next key or the end of the call
        i, tag = first_of(rest, (KEY_START, CALL_END), 1)
        if tag is not None:
            self._buf = rest[i:]
            return True
        if final:
            self._close("")
            return False
        self._buf = rest[len(rest) - held_back(rest, (KEY_START, CALL_END)):]
        return False

    def _pair_may_complete(self, text: str) -> bool:
        """Whether ``text``, an argument's unfinished key-value pair, can still become a whole one."""
        key_end = text.find(KEY_END)
        key = text[len(KEY_START): key_end if key_end >= 0 else len(text)]
        lt = key.find("<")
        if key_end < 0:
            return lt < 0 or KEY_END.startswith(key[lt:])  # the key is being written
        after = text[key_end + len(KEY_END):].lstrip()
        if lt >= 0 or VALUE_END in after:
            return False
        if after.startswith(VALUE_START):
            self._value_from = max(0, len(text) - len(VALUE_END) + 1)
            return True  # the value is being written
        return VALUE_START.startswith(after)

    def _emit_pair(self, key: str, value: str) -> None:
        call = self._calls[-1]
        as_string = key in self._strings.get(call.name, ())
        text = json.dumps(key, ensure_ascii=False) + ": " + _value_json(value, as_string)
        self._emit_args(("{" if self._pairs == 0 else ", ") + text)
        self._pairs += 1

    def _close(self, rest: str) -> None:
        self._emit_args("}" if self._pairs else "{}")
        self._buf, self._phase, self._skip_ws = rest, _CONTENT, True
