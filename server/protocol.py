"""OpenAI protocol, input side: request models, validation, error bodies, and the SamplingParams mapping.

Pure code (no sockets, no Starlette): server/app.py decodes a body with `parse_chat_request` /
`parse_completion_request`, maps it with `to_sampling_params`, and answers any `ProtocolError` with
`err.status` and `err.body()`. The output side (response objects, SSE chunks, logprobs) is in
server/protocol_output.py; tool-call parsing is in server/tool_parsers/.

Requests decode into the msgspec Structs of server/protocol_types.py (re-exported here) straight from
the body bytes: one pass, typed, several times faster than pydantic. Ranges follow OpenAI and vLLM, so
a request either means the same thing it means there or gets a 400 that names the field (``param``),
in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from flotilla.sampling_params import SamplingParams, StructuredOutputs
from flotilla.server.protocol_types import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Content,
    ContentPart,
    DeveloperMessage,
    FunctionCallParam,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    SystemMessage,
    ToolCallParam,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from flotilla.server.reasoning_parser import ReasoningParser, thinking_disabled
from flotilla.server.tool_parsers import (
    CallsOutput,
    HermesToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallParser,
    required_tool_calls_schema,
)

log = logging.getLogger(__name__)

__all__ = [
    "MAX_COMPLETION_LOGPROBS", "MAX_N", "MAX_TOP_LOGPROBS", "AssistantMessage", "ChatCompletionRequest", "ChatMessage",
    "CompletionRequest", "Content", "ContentPart", "DeveloperMessage", "FunctionCallParam", "FunctionDefinition",
    "NamedFunction", "NamedToolChoice", "ProtocolError", "ResponseFormat", "SamplingFields", "StreamOptions",
    "SystemMessage", "ToolCallParam", "ToolDefinition", "ToolMessage", "UserMessage", "chat_messages", "chat_tools",
    "chat_image_urls", "check_chat_request", "completion_prompts", "decode_body", "default_error_type", "error_body",
    "model_not_found", "note_unknown_fields", "parse_chat_request", "parse_completion_request",
    "parse_detokenize_request", "parse_tokenize_request", "reads_model_markup", "reasoning_parser_for",
    "to_sampling_params", "tool_parser_for", "tool_parsing_enabled",
]

MAX_N = 128
"""Most completions per request (OpenAI's bound)."""
MAX_TOP_LOGPROBS = 20
"""Chat ``top_logprobs`` upper bound (OpenAI's)."""
MAX_COMPLETION_LOGPROBS = 5
"""Completions ``logprobs`` upper bound (OpenAI's legacy API)."""
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_UNSUPPORTED_PART_TYPES = frozenset({"image", "input_image", "input_audio", "audio_url", "file", "video_url",
                                     "input_file"})


# ---------------------------------------------------------------------------------------------
# Errors


def default_error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status (429 is "requests", as OpenAI's rate limiter says)."""
    if status >= 500:
        return "server_error"
    if status == 429:
        return "requests"
    return "invalid_request_error"


_DEFAULT_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` exactly as OpenAI answers an HTTP error."""
    return msgspec.json.encode({"error": {
        "message": message,
        "type": type or default_error_type(status),
        "param": param,
        "code": code if code is not None else _DEFAULT_CODES.get(status),
    }})


class ProtocolError(Exception):
    """A request the server answers with an HTTP error; ``body()`` is the OpenAI error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or default_error_type(status)
        self.code = code if code is not None else _DEFAULT_CODES.get(status)

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"ProtocolError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def model_not_found(model: str) -> ProtocolError:
    """404 for a model this server does not serve (OpenAI's message and code)."""
    return ProtocolError(404, f"The model `{model}` does not exist or you do not have access to it.",
                         code="model_not_found")


def _bad(param: str | None, message: str, code: str = "invalid_value") -> ProtocolError:
    return ProtocolError(400, message, param=param, code=code)


def _unsupported(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, message, param=param, code="unsupported_parameter")


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


# ---------------------------------------------------------------------------------------------
# Decoding


_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def _param_of(path: str) -> str | None:
    """msgspec's ``$.messages[0].role`` -> OpenAI's ``messages[0].role``; the root -> None."""
    return path[1:] if path.startswith(".") else (path or None)


def decode_body(decoder: msgspec.json.Decoder, body: bytes | bytearray | memoryview | str) -> Any:
    """The body decoded into the decoder's type; ProtocolError (400) naming the field that does not fit."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        assert m is not None
        detail, param = m["detail"], _param_of(m["path"] or "")
        missing = _MISSING.match(detail)
        if missing is not None:
            field = missing["field"]
            param = f"{param}.{field}" if param else field
            raise _bad(param, f"Missing required parameter: '{param}'.", "missing_required_parameter") from None
        if param is None:
            raise _bad(None, f"Invalid request body: {detail}.", "invalid_type") from None
        if detail.startswith("Expected"):
            raise _bad(param, f"Invalid type for '{param}': {detail}.", "invalid_type") from None
        raise _bad(param, f"Invalid '{param}': {detail}.") from None  # e.g. an unknown role or enum value
    except msgspec.DecodeError as e:
        raise _bad(None, f"We could not parse the JSON body of your request ({e}). The API expects a JSON "
                         "object as the body.", "invalid_json") from None
    except RecursionError:  # nesting deeper than the interpreter's stack, in a field that takes any JSON
        raise _bad(None, "We could not parse the JSON body of your request: it is nested too deeply.",
                   "invalid_json") from None


def parse_chat_request(body: bytes | bytearray | memoryview | str) -> ChatCompletionRequest:
    """Decode and validate a chat completions body; raises ProtocolError (400) naming the bad field."""
    req: ChatCompletionRequest = decode_body(_chat_decoder, body)
    check_chat_request(req)
    note_unknown_fields(body, ChatCompletionRequest)
    return req


def check_chat_request(req: ChatCompletionRequest) -> None:
    """Validate a chat request beyond its types (also one built from another endpoint's body); ProtocolError (400)."""
    _check_sampling_fields(req)
    _check_chat(req)


def parse_completion_request(body: bytes | bytearray | memoryview | str) -> CompletionRequest:
    """Decode and validate a completions body; raises ProtocolError (400) naming the bad field."""
    req: CompletionRequest = decode_body(_completion_decoder, body)
    _check_sampling_fields(req)
    _check_completion(req)
    note_unknown_fields(body, CompletionRequest)
    return req


def parse_tokenize_request(body: bytes | bytearray | memoryview | str) -> TokenizeRequest:
    """Decode a /tokenize body: a prompt or messages (one of them); ProtocolError (400) otherwise."""
    req: TokenizeRequest = decode_body(_tokenize_decoder, body)
    if (req.prompt is None) == (req.messages is None):
        raise _bad("prompt" if req.prompt is None else "messages", "Invalid request: send either 'prompt' or "
                   "'messages'.", "missing_required_parameter" if req.prompt is None else "invalid_value")
    if req.messages is not None:
        if not req.messages:
            raise _bad("messages", "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                       "empty_array")
        for i, msg in enumerate(req.messages):
            _check_content(msg.content, f"messages[{i}].content", allow_refusal=isinstance(msg, AssistantMessage))
    return req


def parse_detokenize_request(body: bytes | bytearray | memoryview | str, vocab_size: int) -> DetokenizeRequest:
    """Decode a /detokenize body; token ids outside the vocabulary are a 400."""
    req: DetokenizeRequest = decode_body(_detokenize_decoder, body)
    if req.tokens and not (0 <= min(req.tokens) and max(req.tokens) < vocab_size):
        raise _bad("tokens", f"Invalid 'tokens': token ids must be in [0, {vocab_size}).")
    return req


_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])
"""A body's top-level keys without decoding their values."""
_noted_fields: set[str] = set()


def note_unknown_fields(body: bytes | bytearray | memoryview | str, cls: type) -> None:
    """Unknown request fields are accepted, as vLLM and OpenAI's SDKs expect of a server (clients send extras),
    and each name is logged once, so that a misspelt option does not go unseen."""
    fields = cls.__struct_encode_fields__
    for name in _top_level.decode(body):
        if name not in fields and name not in _noted_fields:
            _noted_fields.add(name)
            log.warning("request field %r is not one this server knows: ignored (logged once)", name)


# ---------------------------------------------------------------------------------------------
# Validation


def _fmt(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _check_range(req: Any, field: str, lo: float | None, hi: float | None, *, lo_open: bool = False) -> None:
    value = getattr(req, field)
    if value is None:
        return
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else _fmt(lo)
        hi_s = "inf" if hi is None else _fmt(hi)
        span = f"{'(' if lo_open else '['}{lo_s}, {hi_s}]"
        raise _bad(field, f"Invalid '{field}': {value} is out of range; expected a value in {span}.")


def _check_sampling_fields(req: SamplingFields) -> None:
    _check_range(req, "n", 1, MAX_N)
    _check_range(req, "temperature", 0, 2)
    _check_range(req, "top_p", 0, 1, lo_open=True)
    _check_range(req, "min_p", 0, 1)
    _check_range(req, "presence_penalty", -2, 2)
    _check_range(req, "frequency_penalty", -2, 2)
    _check_range(req, "repetition_penalty", 0, None, lo_open=True)
    _check_range(req, "max_tokens", 1, _INT32_MAX)
    _check_range(req, "min_tokens", 0, _INT32_MAX)
    _check_range(req, "seed", _INT64_MIN, _INT64_MAX)
    _check_range(req, "priority", _INT32_MIN, _INT32_MAX)
    if req.top_k is not None and req.top_k < -1:
        raise _bad("top_k", f"Invalid 'top_k': {req.top_k}; expected -1 or 0 (disabled) or a positive integer.")
    _check_range(req, "top_k", -1, _INT32_MAX)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(not s for s in stops):
        raise _bad("stop", "Invalid 'stop': stop sequences must not be empty strings.")
    if req.stop_token_ids and not _token_ids_in_range(req.stop_token_ids):
        raise _bad("stop_token_ids", f"Invalid 'stop_token_ids': token ids must be in [0, {_INT32_MAX}].")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    if req.logit_bias:
        logit_bias(req)
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad("prompt_logprobs", f"Invalid 'prompt_logprobs': {req.prompt_logprobs}; expected an integer "
                                          f"in [0, {MAX_TOP_LOGPROBS}].")
        if req.stream:
            raise _bad("prompt_logprobs", "Invalid 'prompt_logprobs': not available when 'stream' is true.")
    structured_outputs_of(req)  # (its form: the grammar itself is parsed off the event loop, server/app.py)


def _check_content(content: Content | None, param: str, *, allow_refusal: bool) -> None:
    if isinstance(content, str) or content is None:
        return
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if part.type == "text":
            if part.text is None:
                raise _bad(f"{where}.text", f"Missing required parameter: '{where}.text'.",
                           "missing_required_parameter")
        elif part.type == "image_url":
            if part.image_url is None:
                raise _bad(f"{where}.image_url", f"Missing required parameter: '{where}.image_url'.",
                           "missing_required_parameter")
        elif part.type == "refusal" and allow_refusal:
            if part.refusal is None:
                raise _bad(f"{where}.refusal", f"Missing required parameter: '{where}.refusal'.",
                           "missing_required_parameter")
        elif part.type in _UNSUPPORTED_PART_TYPES:
            raise ProtocolError(400, f"Invalid '{where}.type': '{part.type}' content is not supported by this "
                                     "server; send text and image_url content parts.", param=f"{where}.type",
                                code="unsupported_value")
        else:
            raise _bad(f"{where}.type", f"Invalid '{where}.type': unknown content part type '{part.type}'.")


def _check_chat(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise _bad("messages", "Invalid 'messages': empty array. Expected an array with minimum length 1.",
                   "empty_array")
    for i, msg in enumerate(req.messages):
        _check_content(msg.content, f"messages[{i}].content", allow_refusal=isinstance(msg, AssistantMessage))
    _check_range(req, "max_completion_tokens", 1, _INT32_MAX)
    _check_range(req, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs", "Invalid 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' "
                                   "is given.")
    if req.echo:
        raise _unsupported("echo", "Unsupported parameter: 'echo' is supported on /v1/completions, not on chat.")
    if req.functions is not None or req.function_call is not None:
        param = "functions" if req.functions is not None else "function_call"
        raise _unsupported(param, f"Unsupported parameter: '{param}' is deprecated; use 'tools' and "
                                  "'tool_choice' instead.")
    for i, tool in enumerate(req.tools or ()):
        if not tool.function.name:
            raise _bad(f"tools[{i}].function.name", f"Invalid 'tools[{i}].function.name': empty string.")
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise _bad("tool_choice", "Invalid 'tool_choice': only allowed when 'tools' are specified.")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in req.tools or ()}:
        raise _bad("tool_choice", f"Invalid 'tool_choice': function '{choice.function.name}' is not in 'tools'.")


def _check_completion(req: CompletionRequest) -> None:
    completion_prompts(req)
    _check_range(req, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if req.suffix:
        raise _unsupported("suffix", "Unsupported parameter: 'suffix' is not supported by this server.")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise _unsupported("best_of", "Unsupported parameter: 'best_of' must equal 'n' on this server.")


def logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """The request's logit_bias with int token ids; a 400 for a key that is not a token id or a bias outside
    [-100, 100] (ids past the vocabulary are the tokenizer's 400)."""
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in req.logit_bias.items():
        token = int(key) if key.isdecimal() else -1
        if not 0 <= token <= _INT32_MAX:
            raise _bad("logit_bias", f"Invalid 'logit_bias': key '{key}' is not a token id.")
        if not -100 <= bias <= 100:
            raise _bad("logit_bias", f"Invalid 'logit_bias': {bias} for token {key} is outside [-100, 100].")
        out[token] = float(bias)
    return out


def _token_ids_in_range(ids: list[int]) -> bool:
    """Token ids travel as int32 arrays: anything outside [0, 2**31) is refused here, not overflowed later."""
    return 0 <= min(ids) and max(ids) <= _INT32_MAX


def _is_token_ids(value: list[Any]) -> bool:
    return all(type(t) is int for t in value)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, one per input: text or token ids (a batch gives several, in order).

    Choice ``k`` of a response belongs to prompt ``k // n``.
    """
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and _is_token_ids(prompt):
        prompts = [prompt]
    elif prompt and (all(isinstance(p, str) for p in prompt)
                     or all(isinstance(p, list) and p and _is_token_ids(p) for p in prompt)):
        prompts = list(prompt)
    else:
        raise _bad("prompt", "Invalid 'prompt': expected a non-empty string, array of strings, array of token "
                             "ids, or array of token-id arrays.")
    for i, p in enumerate(prompts):
        if not p:
            raise _bad("prompt", f"Invalid 'prompt': prompt {i} is empty.")
        if not isinstance(p, str) and not _token_ids_in_range(p):
            raise _bad("prompt", f"Invalid 'prompt': prompt {i} has a token id outside [0, {_INT32_MAX}].")
    return prompts


def forced_tool_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema that enforces a tool_choice naming a function (its parameters) or "required" (an array of
    calls, server/tool_parsers/); None when the model chooses (auto, none)."""
    choice = req.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in req.tools or () if t.function.name == choice.function.name), None)
        return None if tool is None else tool.function.parameters or {"type": "object"}  # (None: _check_chat's 400)
    if choice == "required" and req.tools:
        return required_tool_calls_schema([(t.function.name, t.function.parameters) for t in req.tools],
                                          req.parallel_tool_calls is not False)
    return None


def structured_outputs_of(req: SamplingFields) -> tuple[StructuredOutputs, str] | None:
    """The output constraint a request asks for, with the parameter that asked (for a 400 about it); None when it
    asks for none. OpenAI's response_format (json_object, json_schema) and vLLM's structured_outputs and guided_*;
    two of them at once are a 400."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise _bad("response_format.json_schema", "Missing required parameter: "
                           "'response_format.json_schema.schema'.", "missing_required_parameter")
            asked.append(("response_format", {"json": fmt.json_schema.schema_}))
        else:
            raise ProtocolError(400, f"Invalid 'response_format.type': '{fmt.type}'; expected 'text', "
                                     "'json_object' or 'json_schema'.", param="response_format.type",
                                code="unsupported_value")
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in msgspec.structs.asdict(so).items() if v not in (None, False)}
        if given:
            asked.append(("structured_outputs", given))
    for field in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{field}")
        if value is not None:
            asked.append((f"guided_{field}", {field: value}))
    tools = forced_tool_schema(req) if isinstance(req, ChatCompletionRequest) else None
    if tools is not None:
        asked.append(("tool_choice", {"json": tools}))
    if not asked:
        return None
    if len(asked) > 1 or len(asked[0][1]) > 1:
        names = [p for p, _ in asked] if len(asked) > 1 else [f"structured_outputs.{k}" for k in asked[0][1]]
        raise _bad(names[0], f"Invalid request: only one output constraint at a time; got {', '.join(names)}.")
    param, spec = asked[0]
    if "json" in spec and not isinstance(spec["json"], str):
        spec = {"json": msgspec.json.encode(spec["json"]).decode()}
    try:
        return StructuredOutputs(**spec), param
    except ValueError as e:
        raise _bad(param, f"Invalid '{param}': {e}.") from None


# ---------------------------------------------------------------------------------------------
# Mapping onto the engine


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(dict.fromkeys(stop))  # de-duplicated, order kept


_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int | None = None,
                       defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The SamplingParams a validated request asks for.

    ``default_max_tokens`` applies when the request sets no limit (None: the engine stops at
    max_model_len). ``defaults`` are the server's values for fields the request leaves unset (e.g.
    the model's generation_config temperature / top_p / top_k), by SamplingParams field name.
    Raises ProtocolError (400, param = the field) if SamplingParams rejects the combination.
    """
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and logprobs is not None:  # the echoed prompt's logprobs
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    kwargs: dict[str, Any] = dict(defaults or {})
    set_fields = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed, "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos, "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
        "logit_bias": logit_bias(req),
    }
    kwargs.update((k, v) for k, v in set_fields.items() if v is not None)
    kwargs["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
    kwargs["stop"] = _stop_list(req.stop)
    kwargs["stop_token_ids"] = list(req.stop_token_ids or ())
    structured = structured_outputs_of(req)
    if structured is not None:
        kwargs["structured_outputs"] = structured[0]
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        field = str(e).split(" ", 1)[0]
        param = field if field in _SAMPLING_FIELDS else None
        if param == "max_tokens" and isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise _bad(param, f"Invalid request: {e}.") from None


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template expects it (plain dicts, content as one string).

    Text parts are joined with newlines (as vLLM does for string-content templates), unless the message has images:
    then its content stays a list of text and {"type": "image"} parts for the template to place; "developer" turns
    become "system" turns, since templates predate that role and would silently drop it; assistant
    tool-call arguments are decoded to objects where they are JSON objects, because templates render
    them with ``tojson`` and a string would come out double-encoded.
    """
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        role = "system" if isinstance(msg, DeveloperMessage) else type(msg).__struct_config__.tag
        content: Any = msg.content
        if isinstance(content, list) and any(p.type == "image_url" for p in content):
            content = [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text or ""}
                       for p in content]  # (the parts, in order: multimodal templates place each image's tokens)
        elif isinstance(content, list):
            content = "\n".join(p.text if p.type == "text" else (p.refusal or "") for p in content)
        # None (an assistant turn that only calls tools) becomes "": templates index message['content']
        d: dict[str, Any] = {"role": role, "content": "" if content is None else content}
        if getattr(msg, "name", None) is not None:
            d["name"] = msg.name
        if isinstance(msg, ToolMessage):
            d["tool_call_id"] = msg.tool_call_id
        elif isinstance(msg, AssistantMessage) and msg.tool_calls:
            d["tool_calls"] = [
                {"id": tc.id, "type": "function",
                 "function": {"name": tc.function.name, "arguments": _template_arguments(tc.function.arguments)}}
                for tc in msg.tool_calls
            ]
        out.append(d)
    return out


def chat_image_urls(req: ChatCompletionRequest | TokenizeRequest) -> list[tuple[str, str]]:
    """(param, url) of each image_url part, in the order the chat template meets them."""
    return [(f"messages[{i}].content[{j}]", p.image_url.url)
            for i, msg in enumerate(req.messages or []) if isinstance(msg.content, list)
            for j, p in enumerate(msg.content) if p.type == "image_url" and p.image_url is not None]


def _template_arguments(arguments: str) -> dict[str, Any] | str:
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def chat_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool definitions to render into the prompt, or None.

    With ``tool_choice: "none"`` the model is not shown the tools (OpenAI: it will not call one); with a
    named choice it is shown only that tool ("required" and a named choice are enforced by a constraint on the
    output, forced_tool_schema).
    """
    choice = req.effective_tool_choice
    if not req.tools or choice == "none":
        return None
    tools = req.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    return [{"type": "function", "function": msgspec.to_builtins(t.function)} for t in tools]


def tool_parser_for(req: ChatCompletionRequest, model_format: type[CallsOutput] = HermesToolParser
                    ) -> Callable[[], ToolCallParser] | None:
    """What makes tool calls of a choice's text: the forced call's parser under a named or "required"
    tool_choice, the model format's parser (the server's --tool-call-parser) under "auto", none without tools or
    under "none"."""
    choice = req.effective_tool_choice
    if not req.tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return functools.partial(NamedToolParser, choice.function.name)
    return RequiredToolParser if choice == "required" else functools.partial(model_format, req.tools)


def reasoning_parser_for(req: ChatCompletionRequest, style: type[ReasoningParser] | None
                         ) -> type[ReasoningParser] | None:
    """The server's reasoning parser (--reasoning-parser) for this request, or None: none is set, or the request's
    chat_template_kwargs turn thinking off. A grammar (structured outputs, a forced tool_choice) then holds only the
    answer after the reasoning (server/app.py)."""
    if style is None or thinking_disabled(req.chat_template_kwargs):
        return None
    return style


def reads_model_markup(req: ChatCompletionRequest, reasoning: type[ReasoningParser] | None) -> bool:
    """Whether a parser reads the model's own markup in this request's output (think tags, the tool-call format's
    tags): when those are special tokens, skip_special_tokens would remove them before the parser sees them."""
    return reasoning is not None or (tool_parsing_enabled(req) and forced_tool_schema(req) is None)


def tool_parsing_enabled(req: ChatCompletionRequest) -> bool:
    """Whether the output is scanned for tool calls (tools given and tool_choice is not "none")."""
    return bool(req.tools) and req.effective_tool_choice != "none"
