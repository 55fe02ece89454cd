"""The Responses API (POST /v1/responses) through the real server and the official openai client, on the embedded
default model: string and message-list input run as the chat request that means the same (same text, same prompt
tokens); streams in OpenAI's event order, read raw and through `client.responses.stream`; max_output_tokens makes
a response incomplete; function tools called under a required or named tool_choice, and their results sent back;
text.format json_schema; and what the stateless server refuses, in OpenAI's error shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers_optional import require
from helpers_server import start_server

from flotilla.server.protocol import ProtocolError
from flotilla.server.responses import (
    ResponsesBuilder,
    ResponsesStream,
    ResponseState,
    parse_responses_request,
    to_chat_request,
)
from flotilla.transport.messages import SeqText

openai = require("openai", "the server is tested through the real openai client")
pydantic = require("pydantic", "structured outputs are validated with pydantic models")
require("xgrammar", "forced tool calls and text.format are held to their schemas by xgrammar")

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=20)
    population: int
    capital: bool


@pytest.fixture(scope="module")
def server():
    srv = start_server(timeout=300)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _chat(client, messages: list[dict], max_tokens: int, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_string_input_is_the_chat_users_turn(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0, metadata={"run": "1"}, user="u1", store=True)
    chat = _chat(client, [{"role": "user", "content": "What is the capital of France?"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens >= 0
    body = r.model_dump()
    assert body["metadata"] == {"run": "1"} and body["user"] == "u1" and body["store"] is False


def test_message_list_and_instructions_are_the_chat_conversation(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"type": "message", "role": "user", "content": "Another one?"}]
    r = client.responses.create(model=MODEL, input=items, instructions="Answer in one word.", max_output_tokens=8,
                                temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                          {"role": "user", "content": "Another one?"}], 8)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == "Answer in one word."


def test_max_output_tokens_makes_the_response_incomplete(client):
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.max_output_tokens == 3


def test_a_stream_sends_openais_events_in_order(client):
    kw = dict(model=MODEL, input="Tell me about Paris.", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail + [types[-1]], types
    assert types[-1] in ("response.completed", "response.incomplete") and deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    assert "".join(deltas) == events[-4].text == final.output_text == client.responses.create(**kw).output_text
    assert final.usage.output_tokens > 0 and final.id == events[0].response.id


def test_the_stream_helper_parses_a_json_schema_output(client):
    def helper():
        with client.responses.stream(model=MODEL, input="Describe a city.", text_format=City, max_output_tokens=200,
                                     temperature=0) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            return text, stream.get_final_response()

    with ThreadPoolExecutor(2) as pool:  # (both at once: the engine batches them)
        streamed = pool.submit(helper)
        raw = pool.submit(client.responses.create, model=MODEL, input="Describe a city.", max_output_tokens=200,
                          temperature=0, text={"format": {"type": "json_schema", "name": "city", "strict": True,
                                                          "schema": City.model_json_schema()}}).result()
        text, final = streamed.result()
    assert final.status == "completed" and isinstance(final.output_parsed, City)
    assert City.model_validate_json(text) == final.output_parsed
    City.model_validate_json(raw.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_or_named_tool_choice_gives_a_function_call_item(client, stream):
    def respond(choice):
        kw = dict(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=False, max_output_tokens=100, temperature=0)
        if not stream:
            return client.responses.create(**kw)
        events = list(client.responses.create(stream=True, **kw))
        r = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert done == [args] == [r.output[0].arguments]
        return r

    choices = (("required", None), ({"type": "function", "name": "get_time"}, "get_time"))
    with ThreadPoolExecutor(len(choices)) as pool:  # (all at once: the engine batches them)
        responses = list(pool.map(respond, [choice for choice, _ in choices]))
    for (_, name), r in zip(choices, responses):
        assert r.status == "completed" and [item.type for item in r.output] == ["function_call"], r.output
        call = r.output[0]
        assert call.call_id.startswith("call_") and call.name in (name or {"get_weather", "get_time"})
        required = {t["name"]: set(t["parameters"]["required"]) for t in TOOLS}[call.name]
        assert required <= set(json.loads(call.arguments))


def test_function_call_outputs_go_back_as_tool_turns(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(model=MODEL, input=[question], tools=TOOLS, max_output_tokens=40, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}
    second = client.responses.create(model=MODEL, input=[question, *first.output, result], tools=TOOLS,
                                     max_output_tokens=4, temperature=0)
    assert second.output and second.output[0].type in ("message", "function_call")
    chat = _chat(client, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}], 1, tools=[
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS])
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


def test_a_stateless_server_refuses_previous_response_id_and_stored_responses(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_abc", max_output_tokens=2)
    body = err.value.body
    assert body["param"] == "previous_response_id" and body["code"] == "previous_response_not_found"
    assert "keeps no responses" in body["message"] and body["type"] == "invalid_request_error"
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.BadRequestError, match="keeps no responses"):
            call("resp_abc")


def _post(server, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + "/v1/responses", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_malformed_input_is_a_400_naming_it_and_the_server_keeps_serving(server, client):
    cases = [({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
             ({"input": []}, "input"),
             ({"input": 42}, "input"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input[0].content[0].type"),
             ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
             ({"input": "x", "temperature": 5}, "temperature"),
             ({"input": "x", "max_output_tokens": 10**8}, "max_output_tokens"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}},
              "text.format"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema")]
    for body, param in cases:
        status, answer = _post(server, json.dumps({"model": MODEL, **body}).encode())
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
    status, answer = _post(server, b'{"input": "x"')
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens == 2


def _state(body: dict) -> ResponseState:
    req = parse_responses_request(json.dumps(body))
    return ResponseState(req, to_chat_request(req), response_id="resp_1", model=MODEL, tool_parser=None)


def test_an_aborted_sequence_fails_the_response():
    stream = ResponsesStream(_state({"input": "x", "stream": True}))
    out = stream.on_delta(0, SeqText(rid="r", text="Hel", token_ids=[1])) + \
        stream.on_delta(0, SeqText(rid="r", text="", token_ids=[], finish_reason="abort"))
    events = [json.loads(block.split(b"data: ", 1)[1]) for block in out.strip().split(b"\n\n")]
    assert [e["type"] for e in events][-3:] == ["response.output_item.done", "error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    builder = ResponsesBuilder(_state({"input": "x"}))
    builder.on_delta(0, SeqText(rid="r", text="Hel", token_ids=[1], finish_reason="abort"))
    with pytest.raises(ProtocolError) as err:
        builder.body()
    assert err.value.status == 503
