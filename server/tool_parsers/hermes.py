"""Tool-call parsing of model output in the Hermes / Qwen format, streaming and non-streaming.

The model writes a call as ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number
of times, with ordinary text around the calls. `HermesToolParser` is an incremental state machine fed
the detokenized text deltas; it returns what the client should see for each delta: content outside the
calls, and OpenAI tool-call deltas (a header with index, id and name, then argument fragments whose
concatenation is the call's ``arguments`` string). `parse_tool_calls` (server/tool_parsers) runs the same
machine over the whole text at once, so a streamed response and a non-streamed one agree exactly, whatever the
chunking.

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

from flotilla.server.protocol_types import ToolDefinition
from flotilla.server.tool_parsers.base import CallsOutput, JsonValueScanner, partial_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)',
    re.DOTALL,
)
"""The committed-call prefix: the lookahead on '{' makes a match on a partial body a match on the whole."""

_CONTENT, _HEAD_PHASE, _ARGS, _TAIL = range(4)


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


class HermesToolParser(CallsOutput):
    """Incremental parser of ``<tool_call>{json}</tool_call>`` blocks for one choice (see module doc)."""

    TAGS = (TOOL_CALL_START, TOOL_CALL_END)

    def __init__(self, tools: list[ToolDefinition] | None = None) -> None:
        super().__init__()
        self._buf = ""
        """Text received but not yet settled (a held-back tag prefix, whitespace, or a call body)."""
        self._phase = _CONTENT
        self._skip_ws = False
        """Just after a closing tag: the whitespace that follows it separates, it is not content."""
        self._ws_before_tag = ""
        """Whitespace dropped before an opening tag; given back if the call turns out malformed."""
        self._end_search_from = 0
        """In a call body, where the closing-tag search resumes (keeps long bodies linear)."""
        self._scanner = JsonValueScanner()

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
        buf = self._unskipped()
        if buf is None:
            return False
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
        settled = buf[: len(buf) - partial_suffix(buf, TOOL_CALL_START)].rstrip()
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
            self._scanner = JsonValueScanner()
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
            segment = buf[: len(buf) - partial_suffix(buf, TOOL_CALL_END)]
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
        keep = max(partial_suffix(buf, TOOL_CALL_END), partial_suffix(buf, TOOL_CALL_START))
        self._buf = buf[len(buf) - keep:] if keep else ""
        return False
