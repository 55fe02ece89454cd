"""OpenAI protocol: request validation and errors, SamplingParams mapping, response bodies and SSE streams.

The contract is the official `openai` package: every body and chunk must validate against its pydantic
types, and errors must have OpenAI's ``{"error": {message, type, param, code}}`` shape.
"""

from __future__ import annotations

import json
import logging
import random

import msgspec
import pytest

from flotilla.sampling_params import SamplingParams
from flotilla.server.protocol import (
    ChatCompletionRequest,
    ProtocolError,
    chat_messages,
    chat_tools,
    completion_prompts,
    error_body,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
    to_sampling_params,
    tool_parsing_enabled,
)
from flotilla.server.protocol_logprobs import TokenTexts
from flotilla.server.protocol_output import (
    SSE_DONE,
    SYSTEM_FINGERPRINT,
    ChatCompletionBuilder,
    ChatStreamState,
    CompletionBuilder,
    CompletionStreamState,
    new_response_id,
    sse_line,
)
from flotilla.server.tool_parsers import parse_tool_calls
from flotilla.transport.messages import SeqText
from helpers_optional import require

require("openai", "the bodies and chunks are validated against the openai package's types")
from openai.types import Completion  # noqa: E402  (after the skip above)
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

USER = [{"role": "user", "content": "hi"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER_SCHEMA}}]
VOCAB = ["Hello", " world", "!", "\n", "\udce2", " café"]


def token_text(token_id: int) -> str:
    return VOCAB[token_id % len(VOCAB)]


def chat(**fields) -> ChatCompletionRequest:
    return parse_chat_request(json.dumps({"model": "m", "messages": USER, **fields}))


def delta(text: str = "", ids: tuple[int, ...] = (), finish: str | None = None, **kw) -> SeqText:
    return SeqText(rid="r", text=text, token_ids=list(ids), finish_reason=finish, **kw)


def events(stream: bytes) -> list[dict]:
    """Split an SSE byte stream, checking the exact framing; returns the JSON events before [DONE]."""
    assert stream.endswith(SSE_DONE)
    frames = stream[: -len(SSE_DONE)].split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame
        out.append(json.loads(frame[6:]))
    return out


def error_of(fn, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(body)
    err = info.value
    doc = json.loads(err.body())
    assert list(doc) == ["error"] and list(doc["error"]) == ["message", "type", "param", "code"]
    assert doc["error"]["param"] == err.param and doc["error"]["type"] == err.type == "invalid_request_error"
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return err


# ---------------------------------------------------------------------------------------------
# errors


def test_error_body_matches_openai():
    assert json.loads(error_body(400, "bad", param="temperature", code="invalid_value")) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}
    assert json.loads(error_body(401, "no key"))["error"] == {
        "message": "no key", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    assert json.loads(error_body(429, "slow down"))["error"]["code"] == "rate_limit_exceeded"
    assert json.loads(error_body(500, "boom"))["error"]["type"] == "server_error"
    assert json.loads(error_body(413, "too big"))["error"]["type"] == "invalid_request_error"
    err = model_not_found("gpt-x")
    assert err.status == 404 and json.loads(err.body())["error"]["code"] == "model_not_found"
    assert "gpt-x" in err.message


M = '"messages": [{"role": "user", "content": "hi"}]'

CHAT_ERRORS = [
    (b"{not json", None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_type"),
    (b"{}", "messages", "missing_required_parameter"),
    (b'{"messages": []}', "messages", "empty_array"),
    (b'{"messages": "hi"}', "messages", "invalid_type"),
    (b'{"messages": [{"content": "hi"}]}', "messages[0].role", "missing_required_parameter"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role", "invalid_value"),
    (b'{"messages": [{"role": "user"}]}', "messages[0].content", "missing_required_parameter"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content", "invalid_type"),
    (b'{"messages": [{"role": "tool", "content": "r"}]}', "messages[0].tool_call_id", "missing_required_parameter"),
    (b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]}',
     "messages[0].content[0].type", "unsupported_value"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0].content[0].image_url",
     "missing_required_parameter"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "messages[0].content[0].text",
     "missing_required_parameter"),
    (b'{"messages": [{"role": "user", "content": [{"type": "blob", "text": "x"}]}]}', "messages[0].content[0].type",
     "invalid_value"),
    (b'{%s, "temperature": "hot"}' % M.encode(), "temperature", "invalid_type"),
    (b'{%s, "temperature": 2.5}' % M.encode(), "temperature", "invalid_value"),
    (b'{%s, "temperature": -0.1}' % M.encode(), "temperature", "invalid_value"),
    (b'{%s, "top_p": 0}' % M.encode(), "top_p", "invalid_value"),
    (b'{%s, "top_p": 1.01}' % M.encode(), "top_p", "invalid_value"),
    (b'{%s, "top_k": -2}' % M.encode(), "top_k", "invalid_value"),
    (b'{%s, "min_p": 1.5}' % M.encode(), "min_p", "invalid_value"),
    (b'{%s, "n": 0}' % M.encode(), "n", "invalid_value"),
    (b'{%s, "n": 1000}' % M.encode(), "n", "invalid_value"),
    (b'{%s, "n": 1.5}' % M.encode(), "n", "invalid_type"),
    (b'{%s, "presence_penalty": 2.1}' % M.encode(), "presence_penalty", "invalid_value"),
    (b'{%s, "frequency_penalty": -3}' % M.encode(), "frequency_penalty", "invalid_value"),
    (b'{%s, "repetition_penalty": 0}' % M.encode(), "repetition_penalty", "invalid_value"),
    (b'{%s, "max_tokens": 0}' % M.encode(), "max_tokens", "invalid_value"),
    (b'{%s, "max_completion_tokens": 0}' % M.encode(), "max_completion_tokens", "invalid_value"),
    (b'{%s, "min_tokens": -1}' % M.encode(), "min_tokens", "invalid_value"),
    (b'{%s, "seed": 99999999999999999999}' % M.encode(), "seed", "invalid_value"),
    (b'{%s, "stop": 3}' % M.encode(), "stop", "invalid_type"),
    (b'{%s, "stop": ["a", ""]}' % M.encode(), "stop", "invalid_value"),
    (b'{%s, "stop_token_ids": [-1]}' % M.encode(), "stop_token_ids", "invalid_value"),
    (b'{%s, "top_logprobs": 3}' % M.encode(), "top_logprobs", "invalid_value"),
    (b'{%s, "logprobs": true, "top_logprobs": 21}' % M.encode(), "top_logprobs", "invalid_value"),
    (b'{%s, "logprobs": 1}' % M.encode(), "logprobs", "invalid_type"),
    (b'{%s, "stream_options": {"include_usage": true}}' % M.encode(), "stream_options", "invalid_value"),
    (b'{%s, "stream": true, "stream_options": {"include_usage": 1}}' % M.encode(), "stream_options.include_usage",
     "invalid_type"),
    (b'{%s, "logit_bias": {"a50": -100}}' % M.encode(), "logit_bias", "invalid_value"),
    (b'{%s, "logit_bias": {"-3": 1}}' % M.encode(), "logit_bias", "invalid_value"),
    (b'{%s, "logit_bias": {"50": 101}}' % M.encode(), "logit_bias", "invalid_value"),
    (b'{%s, "prompt_logprobs": 21}' % M.encode(), "prompt_logprobs", "invalid_value"),
    (b'{%s, "prompt_logprobs": -1}' % M.encode(), "prompt_logprobs", "invalid_value"),
    (b'{%s, "prompt_logprobs": 1, "stream": true}' % M.encode(), "prompt_logprobs", "invalid_value"),
    (b'{%s, "echo": true}' % M.encode(), "echo", "unsupported_parameter"),
    (b'{%s, "response_format": {"type": "yaml"}}' % M.encode(), "response_format.type", "unsupported_value"),
    (b'{%s, "response_format": {"type": "json_schema"}}' % M.encode(), "response_format.json_schema",
     "missing_required_parameter"),
    (b'{%s, "response_format": {"type": "json_object"}, "guided_regex": "a"}' % M.encode(), "response_format",
     "invalid_value"),
    (b'{%s, "structured_outputs": {"regex": "a", "choice": ["a"]}}' % M.encode(), "structured_outputs.regex",
     "invalid_value"),
    (b'{%s, "functions": [{"name": "f"}]}' % M.encode(), "functions", "unsupported_parameter"),
    (b'{%s, "tool_choice": "auto"}' % M.encode(), "tool_choice", "invalid_value"),
    (b'{%s, "tool_choice": "sometimes", "tools": %s}' % (M.encode(), json.dumps(TOOLS).encode()), "tool_choice",
     "invalid_value"),
    (b'{%s, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": %s}'
     % (M.encode(), json.dumps(TOOLS).encode()), "tool_choice", "invalid_value"),
    (b'{%s, "tools": [{"type": "function", "function": {}}]}' % M.encode(), "tools[0].function.name",
     "missing_required_parameter"),
]


@pytest.mark.parametrize(("body", "param", "code"), CHAT_ERRORS)
def test_chat_request_errors(body, param, code):
    err = error_of(parse_chat_request, body)
    assert (err.status, err.param, err.code) == (400, param, code), err.message


P = '"prompt": "once upon"'

COMPLETION_ERRORS = [
    (b'{"model": "m"}', "prompt", "missing_required_parameter"),
    (b'{"prompt": ""}', "prompt", "invalid_value"),
    (b'{"prompt": []}', "prompt", "invalid_value"),
    (b'{"prompt": [1, "a"]}', "prompt", "invalid_value"),
    (b'{"prompt": [[1, 2], []]}', "prompt", "invalid_value"),
    (b'{"prompt": [3, -1]}', "prompt", "invalid_value"),
    (b'{"prompt": 7}', "prompt", "invalid_type"),
    (b'{%s, "logit_bias": {"7": -100.5}}' % P.encode(), "logit_bias", "invalid_value"),
    (b'{%s, "suffix": "end"}' % P.encode(), "suffix", "unsupported_parameter"),
    (b'{%s, "best_of": 3}' % P.encode(), "best_of", "unsupported_parameter"),
    (b'{%s, "logprobs": 6}' % P.encode(), "logprobs", "invalid_value"),
    (b'{%s, "logprobs": true}' % P.encode(), "logprobs", "invalid_type"),
    (b'{%s, "max_tokens": -5}' % P.encode(), "max_tokens", "invalid_value"),
    (b'{%s, "temperature": 9}' % P.encode(), "temperature", "invalid_value"),
]


@pytest.mark.parametrize(("body", "param", "code"), COMPLETION_ERRORS)
def test_completion_request_errors(body, param, code):
    err = error_of(parse_completion_request, body)
    assert (err.status, err.param, err.code) == (400, param, code), err.message


def test_sampling_params_rejection_becomes_400_naming_the_field():
    req = chat(max_tokens=4, min_tokens=10)
    with pytest.raises(ProtocolError) as info:
        to_sampling_params(req)
    assert info.value.status == 400 and info.value.param == "min_tokens"


# ---------------------------------------------------------------------------------------------
# valid requests


def test_chat_maps_to_sampling_params():
    req = chat(max_tokens=5, max_completion_tokens=9, temperature=0, top_p=0.5, top_k=40, min_p=0.1, n=3, stop="##",
               seed=7, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logprobs=True,
               top_logprobs=4, ignore_eos=True, stop_token_ids=[2], min_tokens=2, user="u", unknown_field=[1])
    assert to_sampling_params(req) == SamplingParams(
        n=3, temperature=0.0, top_p=0.5, top_k=40, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.1, seed=7, max_tokens=9, min_tokens=2, stop=["##"], stop_token_ids=[2], ignore_eos=True,
        logprobs=4)


def test_chat_defaults_and_explicit_nulls():
    req = chat(temperature=None, n=None, stop=None, logprobs=None, stream=None, tools=None, max_tokens=None)
    sp = to_sampling_params(req)
    assert sp == SamplingParams(max_tokens=None) and sp.logprobs is None
    assert to_sampling_params(req, default_max_tokens=128).max_tokens == 128
    assert to_sampling_params(chat(max_tokens=3), default_max_tokens=128).max_tokens == 3
    # the server's defaults (e.g. generation_config) fill only what the request left unset
    sp = to_sampling_params(chat(top_p=0.9), defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.9, 20)
    assert to_sampling_params(chat(logprobs=True)).logprobs == 0
    assert to_sampling_params(chat(stop=["a", "b", "a"])).stop == ["a", "b"]


def test_completion_maps_to_sampling_params():
    req = parse_completion_request(b'{"model": "m", "prompt": "once", "logprobs": 3, "stop": ["\\n"], "seed": 1}')
    assert to_sampling_params(req) == SamplingParams(max_tokens=16, logprobs=3, stop=["\n"], seed=1)
    req = parse_completion_request(b'{"prompt": "once", "max_tokens": null}')
    assert to_sampling_params(req, default_max_tokens=None).max_tokens is None
    assert parse_completion_request(b'{"prompt": "x", "best_of": 2, "n": 2}').best_of == 2



def test_echo_logprobs_prompt_logprobs_and_logit_bias_map_to_sampling_params():
    """echo with logprobs k scores the prompt with k alternatives (vLLM's prompt_logprobs may ask for more);
    logit_bias keys become token ids."""
    def sp(body: bytes) -> SamplingParams:
        return to_sampling_params(parse_completion_request(body))

    assert sp(b'{"prompt": "x", "echo": true, "logprobs": 1}').prompt_logprobs == 1
    assert sp(b'{"prompt": "x", "echo": true}').prompt_logprobs is None  # (the text only)
    assert sp(b'{"prompt": "x", "echo": true, "logprobs": 0, "prompt_logprobs": 3}').prompt_logprobs == 3
    assert sp(b'{"prompt": "x", "logprobs": 2}').prompt_logprobs is None
    assert sp(b'{"prompt": "x", "logit_bias": {"7": -100, "12": 2.5}}').logit_bias == {7: -100.0, 12: 2.5}
    assert to_sampling_params(chat(prompt_logprobs=0)).prompt_logprobs == 0


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", ["text"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion_prompts(parse_completion_request(json.dumps({"prompt": prompt}))) == expected


def test_chat_messages_for_the_template():
    req = chat(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ], tools=TOOLS)
    assert chat_messages(req) == [
        {"role": "system", "content": "be\nbrief"},
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [  # None -> "": templates index message['content']
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "no"},
    ]
    assert chat_tools(req) == TOOLS and tool_parsing_enabled(req)


def test_tool_choice_decides_what_the_model_sees_and_whether_output_is_parsed():
    two = TOOLS + [{"type": "function", "function": {"name": "other"}}]
    assert chat_tools(chat()) is None and not tool_parsing_enabled(chat())
    none = chat(tools=two, tool_choice="none")
    assert chat_tools(none) is None and not tool_parsing_enabled(none)
    named = chat(tools=two, tool_choice={"type": "function", "function": {"name": "other"}})
    assert chat_tools(named) == [{"type": "function", "function": {"name": "other"}}] and tool_parsing_enabled(named)
    assert len(chat_tools(chat(tools=two, tool_choice="required"))) == 2
    assert chat(response_format={"type": "text"}).response_format.type == "text"


# ---------------------------------------------------------------------------------------------
# chat responses


def test_chat_stream_wire_format_exactly():
    req = chat(stream=True)
    state = ChatStreamState(req, request_id="chatcmpl-1", model="m", created=7)
    out = state.on_delta(0, delta("Hel", (0,), num_prompt_tokens=3)) + state.on_delta(0, delta("", (1,)))
    out += state.on_delta(0, delta("lo", (2,), "stop")) + state.finish()
    head = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
            b'"system_fingerprint":"' + SYSTEM_FINGERPRINT.encode() + b'","choices":[')
    assert out == (
        head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'{"index":0,"delta":{"content":"lo"},"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'
        + b"data: [DONE]\n\n")
    for ev in events(out):
        ChatCompletionChunk.model_validate(ev)
    assert state.finish() == b"" and state.on_delta(0, delta("late")) == b""


def test_chat_stream_usage_chunk_and_null_usage_everywhere_else():
    state = ChatStreamState(chat(stream=True, n=2, stream_options={"include_usage": True}), request_id="c", model="m")
    out = b""
    for i in range(3):
        for index in (1, 0):
            out += state.on_delta(index, delta(f"t{i}", (i,), "length" if i == 2 else None, num_prompt_tokens=5,
                                               num_cached_tokens=4))
    out += state.finish()
    evs = events(out)
    for ev in evs:
        ChatCompletionChunk.model_validate(ev)
        assert "usage" in ev
    assert all(ev["usage"] is None for ev in evs[:-1])
    assert evs[-1]["choices"] == [] and evs[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 4}}
    for index in (0, 1):
        mine = [ev["choices"][0] for ev in evs[:-1] if ev["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "t0t1t2"
        assert [c["finish_reason"] for c in mine] == [None] * 4 + ["length"]


def test_chat_stream_without_include_usage_has_no_usage_key():
    state = ChatStreamState(chat(stream=True), request_id="c", model="m")
    evs = events(state.on_delta(0, delta("a", (0,), "stop")) + state.finish())
    assert all("usage" not in ev for ev in evs)


def test_chat_logprobs_stream_and_body():
    req = chat(logprobs=True, top_logprobs=2)
    d = delta("Hello world", (0, 1), "stop", logprobs=[-0.5, float("-inf")], top_ids=[[0, 2, 3], [1, 4, 0]],
              top_logprobs=[[-0.5, -1.0, -2.0], [-0.1, -3.0, -4.0]], num_prompt_tokens=2)
    with pytest.raises(TypeError):
        ChatStreamState(req, request_id="c", model="m")
    state = ChatStreamState(req, request_id="c", model="m", token_texts=TokenTexts(token_text))
    evs = events(state.on_delta(0, d) + state.finish())
    for ev in evs:
        ChatCompletionChunk.model_validate(ev)
    content = evs[1]["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}, {"token": "!", "logprob": -1.0, "bytes": [33]}]}
    assert content[1]["logprob"] == -9999.0  # OpenAI's stand-in for -inf
    assert content[1]["top_logprobs"][1] == {"token": "\ufffd", "logprob": -3.0, "bytes": [0xE2]}  # a lone UTF-8 byte
    builder = ChatCompletionBuilder(req, request_id="c", model="m", token_texts=token_text)
    builder.on_delta(0, d)
    body = ChatCompletion.model_validate_json(builder.body())
    assert body.choices[0].logprobs.content[1].top_logprobs[1].bytes == [0xE2]


def test_chat_completion_body():
    req = chat(n=2)
    builder = ChatCompletionBuilder(req, request_id="chatcmpl-9", model="m", created=1)
    builder.on_delta(1, delta("Bye", (0,), "length", num_prompt_tokens=4))
    assert not builder.finished
    builder.on_delta(0, delta("Hi ", (1,), num_prompt_tokens=4, num_cached_tokens=2))
    builder.on_delta(0, delta("there", (2, 3), "stop", stop_reason="\n"))
    assert builder.finished
    doc = json.loads(builder.body())
    ChatCompletion.model_validate(doc)
    assert doc["object"] == "chat.completion" and doc["id"] == "chatcmpl-9" and doc["created"] == 1
    assert [c["message"]["content"] for c in doc["choices"]] == ["Hi there", "Bye"]
    assert [c["finish_reason"] for c in doc["choices"]] == ["stop", "length"]
    assert doc["choices"][0]["stop_reason"] == "\n" and doc["choices"][0]["logprobs"] is None
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 2}}


OUTPUT_WITH_CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo, \\"NO\\""}}\n</tool_call>')


def test_chat_completion_body_with_tool_calls():
    builder = ChatCompletionBuilder(chat(tools=TOOLS), request_id="c", model="m")
    builder.on_delta(0, delta(OUTPUT_WITH_CALLS, (0,), "stop"))
    body = ChatCompletion.model_validate_json(builder.body())
    msg = body.choices[0].message
    assert body.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"city": "Paris"}, {"city": 'Oslo, "NO"'}]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    # tool_choice "none": no parsing, the text is content
    builder = ChatCompletionBuilder(chat(tools=TOOLS, tool_choice="none"), request_id="c", model="m")
    builder.on_delta(0, delta(OUTPUT_WITH_CALLS, (0,), "stop"))
    choice = json.loads(builder.body())["choices"][0]
    assert choice["message"]["content"] == OUTPUT_WITH_CALLS and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("seed", range(5))
def test_chat_stream_tool_calls_in_random_chunkings_equal_the_body(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(OUTPUT_WITH_CALLS)), rng.randint(1, 40)))
    pieces = [OUTPUT_WITH_CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT_WITH_CALLS)])]
    state = ChatStreamState(chat(stream=True, tools=TOOLS), request_id="c", model="m")
    out = b"".join(state.on_delta(0, delta(p, (i,), "stop" if i == len(pieces) - 1 else None))
                   for i, p in enumerate(pieces)) + state.finish()
    content, calls = "", {}
    for ev in events(out):
        choice = ChatCompletionChunk.model_validate(ev).choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments]
                assert tc.type == "function"
            else:
                calls[tc.index][2] += tc.function.arguments
        last = choice.finish_reason
    assert last == "tool_calls"
    expected_content, expected = parse_tool_calls(OUTPUT_WITH_CALLS)
    assert content == expected_content
    assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments) for c in expected]
    assert "<" not in content


def test_abort_ends_the_stream_with_an_error_and_fails_the_body():
    state = ChatStreamState(chat(stream=True, stream_options={"include_usage": True}), request_id="c", model="m")
    out = state.on_delta(0, delta("par", (0,))) + state.on_delta(0, delta("", (), "abort"))
    frames = out.split(b"\n\n")
    assert frames[-2] == b"data: [DONE]"
    err = json.loads(frames[-3][6:])["error"]
    assert err["type"] == "server_error" and err["message"]
    assert state.finish() == b""
    builder = ChatCompletionBuilder(chat(), request_id="c", model="m")
    builder.on_delta(0, delta("x", (0,), "abort"))
    with pytest.raises(ProtocolError) as info:
        builder.body()
    assert info.value.status == 503


def test_stream_error_event_shape():
    state = ChatStreamState(chat(stream=True), request_id="c", model="m")
    out = state.error(400, "prompt too long", param="messages", code="context_length_exceeded")
    assert out == (b'data: {"error":{"message":"prompt too long","type":"invalid_request_error","param":"messages",'
                   b'"code":"context_length_exceeded"}}\n\ndata: [DONE]\n\n')
    assert state.error(500, "again") == b"" and state.on_delta(0, delta("x")) == b""


# ---------------------------------------------------------------------------------------------
# completions responses


def _valid_completion_chunk(ev: dict) -> None:
    """Validate against openai.types.Completion; the SDK types finish_reason as non-null, but the real API (and
    the SDK's own stream parsing, which does not validate) sends null on every chunk but a choice's last."""
    for c in ev["choices"]:
        assert c["finish_reason"] in (None, "stop", "length")
    Completion.model_validate({**ev, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                                                 for c in ev["choices"]]})


def test_completion_stream_with_two_prompts_and_usage():
    req = parse_completion_request(json.dumps({"prompt": ["a", "bb"], "n": 2, "stream": True,
                                               "stream_options": {"include_usage": True}}).encode())
    state = CompletionStreamState(req, request_id="cmpl-1", model="m", created=3)
    out = b""
    for index in range(4):
        out += state.on_delta(index, delta(f"x{index}", (index,), "length", num_prompt_tokens=1 + index // 2))
    out += state.finish()
    evs = events(out)
    for ev in evs:
        _valid_completion_chunk(ev)
        assert ev["object"] == "text_completion" and ev["id"] == "cmpl-1" and "usage" in ev
    assert evs[0]["choices"] == [{"index": 0, "text": "x0", "logprobs": None, "finish_reason": None}]
    assert evs[1]["choices"][0]["finish_reason"] == "length" and evs[1]["choices"][0]["text"] == ""
    # each prompt counted once, whatever n
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["prompt_tokens"] == 1 + 2
    assert evs[-1]["usage"]["completion_tokens"] == 4


def test_completion_stream_sends_a_chunk_per_delta_with_tokens_even_without_text():
    """A token id-only engine (skip_tokenizer_init) or a token that ends inside a UTF-8 character has no text yet:
    the stream still shows the step (as vLLM's completions stream does), so a client measures every token's time;
    a delta with neither text nor tokens (a prefill chunk) stays silent."""
    req = parse_completion_request(b'{"prompt": [1, 2], "stream": true}')
    state = CompletionStreamState(req, request_id="c", model="m")
    assert state.on_delta(0, delta("", ())) == b""
    evs = events(state.on_delta(0, delta("", (7,))) + state.on_delta(0, delta("", (8,), "length")) + state.finish())
    texts = [(c["text"], c["finish_reason"]) for ev in evs for c in ev["choices"]]
    assert texts == [("", None), ("", None), ("", "length")]


def test_completion_logprobs_legacy_format():
    req = parse_completion_request(b'{"prompt": "p", "logprobs": 1, "stream": true}')
    d1 = delta("Hello world", (0, 1), logprobs=[-0.5, -0.25], top_ids=[[2, 0], [1, 3]], top_logprobs=[[-0.1, -0.5],
                                                                                                   [-0.25, -2.0]])
    d2 = delta("!", (2,), "stop", logprobs=[-1.0], top_ids=[[2]], top_logprobs=[[-1.0]])
    state = CompletionStreamState(req, request_id="c", model="m", token_texts=token_text)
    evs = events(state.on_delta(0, d1) + state.on_delta(0, d2) + state.finish())
    for ev in evs:
        _valid_completion_chunk(ev)
    assert evs[0]["choices"][0]["logprobs"] == {
        "tokens": ["Hello", " world"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"!": -0.1, "Hello": -0.5}, {" world": -0.25}], "text_offset": [0, 5]}
    assert evs[1]["choices"][0]["logprobs"]["text_offset"] == [11]
    builder = CompletionBuilder(req, request_id="c", model="m", token_texts=token_text)
    builder.on_delta(0, d1)
    builder.on_delta(0, d2)
    body = Completion.model_validate_json(builder.body())
    assert body.choices[0].text == "Hello world!" and body.choices[0].finish_reason == "stop"
    assert body.choices[0].logprobs.tokens == ["Hello", " world", "!"]
    assert body.choices[0].logprobs.text_offset == [0, 5, 11]
    assert body.usage.completion_tokens == 3


def test_completion_body_plain():
    req = parse_completion_request(b'{"prompt": [[1, 2], [3]]}')
    builder = CompletionBuilder(req, request_id="cmpl-2", model="m", created=1)
    builder.on_delta(0, delta("a", (5,), "stop", num_prompt_tokens=2, stop_reason=2))
    builder.on_delta(1, delta("b", (6, 7), "length", num_prompt_tokens=1, num_output_tokens=2))
    doc = json.loads(builder.body())
    Completion.model_validate(doc)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in doc["choices"]] == [(0, "a", "stop"),
                                                                                     (1, "b", "length")]
    assert doc["usage"]["prompt_tokens"] == 3 and doc["usage"]["completion_tokens"] == 3


def test_helpers():
    assert sse_line({"a": [1, None]}) == b'data: {"a":[1,null]}\n\n'
    assert new_response_id(True).startswith("chatcmpl-") and new_response_id(False).startswith("cmpl-")
    texts = TokenTexts(token_text)
    assert texts.get(5) == (" café", list(" café".encode())) and texts.get(4) == ("\ufffd", [0xE2])
    assert msgspec.json.decode(error_body(400, "x"))["error"]["code"] is None


def test_unknown_fields_are_accepted_and_each_name_is_logged_once(caplog):
    body = {"messages": USER, "temperature": 0.5, "my_option_xyz": 1, "another_xyz": {"deep": [1]}}
    with caplog.at_level(logging.WARNING, logger="flotilla.server.protocol"):
        assert parse_chat_request(json.dumps(body)).temperature == 0.5
        parse_completion_request(json.dumps({"prompt": "x", "my_option_xyz": 2}))
    noted = [r.getMessage() for r in caplog.records if "not one this server knows" in r.getMessage()]
    assert len(noted) == 2 and "'my_option_xyz'" in noted[0] and "'another_xyz'" in noted[1]
