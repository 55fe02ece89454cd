"""OpenAI's Responses API (POST /v1/responses), served by the chat path.

A body decodes into `ResponsesRequest`; `to_chat_request` turns it into the ChatCompletionRequest that means the same
(instructions as a first system turn, input items as chat turns, flat function tools as chat tools, text.format as
response_format), so the chat template, tool-call parsing, structured outputs and usage are the chat endpoint's.
`ResponseState` turns the engine's deltas into output items and Responses stream events; `ResponsesStream` frames
the events as SSE and `ResponsesBuilder` returns the final Response object, the two shapes server/app.py drives.

The server keeps no responses: `previous_response_id`, `conversation` and the routes that read a stored response
answer 400; `store` is accepted and every response says ``"store": false``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from flotilla.server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    DeveloperMessage,
    FunctionCallParam,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ProtocolError,
    ResponseFormat,
    SystemMessage,
    ToolCallParam,
    ToolDefinition,
    ToolMessage,
    UserMessage,
    check_chat_request,
    decode_body,
    note_unknown_fields,
)
from flotilla.server.protocol_output import FINISH_REASONS, ChatChoices, aborted_error
from flotilla.server.protocol_types import JSONSchemaFormat
from flotilla.server.tool_parsers import ToolCallDelta, ToolCallParser
from flotilla.transport.messages import SeqText

_encode = msgspec.json.Encoder().encode

MAX_METADATA_PAIRS = 16
"""OpenAI's bounds on ``metadata``: pairs, key length, value length."""
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


# ---------------------------------------------------------------------------------------------
# Request schema


class _Struct(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Request-side struct: unknown fields ignored (clients send extras), unset fields left out on dump."""


class InputPart(_Struct, kw_only=True):
    """One part of an input item's content; only text is served."""

    type: str
    """"input_text" / "output_text" (also chat's "text", and "refusal" in assistant turns); media are a 400."""
    text: str | None = None
    refusal: str | None = None


InputContent = str | list[InputPart]


class InputItem(_Struct, kw_only=True):
    """One item of ``input``: a message (the type when none is given), a function_call the model made earlier, or the
    function_call_output that answers it; the fields of the other kinds stay None."""

    type: str | None = None
    role: str | None = None
    """A message's "user" | "system" | "developer" | "assistant"."""
    content: InputContent | None = None
    call_id: str | None = None
    """The call a function_call names and its function_call_output repeats."""
    name: str | None = None
    arguments: str | None = None
    """A function_call's arguments as a JSON string."""
    output: InputContent | None = None
    """A function_call_output's result."""


class FunctionTool(_Struct, kw_only=True):
    """A tool in the Responses' flat shape: name, description, parameters and strict beside the type."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool | None = None


class ToolChoiceObject(_Struct, kw_only=True):
    """``{"type": "function", "name": ...}``: call this function."""

    type: str
    name: str | None = None


class TextFormat(_Struct, kw_only=True):
    """``text.format``: "text", "json_object", or "json_schema" with the schema beside the type."""

    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(_Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(_Struct, kw_only=True):
    """POST /v1/responses."""

    input: str | list[InputItem]
    model: str | None = None
    """Served model name; None means the server's (only) model."""
    instructions: str | None = None
    """A system message placed before the input."""
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    """Echoed in the response."""
    user: str | None = None
    stream: bool | None = None
    store: bool | None = None
    """Accepted; nothing is stored."""
    previous_response_id: str | None = None
    """Refused: the server keeps no responses."""
    conversation: Any | None = None
    """Refused: the server keeps no conversations."""
    background: bool | None = None
    """Refused when true: a background response would have to be stored."""
    top_logprobs: int | None = None
    """Refused when above 0: Responses logprobs are not served."""


_decoder = msgspec.json.Decoder(ResponsesRequest)


def _bad(param: str | None, message: str, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(400, message, param=param, code=code)


def _missing(param: str) -> ProtocolError:
    return _bad(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")


def _unsupported_value(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, message, param=param, code="unsupported_value")


def _stateless(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, f"{message}: this server keeps no responses (it is stateless); send the whole "
                              "conversation in 'input'.", param=param, code="unsupported_parameter")


def no_stored_responses(response_id: str) -> ProtocolError:
    """The answer to a route that reads or changes a stored response."""
    return ProtocolError(400, f"Response '{response_id}' cannot be retrieved, listed, cancelled or deleted: this "
                              "server keeps no responses (it is stateless).", code="unsupported_parameter")


def parse_responses_request(body: bytes | bytearray | memoryview | str) -> ResponsesRequest:
    """Decode and validate a Responses body; raises ProtocolError (400) naming the bad field."""
    req: ResponsesRequest = decode_body(_decoder, body)
    if req.previous_response_id is not None:
        raise ProtocolError(400, f"Previous response with id '{req.previous_response_id}' not found: this server keeps "
                                 "no responses (it is stateless); send the whole conversation in 'input'.",
                            param="previous_response_id", code="previous_response_not_found")
    if req.conversation is not None:
        raise _stateless("conversation", "Unsupported parameter: 'conversation'")
    if req.background:
        raise _stateless("background", "Unsupported parameter: 'background'")
    if req.top_logprobs:
        raise ProtocolError(400, "Unsupported parameter: 'top_logprobs' is not supported by this server.",
                            param="top_logprobs", code="unsupported_parameter")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise _bad("max_output_tokens", f"Invalid 'max_output_tokens': {req.max_output_tokens}; expected a value >= 1.")
    _check_metadata(req.metadata)
    note_unknown_fields(body, ResponsesRequest)
    return req


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise _bad("metadata", f"Invalid 'metadata': {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise _bad("metadata", f"Invalid 'metadata': keys are at most {MAX_METADATA_KEY} characters and values "
                                   f"at most {MAX_METADATA_VALUE}.")


# ---------------------------------------------------------------------------------------------
# Onto the chat path


_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio", "image_url", "image", "file"})
_ROLES: dict[str, type] = {"user": UserMessage, "system": SystemMessage, "developer": DeveloperMessage,
                           "assistant": AssistantMessage}


def _text(content: InputContent, where: str, *, assistant: bool) -> str:
    """The text of a content string or part list (parts joined with newlines, as chat_messages joins them)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if part.type in _TEXT_PARTS or (assistant and part.type == "refusal"):
            field = "refusal" if part.type == "refusal" else "text"
            value = getattr(part, field)
            if value is None:
                raise _missing(f"{at}.{field}")
            texts.append(value)
        elif part.type in _MEDIA_PARTS:
            raise _unsupported_value(f"{at}.type", f"Invalid '{at}.type': '{part.type}' content is not supported by "
                                                   "this server; send text parts only.")
        else:
            raise _bad(f"{at}.type", f"Invalid '{at}.type': unknown content part type '{part.type}'.")
    return "\n".join(texts)


def _chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = [SystemMessage(content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return [*out, UserMessage(content=req.input)]
    if not req.input:
        raise _bad("input", "Invalid 'input': empty array. Expected an array with minimum length 1.", "empty_array")
    for i, item in enumerate(req.input):
        where, kind = f"input[{i}]", item.type or "message"
        if kind == "message":
            if item.role is None:
                raise _missing(f"{where}.role")
            cls = _ROLES.get(item.role)
            if cls is None:
                raise _bad(f"{where}.role", f"Invalid '{where}.role': '{item.role}'; expected 'user', 'system', "
                                            "'developer' or 'assistant'.")
            if item.content is None:
                raise _missing(f"{where}.content")
            out.append(cls(content=_text(item.content, f"{where}.content", assistant=cls is AssistantMessage)))
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise _missing(f"{where}.{field}")
            call = ToolCallParam(id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments))
            if out and isinstance(out[-1], AssistantMessage):  # the calls of one turn go in one assistant message
                out[-1].tool_calls = [*(out[-1].tool_calls or ()), call]
            else:
                out.append(AssistantMessage(tool_calls=[call]))
        elif kind == "function_call_output":
            for field in ("call_id", "output"):
                if getattr(item, field) is None:
                    raise _missing(f"{where}.{field}")
            out.append(ToolMessage(content=_text(item.output, f"{where}.output", assistant=False),
                                   tool_call_id=item.call_id))
        else:
            raise _unsupported_value(f"{where}.type", f"Invalid '{where}.type': '{kind}' items are not supported by "
                                                      "this server; send message, function_call and "
                                                      "function_call_output items.")
    return out


def _chat_tools(req: ResponsesRequest) -> list[ToolDefinition] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise _unsupported_value(f"tools[{i}].type", f"Invalid 'tools[{i}].type': '{tool.type}' tools are not "
                                                         "supported by this server; only 'function' tools are.")
        if not tool.name:
            raise _missing(f"tools[{i}].name")
        tools.append(ToolDefinition(function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
    return tools


def _chat_tool_choice(req: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceObject):
        if choice.type != "function":
            raise _unsupported_value("tool_choice.type", f"Invalid 'tool_choice.type': '{choice.type}'; this server "
                                                         "serves only function tools.")
        if not choice.name:
            raise _missing("tool_choice.name")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    if choice in ("auto", "none") and not req.tools:
        return None  # (the model has nothing to choose from: both mean no tools)
    return choice


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise _missing("text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))
    raise _unsupported_value("text.format.type", f"Invalid 'text.format.type': '{fmt.type}'; expected 'text', "
                                                 "'json_object' or 'json_schema'.")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks for what the Responses request asks for; ProtocolError (400) naming the Responses
    field otherwise."""
    chat = ChatCompletionRequest(
        messages=_chat_messages(req), model=req.model, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=_chat_tools(req), tool_choice=_chat_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req), user=req.user,
        stream=req.stream)
    try:
        check_chat_request(chat)
    except ProtocolError as e:
        raise responses_error(e) from None
    return chat


_RENAMED = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"))
_TOOL_FUNCTION = re.compile(r"^tools\[(\d+)\]\.function\.")


def responses_param(param: str | None) -> str | None:
    """The Responses name of a chat request's parameter (``messages[3].content`` -> ``input``)."""
    if param is None:
        return None
    if param == "messages" or param.startswith(("messages.", "messages[")):
        return "input"  # (turn indices differ from input indices: instructions and merged calls)
    param = _TOOL_FUNCTION.sub(r"tools[\1].", param)
    for chat, ours in _RENAMED:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return ours + param[len(chat):]
    return param


def responses_error(e: ProtocolError) -> ProtocolError:
    """A ProtocolError about a chat parameter, told in the Responses' names."""
    message = e.message
    for chat, ours in _RENAMED:
        message = message.replace(chat, ours)
    return ProtocolError(e.status, message, param=responses_param(e.param), type=e.type, code=e.code)


# ---------------------------------------------------------------------------------------------
# Output


def new_responses_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _error_code(status: int) -> str:
    """ResponseError.code for a failure with this HTTP status."""
    return "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid_prompt"


class ResponseState(ChatChoices):
    """One Responses request's output, built from its one sequence's deltas: the output items (a message, function
    calls) and the stream events that build them, in OpenAI's order and with its sequence numbers.

    One item is open at a time: text opens a message item, a tool call's header a function_call item, and each
    closes when the next opens or the sequence ends. `on_delta` returns the events of a delta; the last delta adds
    the terminal event (response.completed, or response.incomplete when cut by length); `fail` ends it with an
    error event and response.failed.
    """

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, *, response_id: str, model: str,
                 tool_parser: Callable[[], ToolCallParser] | None, created: int | None = None) -> None:
        super().__init__(chat, request_id=response_id, model=model, created=created, token_texts=None,
                         tool_parser=tool_parser, reasoning_parser=None)
        self.req = req
        self.parser = self.tool_parser() if self.tool_parser is not None else None
        self.status = "in_progress"
        self.incomplete_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.aborted = False
        """The engine dropped the sequence: no answer may pass for a complete one."""
        self.output: list[dict[str, Any]] = []
        self._parts: list[list[str]] = []
        """Per output item: its text (a message) or its argument fragments (a function call)."""
        self._open: int | None = None
        self._call_items: dict[int, int] = {}
        """Tool call index (the parser's) -> output index."""
        self._sequence = 0
        self._started = False

    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def on_delta(self, index: int, delta: SeqText) -> list[dict[str, Any]]:
        """The events for one delta of the sequence (none once it ended)."""
        choice = self._accept(index, delta)
        if choice is None:
            return []
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [self._event("response.created", response=self.response()),
                       self._event("response.in_progress", response=self.response())]
        self._write(events, *(self.parser.feed(delta.text) if self.parser is not None else (delta.text, [])))
        if delta.finish_reason is None:
            return events
        choice.finish_reason = delta.finish_reason
        if delta.finish_reason not in FINISH_REASONS:
            self.aborted = True
            return events
        if self.parser is not None:
            self._write(events, *self.parser.finish())
        if not self.output:  # a message item even for an empty answer, as OpenAI gives
            self._open_message(events)
        cut = delta.finish_reason == "length"
        self._close(events, "incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        self.incomplete_reason = "max_output_tokens" if cut else None
        self.done = True
        events.append(self._event(f"response.{self.status}", response=self.response()))
        return events

    def fail(self, status: int, message: str) -> list[dict[str, Any]]:
        """End a started response with an error: the error event, then response.failed."""
        if self.done:
            return []
        self.done = True
        self.status = "failed"
        code = _error_code(status)
        self.error = {"code": code, "message": message}
        events: list[dict[str, Any]] = []
        self._close(events, "incomplete")
        events.append(self._event("error", code=code, message=message, param=None))
        events.append(self._event("response.failed", response=self.response()))
        return events

    def _write(self, events: list[dict[str, Any]], text: str, calls: list[ToolCallDelta]) -> None:
        if text:
            if self._open is None or self.output[self._open]["type"] != "message":
                self._close(events, "completed")
                self._open_message(events)
            self._parts[self._open].append(text)
            events.append(self._event("response.output_text.delta", item_id=self.output[self._open]["id"],
                                      output_index=self._open, content_index=0, delta=text, logprobs=[]))
        for call in calls:
            if call.id is not None:  # a new call's header
                self._close(events, "completed")
                self._open_call(events, call)
            at = self._call_items.get(call.index)
            if call.arguments and at is not None:
                self._parts[at].append(call.arguments)
                events.append(self._event("response.function_call_arguments.delta", item_id=self.output[at]["id"],
                                          output_index=at, delta=call.arguments))

    def _add(self, events: list[dict[str, Any]], item: dict[str, Any]) -> int:
        at = len(self.output)
        self.output.append(item)
        self._parts.append([])
        self._open = at
        events.append(self._event("response.output_item.added", output_index=at, item=dict(item)))
        return at

    def _open_message(self, events: list[dict[str, Any]]) -> None:
        item_id = "msg_" + uuid.uuid4().hex
        at = self._add(events, {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
                                "content": []})
        events.append(self._event("response.content_part.added", item_id=item_id, output_index=at, content_index=0,
                                  part=_text_part("")))

    def _open_call(self, events: list[dict[str, Any]], call: ToolCallDelta) -> None:
        self._call_items[call.index] = self._add(events, {
            "id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress", "call_id": call.id,
            "name": call.name, "arguments": ""})

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        if self._open is None:
            return
        at, self._open = self._open, None
        item, text = self.output[at], "".join(self._parts[at])
        item["status"] = status
        if item["type"] == "message":
            item["content"] = [_text_part(text)]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=at,
                                      content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                      content_index=0, part=_text_part(text)))
        else:
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=at, arguments=text))
        events.append(self._event("response.output_item.done", output_index=at, item=item))

    def response(self) -> dict[str, Any]:
        """The Response object as it stands (usage once the sequence finished)."""
        req = self.req
        usage = None
        if self.status in ("completed", "incomplete"):
            u = self.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        fmt = req.text.format if req.text is not None else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": self.status,
            "background": False, "error": self.error,
            "incomplete_details": None if self.incomplete_reason is None else {"reason": self.incomplete_reason},
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": self.model, "output": list(self.output),
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "tool_choice": msgspec.to_builtins(choice), "tools": msgspec.to_builtins(req.tools or []),
            "truncation": "disabled", "usage": usage, "user": req.user,
        }


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


class ResponsesStream:
    """A streaming Responses request's SSE (what server/app.py's stream() drives): ``event: <type>`` and
    ``data: <event>`` per event; no ``[DONE]``, as OpenAI ends these streams with the terminal event."""

    def __init__(self, state: ResponseState) -> None:
        self.state = state

    def on_delta(self, index: int, delta: SeqText) -> bytes:
        out = b"".join(_sse(e) for e in self.state.on_delta(index, delta))
        if self.state.aborted:
            out += self.error(503, str(aborted_error()))
        return out

    def finish(self) -> bytes:
        """The terminal event went with the last delta; a sequence that ended without one fails."""
        return b"" if self.state.done else self.error(503, str(aborted_error()))

    def error(self, status: int, message: str) -> bytes:
        return b"".join(_sse(e) for e in self.state.fail(status, message))


class ResponsesBuilder:
    """A non-streaming Responses request: the deltas in, the Response object's JSON out."""

    def __init__(self, state: ResponseState) -> None:
        self.state = state

    def on_delta(self, index: int, delta: SeqText) -> None:
        self.state.on_delta(index, delta)

    def body(self) -> bytes:
        """The Response JSON; raises ProtocolError (503) if the engine aborted the sequence."""
        if self.state.aborted or not self.state.done:
            raise aborted_error()
        return _encode(self.state.response())
