"""OpenAI protocol, output side: chat.completion / text_completion bodies and their SSE streams.

Pure code. The front end creates one builder per request and feeds it the engine's `SeqText` deltas,
each with the index of the choice it belongs to (``index`` = the position of the sequence among the
request's choices: ``prompt_index * n + i`` for completions, ``i`` for chat):

    stream:      state = ChatStreamState(req, request_id=..., model=..., token_texts=...)
                 for each delta:   yield state.on_delta(index, delta)    # bytes, maybe b""
                 at the end:       yield state.finish()                  # usage chunk + data: [DONE]
                 on a failure:     yield state.error(status, message)    # error event + data: [DONE]
    non-stream:  builder = ChatCompletionBuilder(req, ...); builder.on_delta(index, delta) ...;
                 body = builder.body()                                   # JSON bytes

Every chunk is pre-framed: the id / object / created / model prefix of a chunk is encoded once per
request, so a delta costs one small msgspec encode of its choice. Streams follow OpenAI: the first
chunk of a choice carries ``delta.role = "assistant"`` with empty content, content chunks follow, the
choice ends with an empty delta and its finish_reason; with ``stream_options.include_usage`` every
chunk has ``"usage": null`` and a last chunk with no choices carries the usage.

A choice the engine aborted (finish_reason "abort", which OpenAI has no word for) ends a stream with
an error event (503) and makes a non-streaming body raise ProtocolError(503): a client must not take a
cut-off answer for a complete one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from flotilla import __version__
from flotilla.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    error_body,
    tool_parsing_enabled,
)
from flotilla.server.protocol_logprobs import (
    TokenText,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from flotilla.server.reasoning_parser import ReasoningParser
from flotilla.server.tool_parsers import HermesToolParser, ToolCallDelta, ToolCallParser, parse_tool_calls
from flotilla.transport.messages import PromptLogprobs, SeqText

SSE_DONE = b"data: [DONE]\n\n"
"""The last event of every stream."""
SYSTEM_FINGERPRINT = f"fp_flotilla_{__version__}"
"""What OpenAI's system_fingerprint names: the backend configuration (here, the engine's version)."""

_encode = msgspec.json.Encoder().encode
FINISH_REASONS = {"stop": "stop", "length": "length"}
"""Engine finish reasons OpenAI knows; any other ("abort") means the engine dropped the request."""
_ABORTED = "The request was aborted by the engine before it finished."


def sse_line(obj: Any) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return b"data: " + _encode(obj) + b"\n\n"


def sse_error(status: int, message: str, type: str | None = None, param: str | None = None,
              code: str | None = None) -> bytes:
    """An error event in OpenAI's shape (the openai client raises APIError on it)."""
    return b"data: " + error_body(status, message, type, param, code) + b"\n\n"


def new_response_id(chat: bool) -> str:
    """``chatcmpl-<hex>`` for chat, ``cmpl-<hex>`` for completions."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


class _Choice:
    """What a response remembers about one choice."""

    __slots__ = ("cached_tokens", "finish_reason", "logprobs", "output_tokens", "parser", "prompt_tokens", "reasoner",
                 "reasoning", "started", "stop_reason", "text_offset", "texts")

    def __init__(self) -> None:
        self.started = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.parser: ToolCallParser | None = None
        self.reasoner: ReasoningParser | None = None
        self.text_offset = 0
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: Any = None

    def count(self, delta: SeqText) -> None:
        # the engine may report a running count; counting the delivered ids works without one
        self.output_tokens = max(self.output_tokens + len(delta.token_ids), delta.num_output_tokens)
        if delta.num_prompt_tokens:
            self.prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens:
            self.cached_tokens = delta.num_cached_tokens


class _Response:
    """State shared by the four builders: choices, usage, logprob formatting."""

    object_type = ""

    def __init__(self, *, request_id: str, model: str, created: int | None, num_choices: int,
                 choices_per_prompt: int, top_logprobs: int | None, token_texts: TokenTexts | TokenText | None,
                 include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.top_logprobs = top_logprobs
        """None: no logprobs; k: the sampled token's logprob plus k alternatives."""
        if top_logprobs is not None and token_texts is None:
            raise TypeError("token_texts is required when the request asks for logprobs")
        self.token_texts = token_texts if isinstance(token_texts, TokenTexts) or token_texts is None \
            else TokenTexts(token_texts)
        self.include_usage = include_usage
        self.choices = [_Choice() for _ in range(num_choices)]
        self._per_prompt = choices_per_prompt
        self.done = False
        """The stream ended (finish or error): later deltas are ignored."""

    def _envelope(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": self.object_type, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, **fields}

    def usage(self) -> dict[str, Any]:
        """Token counts; the prompt of each input is counted once however many choices share it."""
        prompt = cached = 0
        per = self._per_prompt
        for start in range(0, len(self.choices), per):
            group = self.choices[start:start + per]
            prompt += max(c.prompt_tokens for c in group)
            cached += max(c.cached_tokens for c in group)
        completion = sum(c.output_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @property
    def finished(self) -> bool:
        """Every choice has its finish_reason."""
        return all(c.finish_reason is not None for c in self.choices)

    def _accept(self, index: int, delta: SeqText) -> _Choice | None:
        choice = self.choices[index]
        if self.done or choice.finish_reason is not None:
            return None  # a late delta after the choice (or the stream) ended: nothing to say
        choice.count(delta)
        return choice

    def _chat_logprobs(self, delta: SeqText) -> list[dict[str, Any]] | None:
        return chat_logprobs(self.token_texts, self.top_logprobs or 0, delta)

    def _completion_logprobs(self, choice: _Choice, delta: SeqText) -> dict[str, list[Any]] | None:
        part, choice.text_offset = completion_logprobs(self.token_texts, self.top_logprobs or 0, delta,
                                                       choice.text_offset)
        return part

    def _echo_logprobs(self, choice: _Choice, prompt: PromptLogprobs, echo_text: str) -> dict[str, list[Any]]:
        choice.text_offset = len(echo_text)  # (the output's offsets continue after the echoed text)
        return echo_logprobs(self.token_texts, self.top_logprobs or 0, prompt)

    def _vllm_prompt_logprobs(self, prompt: PromptLogprobs) -> list[dict[str, Any] | None]:
        return vllm_prompt_logprobs(self.token_texts, prompt)


class _Stream(_Response):
    """The SSE half of a streaming builder: the pre-encoded chunk frame and the two ways a stream ends.

    A mixin placed before the endpoint class (``class ChatStreamState(_Stream, ChatChoices)``); the subclass
    calls ``_frame()`` once its base is initialised.
    """

    def _frame(self) -> None:
        head = _encode({"id": self.request_id, "object": self.object_type, "created": self.created,
                        "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT})
        self._head = b"data: " + head[:-1] + b',"choices":['
        self._tail = b'],"usage":null}\n\n' if self.include_usage else b"]}\n\n"

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return self._head + _encode(choice) + self._tail

    def finish(self) -> bytes:
        """The end of a stream: the usage chunk (if asked for) and ``data: [DONE]``."""
        if self.done:
            return b""
        self.done = True
        if not self.include_usage:
            return SSE_DONE
        return sse_line(self._envelope(choices=[], usage=self.usage())) + SSE_DONE

    def error(self, status: int, message: str, type: str | None = None, param: str | None = None,
              code: str | None = None) -> bytes:
        """End a stream that already started with an error event and ``data: [DONE]``."""
        if self.done:
            return b""
        self.done = True
        return sse_error(status, message, type, param, code) + SSE_DONE

    def _abort(self) -> bytes:
        return self.error(503, _ABORTED)


def aborted_error() -> ProtocolError:
    """503 for a request whose sequence the engine aborted (a cut-off answer must not pass for a complete one)."""
    return ProtocolError(503, _ABORTED)


def _num_prompts(req: CompletionRequest) -> int:
    prompt = req.prompt
    return 1 if isinstance(prompt, str) or not prompt or type(prompt[0]) is int else len(prompt)


# ---------------------------------------------------------------------------------------------
# Chat


class ChatChoices(_Response):
    """A chat request's choices: n of one conversation, logprobs from logprobs/top_logprobs, reasoning and tool
    parsing (each choice's text goes through its reasoning parser, then the content through its tool parser)."""

    object_type = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, *, request_id: str, model: str, created: int | None,
                 token_texts: TokenTexts | TokenText | None,
                 tool_parser: Callable[[], ToolCallParser] | None,
                 reasoning_parser: Callable[[], ReasoningParser] | None) -> None:
        n = req.n or 1
        super().__init__(request_id=request_id, model=model, created=created, num_choices=n, choices_per_prompt=n,
                         top_logprobs=(req.top_logprobs or 0) if req.logprobs else None, token_texts=token_texts,
                         include_usage=req.include_usage)
        self.tool_parser = tool_parser if tool_parsing_enabled(req) else None
        self.reasoning_parser = reasoning_parser
        for c in self.choices:
            if self.tool_parser is not None:
                c.parser = self.tool_parser()
            if reasoning_parser is not None:
                c.reasoner = reasoning_parser()

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.reasoning_parser is not None:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(c.reasoner.reasoning_tokens for c in self.choices if c.reasoner is not None)}
        return usage


def _chat_finish_reason(reason: str, called_tools: bool) -> str:
    mapped = FINISH_REASONS.get(reason, "stop")
    return "tool_calls" if called_tools and mapped == "stop" else mapped


class ChatStreamState(_Stream, ChatChoices):
    """Turns one chat request's deltas into ``chat.completion.chunk`` SSE events (see module doc).

    With a reasoning parser the reasoning streams as ``delta.reasoning_content`` (and vLLM's newer name
    ``delta.reasoning``) before the content. With tools (and tool_choice not "none") each choice's content goes
    through its own tool-call parser: content outside calls streams as ``delta.content``, calls as
    ``delta.tool_calls``, and a choice that called a tool and stopped ends with finish_reason "tool_calls".
    """

    def __init__(self, req: ChatCompletionRequest, *, request_id: str, model: str, created: int | None = None,
                 token_texts: TokenTexts | TokenText | None = None,
                 tool_parser: Callable[[], ToolCallParser] | None = HermesToolParser,
                 reasoning_parser: Callable[[], ReasoningParser] | None = None) -> None:
        super().__init__(req, request_id=request_id, model=model, created=created, token_texts=token_texts,
                         tool_parser=tool_parser, reasoning_parser=reasoning_parser)
        self._frame()

    def on_delta(self, index: int, delta: SeqText) -> bytes:
        """The SSE bytes for one delta of choice ``index`` (b"" when nothing is ready to show yet)."""
        choice = self._accept(index, delta)
        if choice is None:
            return b""
        out: list[bytes] = []
        if not choice.started:
            choice.started = True
            out.append(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}))
        logprobs = self._chat_logprobs(delta) if self.top_logprobs is not None else None
        self._content_chunk(out, index, choice, delta.text, logprobs, len(delta.token_ids))
        if delta.finish_reason is not None:
            if delta.finish_reason not in FINISH_REASONS:
                return b"".join(out) + self._abort()
            self._last_chunks(out, index, choice)
            choice.finish_reason = _chat_finish_reason(
                delta.finish_reason, choice.parser is not None and bool(choice.parser.tool_calls))
            choice.stop_reason = delta.stop_reason
            out.append(self._chunk({"index": index, "delta": {}, "logprobs": None,
                                    "finish_reason": choice.finish_reason, "stop_reason": delta.stop_reason}))
        return b"".join(out)

    def _content_chunk(self, out: list[bytes], index: int, choice: _Choice, text: str,
                       logprobs: list[dict[str, Any]] | None, num_tokens: int) -> None:
        reasoning = ""
        if choice.reasoner is not None:
            reasoning, text = choice.reasoner.feed(text, num_tokens)
        tool_deltas: list[ToolCallDelta] = []
        if choice.parser is not None:
            text, tool_deltas = choice.parser.feed(text)
        self._chunk_of(out, index, reasoning, text, tool_deltas, logprobs)

    def _last_chunks(self, out: list[bytes], index: int, choice: _Choice) -> None:
        """The choice's text ended: what its parsers held back."""
        if choice.reasoner is not None:
            reasoning, text = choice.reasoner.finish()
            tool_deltas: list[ToolCallDelta] = []
            if choice.parser is not None and text:
                text, tool_deltas = choice.parser.feed(text)
            self._chunk_of(out, index, reasoning, text, tool_deltas, None)
        if choice.parser is not None:
            text, tool_deltas = choice.parser.finish()
            self._chunk_of(out, index, "", text, tool_deltas, None)

    def _chunk_of(self, out: list[bytes], index: int, reasoning: str, text: str, tool_deltas: list[ToolCallDelta],
                  logprobs: list[dict[str, Any]] | None) -> None:
        if not (reasoning or text or tool_deltas or logprobs):
            return
        d: dict[str, Any] = {}
        if reasoning:
            d["reasoning_content"] = d["reasoning"] = reasoning
        if text:
            d["content"] = text
        if tool_deltas:
            d["tool_calls"] = [t.to_openai() for t in tool_deltas]
        out.append(self._chunk({"index": index, "delta": d,
                                "logprobs": None if logprobs is None else {"content": logprobs},
                                "finish_reason": None}))


class ChatCompletionBuilder(ChatChoices):
    """Collects one chat request's deltas into a ``chat.completion`` body (non-streaming)."""

    object_type = "chat.completion"

    def __init__(self, req: ChatCompletionRequest, *, request_id: str, model: str, created: int | None = None,
                 token_texts: TokenTexts | TokenText | None = None,
                 tool_parser: Callable[[], ToolCallParser] | None = HermesToolParser,
                 reasoning_parser: Callable[[], ReasoningParser] | None = None) -> None:
        super().__init__(req, request_id=request_id, model=model, created=created, token_texts=token_texts,
                         tool_parser=tool_parser, reasoning_parser=reasoning_parser)
        if self.top_logprobs is not None:
            for c in self.choices:
                c.logprobs = []
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        """vLLM's prompt_logprobs, when asked (every choice has the same prompt: the first to arrive)."""

    def on_delta(self, index: int, delta: SeqText) -> None:
        choice = self._accept(index, delta)
        if choice is None:
            return
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = self._vllm_prompt_logprobs(delta.prompt_logprobs)
        text = delta.text
        if choice.reasoner is not None:  # fed delta by delta, so the body says what a stream would say
            reasoning, text = choice.reasoner.feed(text, len(delta.token_ids))
            if reasoning:
                choice.reasoning.append(reasoning)
        if text:
            choice.texts.append(text)
        if self.top_logprobs is not None:
            entries = self._chat_logprobs(delta)
            if entries:
                choice.logprobs.extend(entries)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason

    def response(self) -> dict[str, Any]:
        """The chat.completion object; raises ProtocolError (503) if the engine aborted a choice."""
        choices = []
        for index, c in enumerate(self.choices):
            if c.finish_reason is not None and c.finish_reason not in FINISH_REASONS:
                raise aborted_error()
            message: dict[str, Any] = {"role": "assistant"}
            if c.reasoner is not None:
                reasoning, text = c.reasoner.finish()
                c.reasoning.append(reasoning)
                c.texts.append(text)
                message["reasoning_content"] = message["reasoning"] = "".join(c.reasoning) or None
            text = "".join(c.texts)
            message["content"] = text if c.reasoner is None else text or None
            message["refusal"] = None
            calls = []
            if self.tool_parser is not None:
                content, calls = parse_tool_calls(text, self.tool_parser)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
            choices.append({
                "index": index,
                "message": message,
                "logprobs": None if c.logprobs is None else {"content": c.logprobs},
                "finish_reason": _chat_finish_reason(c.finish_reason or "stop", bool(calls)),
                "stop_reason": c.stop_reason,
            })
        extra = {} if self.prompt_logprobs is None else {"prompt_logprobs": self.prompt_logprobs}
        return self._envelope(choices=choices, usage=self.usage(), **extra)

    def body(self) -> bytes:
        return _encode(self.response())


# ---------------------------------------------------------------------------------------------
# Completions


class _Completion(_Response):
    """A completions request's choices: n per prompt, prompts in order (choice k is prompt k // n)."""

    object_type = "text_completion"

    def __init__(self, req: CompletionRequest, *, request_id: str, model: str, created: int | None,
                 token_texts: TokenTexts | TokenText | None, echo_texts: list[str] | None) -> None:
        n = req.n or 1
        super().__init__(request_id=request_id, model=model, created=created, num_choices=n * _num_prompts(req),
                         choices_per_prompt=n, top_logprobs=req.logprobs, token_texts=token_texts,
                         include_usage=req.include_usage)
        self.echo_texts = echo_texts if req.echo else None
        """echo: each prompt's text, put before its choices' text (the prompt's logprobs before theirs)."""
        self.vllm_prompt_logprobs = req.prompt_logprobs is not None

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self._per_prompt]  # type: ignore[index]


class CompletionStreamState(_Stream, _Completion):
    """Turns one completions request's deltas into ``text_completion`` SSE events (see module doc)."""

    def __init__(self, req: CompletionRequest, *, request_id: str, model: str, created: int | None = None,
                 token_texts: TokenTexts | TokenText | None = None, echo_texts: list[str] | None = None) -> None:
        super().__init__(req, request_id=request_id, model=model, created=created, token_texts=token_texts,
                         echo_texts=echo_texts)
        self._frame()

    def on_delta(self, index: int, delta: SeqText) -> bytes:
        """The SSE bytes for one delta of choice ``index`` (b"" when there is nothing to show)."""
        choice = self._accept(index, delta)
        if choice is None:
            return b""
        out: list[bytes] = []
        if not choice.started:
            choice.started = True
            if self.echo_texts is not None:  # the echoed prompt is its own first chunk
                echo = self._echo(index)
                logprobs = None if self.top_logprobs is None or delta.prompt_logprobs is None else \
                    self._echo_logprobs(choice, delta.prompt_logprobs, echo)
                out.append(self._chunk({"index": index, "text": echo, "logprobs": logprobs, "finish_reason": None}))
        logprobs = self._completion_logprobs(choice, delta) if self.top_logprobs is not None else None
        # A delta with new tokens is a chunk even when they show no text yet (a token id-only engine, a partial
        # UTF-8 character): a streaming client then sees every step, as from vLLM, whose completions stream
        # skips only deltas without tokens.
        if delta.text or logprobs or delta.token_ids:
            out.append(self._chunk({"index": index, "text": delta.text, "logprobs": logprobs,
                                    "finish_reason": None}))
        if delta.finish_reason is not None:
            if delta.finish_reason not in FINISH_REASONS:
                return b"".join(out) + self._abort()
            choice.finish_reason = FINISH_REASONS[delta.finish_reason]
            choice.stop_reason = delta.stop_reason
            out.append(self._chunk({"index": index, "text": "", "logprobs": None,
                                    "finish_reason": choice.finish_reason, "stop_reason": delta.stop_reason}))
        return b"".join(out)


class CompletionBuilder(_Completion):
    """Collects one completions request's deltas into a ``text_completion`` body (non-streaming)."""

    def __init__(self, req: CompletionRequest, *, request_id: str, model: str, created: int | None = None,
                 token_texts: TokenTexts | TokenText | None = None, echo_texts: list[str] | None = None) -> None:
        super().__init__(req, request_id=request_id, model=model, created=created, token_texts=token_texts,
                         echo_texts=echo_texts)
        for index, c in enumerate(self.choices):
            if self.top_logprobs is not None:
                c.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if self.echo_texts is not None:
                c.texts.append(self._echo(index))
        self.prompt_logprobs: list[Any] = [None] * len(self.choices)
        """vLLM's prompt_logprobs per choice, when asked."""

    def on_delta(self, index: int, delta: SeqText) -> None:
        choice = self._accept(index, delta)
        if choice is None:
            return
        if delta.prompt_logprobs is not None:
            if self.vllm_prompt_logprobs:
                self.prompt_logprobs[index] = self._vllm_prompt_logprobs(delta.prompt_logprobs)
            if self.echo_texts is not None and self.top_logprobs is not None:
                for key, values in self._echo_logprobs(choice, delta.prompt_logprobs, self._echo(index)).items():
                    choice.logprobs[key][:0] = values
        if delta.text:
            choice.texts.append(delta.text)
        if self.top_logprobs is not None:
            part = self._completion_logprobs(choice, delta)
            if part is not None:
                for key, values in part.items():
                    choice.logprobs[key].extend(values)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason

    def response(self) -> dict[str, Any]:
        """The text_completion object; raises ProtocolError (503) if the engine aborted a choice."""
        choices = []
        for index, c in enumerate(self.choices):
            if c.finish_reason is not None and c.finish_reason not in FINISH_REASONS:
                raise aborted_error()
            choices.append({"index": index, "text": "".join(c.texts), "logprobs": c.logprobs,
                            "finish_reason": FINISH_REASONS.get(c.finish_reason or "stop", "stop"),
                            "stop_reason": c.stop_reason})
            if self.vllm_prompt_logprobs:
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs[index]
        return self._envelope(choices=choices, usage=self.usage())

    def body(self) -> bytes:
        return _encode(self.response())
