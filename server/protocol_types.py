"""OpenAI request schema: the msgspec Structs that /v1/chat/completions and /v1/completions bodies decode into.

Schema only; validation beyond types, the error format and the mapping onto the engine live in
server/protocol.py (which re-exports these names). Unknown fields are ignored because real clients
send many. Optional fields are ``X | None`` because clients (LangChain, LiteLLM, ...) send explicit
nulls for anything unset; None always means "use the default".
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Struct(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Request-side struct: unknown fields ignored (clients send extras), unset fields left out on dump."""


class ImageURL(_Struct, kw_only=True):
    url: str
    """A ``data:image/...;base64,`` URL, or an http(s) URL of a host the server allows."""
    detail: str | None = None
    """OpenAI's "auto" | "low" | "high"; accepted, and the model's image processor decides the resolution."""


class ContentPart(_Struct, kw_only=True):
    """One part of a message's content list: text, an image (models that take images), or a refusal (assistant)."""

    type: str
    """"text" | "image_url" | "refusal"; other media types are refused with a 400."""
    text: str | None = None
    """The text of a "text" part."""
    image_url: ImageURL | None = None
    """The image of an "image_url" part."""
    refusal: str | None = None
    """The text of a "refusal" part."""


Content = str | list[ContentPart]


class FunctionCallParam(_Struct, kw_only=True):
    name: str
    """Function the assistant called."""
    arguments: str
    """Its arguments as a JSON string."""


class ToolCallParam(_Struct, kw_only=True):
    """A tool call in an earlier assistant turn of the conversation."""

    id: str
    """Tool call id; the tool message that answers it repeats it."""
    function: FunctionCallParam
    type: Literal["function"] = "function"


class _Message(_Struct, tag_field="role", kw_only=True):
    """Chat message; the ``role`` field picks the subclass (an unknown role is a 400 naming it)."""


class SystemMessage(_Message, tag="system", kw_only=True):
    content: Content
    name: str | None = None


class DeveloperMessage(_Message, tag="developer", kw_only=True):
    content: Content
    name: str | None = None


class UserMessage(_Message, tag="user", kw_only=True):
    content: Content
    name: str | None = None


class AssistantMessage(_Message, tag="assistant", kw_only=True):
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    refusal: str | None = None


class ToolMessage(_Message, tag="tool", kw_only=True):
    content: Content
    tool_call_id: str
    """The id of the assistant tool call this message answers."""


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDefinition(_Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool | None = None


class ToolDefinition(_Struct, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(_Struct, kw_only=True):
    name: str


class NamedToolChoice(_Struct, kw_only=True):
    """``{"type": "function", "function": {"name": ...}}``: call this tool."""

    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(_Struct, kw_only=True):
    include_usage: bool | None = None
    """Send a last chunk with usage and no choices (and "usage": null on every other chunk)."""


class JSONSchemaFormat(_Struct, kw_only=True):
    """response_format json_schema's ``json_schema``."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    """The JSON schema the output follows."""
    strict: bool | None = None


class ResponseFormat(_Struct, kw_only=True):
    type: str
    """"text", "json_object" (any JSON object) or "json_schema" (the output follows ``json_schema.schema``)."""
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Struct, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Struct, kw_only=True):
    """Fields shared by both endpoints: OpenAI's plus vLLM's extensions that SamplingParams carries."""

    model: str | None = None
    """Served model name; None means the server's (only) model."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias in [-100, 100] added to its logit."""
    prompt_logprobs: int | None = None
    """Also return each prompt token's logprob with this many alternatives (vLLM extension; not streamed)."""
    priority: int | None = None
    """Lower runs first under priority scheduling (vLLM extension)."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    """vLLM's constraint on the output (a JSON schema, a regex, a choice or a grammar)."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older name of structured_outputs.json (and so on for the guided_* fields)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens; wins when both are set."""
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    """Append the assistant turn opener (vLLM extension; default true)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template, e.g. {"enable_thinking": false} (vLLM extension)."""
    functions: list[Any] | None = None
    """Deprecated pre-tools API: refused with a pointer to ``tools``."""
    function_call: Any | None = None
    echo: bool | None = None
    """vLLM's: prepend the last message to the reply; refused (completions' echo is supported)."""

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list[Any]
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: int | None = 16
    """OpenAI's default for this endpoint is 16."""
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Struct, kw_only=True):
    """POST /tokenize (vLLM's): a text prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template has them)."""
    add_generation_prompt: bool | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None
    """Also return each token's text."""


class DetokenizeRequest(_Struct, kw_only=True):
    """POST /detokenize (vLLM's)."""

    tokens: list[int]
    model: str | None = None
