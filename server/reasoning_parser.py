"""Reasoning parsing: the ``<think>...</think>`` part of a reasoning model's output becomes ``reasoning_content``,
the rest ``content`` (vLLM's --reasoning-parser, its ``qwen3`` and ``deepseek_r1`` names).

A parser is fed one choice's text deltas and returns, for each, the reasoning and the content to show; the tags
themselves never reach the client, and a tag split across deltas is held back until it is whole. Tool-call parsing
and the answer's content apply to the content only. The two styles differ in how the output starts:

- ``qwen3``: reasoning only when the output opens with ``<think>`` (after whitespace); otherwise it is all content.
- ``deepseek_r1``: the chat template may open ``<think>`` in the prompt, so the output starts in the reasoning
  (a ``<think>`` the model writes anyway is dropped) and the first ``</think>`` ends it; an output without one is
  all reasoning (it was cut off, as vLLM reads it).

The whitespace just inside the tags and just after ``</think>`` only separates, and is dropped (as SGLang does).
A request whose ``chat_template_kwargs`` turn thinking off (``enable_thinking`` or ``thinking`` false) gets no
reasoning parsing; a grammar on the output holds only what follows ``</think>`` (server/app.py, actors/grammar.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from flotilla.server.tool_parsers.base import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"

_OPENING, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """Splits one choice's output into reasoning and content as it streams (see module doc)."""

    STARTS_IN_REASONING: ClassVar[bool] = False
    """Whether output without an opening tag is reasoning (the template opened it in the prompt)."""
    TAGS: ClassVar[tuple[str, ...]] = (THINK_START, THINK_END)

    def __init__(self) -> None:
        self._buf = ""
        """Text not settled yet: the output's start while the opening tag may still come, a held-back tag prefix, or
        whitespace that may turn out to precede the closing tag."""
        self._phase = _OPENING
        self._skip_ws = False
        """Just after a tag: the whitespace that follows it separates, it is neither reasoning nor content."""
        self.reasoning_tokens = 0
        """Output tokens counted as reasoning (a delta's tokens count whole, by the phase it starts or ends in)."""
        self._pending_tokens = 0
        self._reasoned = False

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """Consume a text delta of ``num_tokens`` tokens; return (reasoning, content) to show now."""
        before = self._phase
        self._buf += text
        out = self._run(final=False)
        if self._phase == _OPENING:
            self._pending_tokens += num_tokens  # (reasoning or content: the opening tag decides)
        else:
            if before == _REASONING or (before == _OPENING and self._reasoned):
                self.reasoning_tokens += num_tokens + self._pending_tokens
            self._pending_tokens = 0
        return out

    def finish(self) -> tuple[str, str]:
        """The output ended: release what is held back."""
        if self._phase == _OPENING and self.STARTS_IN_REASONING:
            self.reasoning_tokens += self._pending_tokens
        self._pending_tokens = 0
        return self._run(final=True)

    @property
    def reasoned(self) -> bool:
        """Whether the output had a reasoning part."""
        return self._reasoned

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._phase == _OPENING:
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_START):
                self._buf, self._phase, self._skip_ws = stripped[len(THINK_START):], _REASONING, True
            elif not final and THINK_START.startswith(stripped):
                return "", ""  # nothing yet, or the start of the opening tag
            elif self.STARTS_IN_REASONING:
                self._buf, self._phase = stripped, _REASONING
            else:
                self._phase = _CONTENT
        if self._phase == _REASONING:
            self._reasoned = True
            buf = self._buf.lstrip() if self._skip_ws else self._buf
            if self._skip_ws and not buf and not final:
                self._buf = ""
                return "", ""
            self._skip_ws = False
            end = buf.find(THINK_END)
            if end >= 0:
                reasoning = buf[:end].rstrip()
                self._buf, self._phase, self._skip_ws = buf[end + len(THINK_END):], _CONTENT, True
            elif final:
                reasoning, self._buf = buf.rstrip(), ""
            else:  # hold back what may start the closing tag, and the whitespace that may come before it
                reasoning = buf[: len(buf) - partial_suffix(buf, THINK_END)].rstrip()
                self._buf = buf[len(reasoning):]
        if self._phase == _CONTENT:
            content = self._buf.lstrip() if self._skip_ws else self._buf
            if content:
                self._skip_ws = False
            self._buf = ""
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only inside a ``<think>`` block the output opens with."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and templates that open ``<think>`` in the prompt): reasoning until ``</think>``."""

    STARTS_IN_REASONING = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}
"""Reasoning styles by vLLM's --reasoning-parser names."""


def thinking_disabled(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request's template variables turn thinking off (Qwen3's enable_thinking, DeepSeek's thinking)."""
    kwargs = chat_template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def split_reasoning(text: str, parser: Callable[[], ReasoningParser]) -> tuple[str | None, str]:
    """(reasoning, or None when there is none; content) of a whole output: the streaming parser run over it."""
    p = parser()
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2) or None, c1 + c2
