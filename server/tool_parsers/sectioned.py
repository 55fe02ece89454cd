"""Tool calls written as a section of marked calls, each a header (the function's name) then JSON arguments:
DeepSeek-V3's, DeepSeek-V3.1's and Kimi-K2's formats (vLLM's ``deepseek_v3``, ``deepseek_v31`` and ``kimi_k2``
parsers).

    DeepSeek-V3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                 <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    V3.1         <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    Kimi-K2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
                 <|tool_call_end|>...<|tool_calls_section_end|>

`SectionedToolParser` is one incremental state machine for all three, set by class attributes. Text outside the section
is content. A call is committed once its header is complete (its header delta goes out), then the arguments stream
as the model writes them: an object's text up to the brace that closes it (the JSON scanner), anything else whole
once the call's end marker arrives. A call whose header cannot be read goes to the client as content, markers
included; a call that starts without its section's opening marker is read all the same.
"""

from __future__ import annotations

import re

from flotilla.server.protocol_types import ToolDefinition
from flotilla.server.tool_parsers.base import (
    CallsOutput,
    JsonValueScanner,
    first_of,
    held_back,
)

_CONTENT, _SECTION, _HEAD, _ARGS, _TAIL = range(5)


class SectionedToolParser(CallsOutput):
    """Incremental parser of a section of marked calls (see module doc); subclasses name the markers."""

    SECTION_START = ""
    SECTION_END = ""
    CALL_START = ""
    CALL_END = ""
    ARGS_ENDS: tuple[str, ...] = ()
    """What may end a call's arguments, the earliest found first (CALL_END among them)."""
    HEADER: re.Pattern[str]
    """Matches a complete header at the start of a call's body; groups ``name`` and optionally ``id``."""

    def __init__(self, tools: list[ToolDefinition] | None = None) -> None:
        super().__init__()
        self._buf = ""
        """Text received but not settled yet (a held-back marker prefix, whitespace, or a call's unread part)."""
        self._phase = _CONTENT
        self._in_section = False
        """A call ends back in the section (more calls may follow) rather than in the content."""
        self._skip_ws = False
        """Just after a section: the whitespace that follows it separates, it is not content."""
        self._ws_before = ""
        """Whitespace dropped before a marker; given back if the call after it turns out unreadable."""
        self._scanner: JsonValueScanner | None = None
        """The arguments' scanner once they start with an object (None: not started, or read whole)."""
        self._raw_args = False
        self._openers = (self.SECTION_START, self.CALL_START)
        self._args_or_start = (*self.ARGS_ENDS, self.CALL_START)

    def _run(self, final: bool) -> None:
        steps = (self._step_content, self._step_section, self._step_head, self._step_args, self._step_tail)
        while steps[self._phase](final):
            pass

    # ---- phases: each returns whether it changed phase (and the machine should run again) -------------------------

    def _step_content(self, final: bool) -> bool:
        buf = self._unskipped()
        if buf is None:
            return False
        i, tag = first_of(buf, self._openers)
        if tag is not None:
            text = buf[:i].rstrip()
            self._emit_content(text)
            self._ws_before = buf[len(text):i]
            self._buf = buf[i + len(tag):]
            self._in_section = tag == self.SECTION_START
            self._phase = _SECTION if self._in_section else _HEAD
            return True
        if final:
            self._emit_content(buf)
            self._buf = ""
            return False
        settled = buf[: len(buf) - held_back(buf, self._openers)].rstrip()
        self._emit_content(settled)
        self._buf = buf[len(settled):]
        return False

    def _step_section(self, final: bool) -> bool:
        """Between calls: the next call, the section's end, or (anything else) text after a section left open."""
        buf = self._buf.lstrip()
        for tag, phase in ((self.CALL_START, _HEAD), (self.SECTION_END, _CONTENT)):
            if buf.startswith(tag):
                self._buf, self._phase = buf[len(tag):], phase
                self._skip_ws = phase == _CONTENT
                return True
        if not final and (self.CALL_START.startswith(buf) or self.SECTION_END.startswith(buf)):
            self._buf = buf  # whitespace between calls, or the start of a marker
            return False
        self._buf, self._phase = buf, _CONTENT
        return True

    def _after_call(self, rest: str) -> None:
        self._buf = rest
        self._phase = _SECTION if self._in_section else _CONTENT
        self._skip_ws = not self._in_section

    def _step_head(self, final: bool) -> bool:
        buf = self._buf
        end = buf.find(self.CALL_END)
        m = self.HEADER.match(buf if end < 0 else buf[:end])
        name = self._name(m) if m is not None else None
        if name is not None:
            self._open_call(name, self._call_id(m))
            self._ws_before = ""
            self._buf = buf[m.end():]
            self._scanner, self._raw_args = None, False
            self._phase = _ARGS
            return True
        if end >= 0:  # a call that cannot be read: the client gets what the model wrote
            self._emit_content(self._ws_before + self.CALL_START + buf[: end + len(self.CALL_END)])
            self._ws_before = ""
            self._after_call(buf[end + len(self.CALL_END):])
            return True
        if final:
            self._emit_content(self._ws_before + self.CALL_START + buf)
            self._buf = ""
        return False

    def _name(self, m: re.Match[str]) -> str | None:
        return m["name"].strip() or None

    def _call_id(self, m: re.Match[str]) -> str | None:
        return None

    def _step_args(self, final: bool) -> bool:
        buf = self._buf
        if self._scanner is None and not self._raw_args:
            stripped = buf.lstrip()
            if not stripped and not final:
                self._buf = ""
                return False
            if stripped.startswith("{"):
                self._scanner, buf = JsonValueScanner(), stripped
            else:
                self._raw_args = True
        end, _ = first_of(buf, self.ARGS_ENDS)
        if self._raw_args:  # not an object: the arguments are the whole text up to the end marker
            if end < 0 and not final:
                self._buf = buf
                return False
            self._emit_args(buf[:end].strip() if end >= 0 else buf.strip())
            return self._args_done(buf[end:] if end >= 0 else "")
        if end >= 0:
            segment = buf[:end]
        elif final:
            segment = buf
        else:
            segment = buf[: len(buf) - held_back(buf, self.ARGS_ENDS)]
        used = self._scanner.feed(segment)
        self._emit_args(segment[:used])
        if self._scanner.done or end >= 0:  # (an end marker before the closing brace: keep what the model wrote)
            return self._args_done(buf[used:] if self._scanner.done else buf[end:])
        self._buf = buf[used:]
        return False

    def _args_done(self, rest: str) -> bool:
        if not self._calls[-1].parts:
            self._emit_args("{}")
        self._buf, self._phase = rest, _TAIL
        return True

    def _step_tail(self, final: bool) -> bool:
        """After the arguments: skip to the call's end marker (or a next call's start, a missing end marker)."""
        buf = self._buf
        i, tag = first_of(buf, (self.CALL_END, self.CALL_START))
        if tag == self.CALL_END:
            self._after_call(buf[i + len(tag):])
            return True
        if tag == self.CALL_START:
            self._buf, self._phase = buf[i + len(tag):], _HEAD
            return True
        keep = 0 if final else held_back(buf, (self.CALL_END, self.CALL_START))
        self._buf = buf[len(buf) - keep:] if keep else ""
        return False


class DeepSeekV3ToolParser(SectionedToolParser):
    """DeepSeek-V3 / R1-0528: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments in a json fence."""

    SECTION_START = "<｜tool▁calls▁begin｜>"
    SECTION_END = "<｜tool▁calls▁end｜>"
    CALL_START = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    ARGS_ENDS = ("\n```" + CALL_END, "```" + CALL_END, CALL_END)
    HEADER = re.compile(r"\s*[^<\n]*<｜tool▁sep｜>(?P<name>[^\n<]+?)[ \t]*\n\s*```(?:json)?[ \t]*\n")
    TAGS = (SECTION_START, SECTION_END, CALL_START, CALL_END, "<｜tool▁sep｜>")


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek-V3.1 / V3.2-Exp: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>`` then the arguments, no fence."""

    ARGS_ENDS = (DeepSeekV3ToolParser.CALL_END,)
    HEADER = re.compile(r"\s*(?P<name>[^<\n]+?)\s*<｜tool▁sep｜>")


class KimiK2ToolParser(SectionedToolParser):
    """Kimi-K2: ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>`` then the arguments; the call's
    id is the model's ``functions.NAME:INDEX`` (Kimi's chat template writes it back so in the next turn)."""

    SECTION_START = "<|tool_calls_section_begin|>"
    SECTION_END = "<|tool_calls_section_end|>"
    CALL_START = "<|tool_call_begin|>"
    CALL_END = "<|tool_call_end|>"
    ARGS_ENDS = (CALL_END,)
    HEADER = re.compile(r"\s*(?P<id>(?:functions\.)?(?P<name>[^\s<:]+):\d+)\s*<\|tool_call_argument_begin\|>")
    TAGS = (SECTION_START, SECTION_END, CALL_START, CALL_END, "<|tool_call_argument_begin|>")

    def _call_id(self, m: re.Match[str]) -> str | None:
        return m["id"]
