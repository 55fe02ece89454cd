"""Malformed, oversized and hostile request bodies against a real `flotilla serve`: each one is a 4xx in OpenAI's
error shape, never a 5xx, and the server still answers the same greedy text afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_server import start_server

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
DEEP = 100_000


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, **kw}


def cmpl(**kw):
    return {"model": MODEL, "prompt": "hi", **kw}


BAD: list[tuple[str, str, object]] = [
    # not JSON, or not an object
    ("empty body", CHAT, b""),
    ("truncated", CHAT, b'{"model": "x", "messages": ['),
    ("trailing garbage", CHAT, json.dumps(chat()).encode() + b"}}"),
    ("NaN", CMPL, b'{"prompt": "hi", "temperature": NaN}'),
    ("invalid utf-8", CMPL, b'{"prompt": "\xff\xfe"}'),
    ("lone surrogate", CMPL, b'{"prompt": "\\ud800"}'),
    ("root array", CHAT, b"[1, 2, 3]"),
    ("root string", CMPL, b'"hello"'),
    ("root null", CMPL, b"null"),
    ("deep array", CMPL, b"[" * DEEP + b"]" * DEEP),
    ("deep metadata", CMPL, b'{"prompt": "hi", "metadata": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}"),
    ("deep tools", CMPL, b'{"prompt": "hi", "tools": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("deep user", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "user": ' + b"[" * DEEP + b"]" * DEEP
     + b"}"),
    # missing and wrong types
    ("no messages", CHAT, {"model": MODEL}),
    ("no prompt", CMPL, {"model": MODEL}),
    ("messages not a list", CHAT, {"model": MODEL, "messages": "hi"}),
    ("message not an object", CHAT, {"model": MODEL, "messages": ["hi"]}),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}),
    ("unknown role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("no role", CHAT, {"model": MODEL, "messages": [{"content": "x"}]}),
    ("content a number", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
    ("content part without text", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("unknown content part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
    ("temperature a string", CHAT, chat(temperature="hot")),
    ("max_tokens a float", CMPL, cmpl(max_tokens=1.5)),
    ("max_tokens a string", CMPL, cmpl(max_tokens="10")),
    ("stream a string", CMPL, cmpl(stream="yes")),
    ("n a list", CMPL, cmpl(n=[1])),
    ("stop a number", CMPL, cmpl(stop=5)),
    ("stop list of numbers", CMPL, cmpl(stop=[1, 2])),
    ("seed a float", CMPL, cmpl(seed=1.5)),
    ("prompt a number", CMPL, {"model": MODEL, "prompt": 5}),
    ("prompt mixed list", CMPL, {"model": MODEL, "prompt": ["a", 1]}),
    ("prompt empty string", CMPL, {"model": MODEL, "prompt": ""}),
    ("prompt empty list", CMPL, {"model": MODEL, "prompt": []}),
    ("prompt list with an empty list", CMPL, {"model": MODEL, "prompt": [[1, 2], []]}),
    ("prompt nested too deep", CMPL, {"model": MODEL, "prompt": [[[1]]]}),
    ("model a number", CHAT, {"model": 5, "messages": MSGS}),
    ("tools not a list", CHAT, chat(tools={"type": "function"})),
    ("tool without function", CHAT, chat(tools=[{"type": "function"}])),
    ("tool with empty name", CHAT, chat(tools=[{"type": "function", "function": {"name": ""}}])),
    ("tool_choice without tools", CHAT, chat(tool_choice="auto")),
    ("tool_choice unknown function", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                tool_choice={"type": "function", "function": {"name": "g"}})),
    # out of range
    ("temperature too high", CHAT, chat(temperature=7)),
    ("temperature negative", CHAT, chat(temperature=-1)),
    ("top_p zero", CHAT, chat(top_p=0)),
    ("top_p above one", CHAT, chat(top_p=1.5)),
    ("min_p above one", CMPL, cmpl(min_p=2)),
    ("presence_penalty", CHAT, chat(presence_penalty=3)),
    ("frequency_penalty", CHAT, chat(frequency_penalty=-3)),
    ("repetition_penalty zero", CMPL, cmpl(repetition_penalty=0)),
    ("n zero", CMPL, cmpl(n=0)),
    ("n huge", CMPL, cmpl(n=10**6)),
    ("max_tokens zero", CMPL, cmpl(max_tokens=0)),
    ("max_tokens negative", CMPL, cmpl(max_tokens=-5)),
    ("max_tokens beyond the context", CMPL, cmpl(max_tokens=9000)),
    ("max_tokens beyond 64 bits", CMPL, cmpl(max_tokens=10**30)),
    ("max_tokens beyond 32 bits", CMPL, cmpl(max_tokens=2**40)),
    ("max_completion_tokens beyond 64 bits", CHAT, chat(max_completion_tokens=10**30)),
    ("min_tokens beyond 64 bits", CMPL, cmpl(min_tokens=10**30)),
    ("min_tokens negative", CMPL, cmpl(min_tokens=-1)),
    ("top_k below -1", CMPL, cmpl(top_k=-2)),
    ("top_k beyond 64 bits", CMPL, cmpl(top_k=10**30)),
    ("seed beyond 64 bits", CMPL, cmpl(seed=2**64)),
    ("priority beyond 64 bits", CMPL, cmpl(priority=10**30)),
    ("temperature beyond float", CMPL, b'{"prompt": "hi", "temperature": 1e999}'),
    ("logprobs too many", CMPL, cmpl(logprobs=100)),
    ("logprobs beyond 32 bits", CMPL, cmpl(logprobs=2**40)),
    ("top_logprobs too many", CHAT, chat(logprobs=True, top_logprobs=100)),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2)),
    ("token id negative", CMPL, {"model": MODEL, "prompt": [1, -1]}),
    ("token id beyond the vocabulary", CMPL, {"model": MODEL, "prompt": [1, 10**6]}),
    ("token id beyond 32 bits", CMPL, {"model": MODEL, "prompt": [1, 2**40]}),
    ("token id beyond 64 bits", CMPL, {"model": MODEL, "prompt": [1, 10**30]}),
    ("stop_token_ids beyond 32 bits", CMPL, cmpl(stop_token_ids=[2**40])),
    ("stop_token_ids negative", CMPL, cmpl(stop_token_ids=[-3])),
    ("empty stop string", CMPL, cmpl(stop=[""])),
    ("prompt too long", CMPL, cmpl(prompt="hello " * 9000)),
    # what this server does not do
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True})),
    ("logit_bias key not a token id", CMPL, cmpl(logit_bias={"abc": 5})),
    ("logit_bias value beyond 100", CMPL, cmpl(logit_bias={"1": 500})),
    ("echo in chat", CHAT, chat(echo=True)),
    ("suffix", CMPL, cmpl(suffix="x")),
    ("best_of other than n", CMPL, cmpl(best_of=3)),
    ("functions", CHAT, chat(functions=[{"name": "f"}])),
    ("image URL of a host not allowed", CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("image for a model without images", CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}]}]}),
    ("unknown model", CHAT, chat(model="gpt-9")),
    ("body too large", CMPL, b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}'),
]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--kv-cache-blocks", "512", "--max-model-len", "8192")
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def greedy(server) -> str:
    r = httpx.post(server.url + CHAT, json=chat(temperature=0, max_tokens=8), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def post(server, path: str, body: object) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
    return httpx.post(server.url + path, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_openai_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err


def test_every_malformed_request_is_a_4xx_and_the_server_keeps_its_answers(server):
    assert len({name for name, _, _ in BAD}) == len(BAD) >= 60
    before = greedy(server)
    failures = []
    for name, path, body in BAD:
        r = post(server, path, body)
        try:
            assert_openai_error(r)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert failures == []
    assert greedy(server) == before
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_image_for_a_text_model_is_a_400_naming_the_part(server):
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}]
    r = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and "takes no images" in err["message"], err


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
          "stream", "logprobs", "top_logprobs", "tools", "tool_choice", "stop_token_ids", "min_tokens", "priority",
          "response_format", "user", "metadata", "stream_options"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(path=st.sampled_from([CHAT, CMPL]), body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
       with_input=st.booleans())
def test_no_generated_body_gets_a_server_error(server, path, body, with_input):
    if with_input:  # half the bodies carry a valid input, so the other fields' checks are reached
        body = {**({"messages": MSGS} if path == CHAT else {"prompt": "hi"}), **body, "max_tokens": 2}
    r = post(server, path, body)
    assert r.status_code < 500, (body, r.text[:500])
    if r.status_code >= 400:
        assert_openai_error(r)
