"""The OpenAI server as users meet it: a real `flotilla serve` process on the default model, the official
`openai` client (sync and async), raw SSE, bad input, disconnects, backpressure, API keys, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers_optional import needs, optional
from helpers_server import Server, start_server
from helpers_procs import alive

openai = optional("openai")
needs_openai = needs("openai", "the test talks to the server through the real openai client")

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--kv-cache-blocks", "1024", "--max-num-seqs", "64")
    children = srv.child_pids()
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])
    assert not [p for p in children if alive(p)], "an engine process outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@needs_openai
def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server, "flotilla_kv_cache_capacity_tokens") == 1024 * 16


def test_sigusr1_prints_the_threads_and_the_event_loops_tasks_and_the_server_goes_on(server):
    """`kill -USR1` (what tests/helpers_server.py sends a server that does not stop): every thread's stack, then the
    stack of every task of the event loop (a loop idling on an await that never resolves says which)."""
    import os
    import signal

    start = len(server.log)
    os.kill(server.proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = "".join(server.log[start:])
        if "Current thread" in new and "Stack for <Task" in new and "serve" in new:
            break
        time.sleep(0.05)
    new = "".join(server.log[start:])
    assert "Current thread" in new and "Stack for <Task" in new, new[-3000:]
    assert httpx.get(server.url + "/health").status_code == 200


@needs_openai
def test_chat_streaming_and_not_agree_and_report_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert full.usage.prompt_tokens > 10 and full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@needs_openai
def test_async_client_completions_n_seed_stop_and_logprobs(server):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        prompt = "The capital of France is"
        plain = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
        stream = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True)
        streamed = "".join([ch.choices[0].text async for ch in stream])
        assert streamed == plain.choices[0].text
        two = await c.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, n=2, max_tokens=8)
        again = await c.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=7, n=2, max_tokens=8)
        assert [x.text for x in two.choices] == [x.text for x in again.choices]
        assert two.choices[0].text != two.choices[1].text and [x.index for x in two.choices] == [0, 1]
        stop = plain.choices[0].text.strip().split()[0]
        cut = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
        lp = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4, logprobs=2)
        assert len(lp.choices[0].logprobs.tokens) == 4 and all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
        chat = await c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=4,
                                               logprobs=True, top_logprobs=3)
        content = chat.choices[0].logprobs.content
        assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
        assert "".join(t.token for t in content) == chat.choices[0].message.content
        await c.close()

    asyncio.run(main())


@needs_openai
def test_tools_are_accepted_and_tool_turns_render(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [*FRANCE, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="auto",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_raw_sse_wire_format(server):
    body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" in c for c in chunks)  # null on every chunk but the last, as OpenAI does


@needs_openai
def test_50_concurrent_streams_each_get_exactly_their_own_output(server):
    """50 streams at once get what the same questions get in small groups (10 at a time, not streamed): batch
    composition and timing differ completely between the two runs, so a mix-up would have to repeat itself."""
    questions = [f"Count from {i} to {i + 3}." for i in range(50)]

    async def ask(group: list[str], stream: bool) -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(q):
            r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                temperature=0, max_tokens=6, stream=stream)
            if not stream:
                return r.choices[0].message.content
            return "".join([ch.choices[0].delta.content or "" async for ch in r if ch.choices])

        out = await asyncio.gather(*(one(q) for q in group))
        await c.close()
        return out

    concurrent = asyncio.run(ask(questions, stream=True))
    in_tens = [a for i in range(0, 50, 10) for a in asyncio.run(ask(questions[i:i + 10], stream=False))]
    assert concurrent == in_tens
    assert len(set(in_tens)) > 10  # distinct prompts, distinct answers: nothing was mixed up


def test_a_disconnect_mid_stream_frees_the_sequence(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert metric(server, "flotilla_num_requests_running") >= 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server, "flotilla_num_requests_running") == 0 and metric(server, "flotilla_kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert metric(server, "flotilla_num_requests_running") == 0
    assert metric(server, "flotilla_kv_cache_usage_perc") == 0
    assert metric(server, "flotilla_generation_tokens_total") < 2000  # it did not run to the end


def _until_idle(server: Server) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (metric(server, "flotilla_num_requests_running") != 0
                                           or metric(server, "flotilla_kv_cache_usage_perc") != 0):
        time.sleep(0.1)


def test_an_abandoned_non_streaming_request_is_aborted(server):
    """A client that goes away before a non-streaming answer: the request stops, it does not run to its end."""
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while metric(server, "flotilla_num_requests_running") == 0:  # it is running
            assert time.monotonic() < deadline
            time.sleep(0.05)
    started = time.monotonic()
    _until_idle(server)
    assert metric(server, "flotilla_num_requests_running") == 0
    assert metric(server, "flotilla_kv_cache_usage_perc") == 0
    assert time.monotonic() - started < 20  # stopped: 2,000 tokens take far longer on a CPU


def test_a_client_gone_while_sending_its_body_is_no_server_error(server):
    lines = len(server.log)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "hel')
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    log = "".join(server.log[lines:])
    assert "Traceback" not in log and "unhandled error" not in log, log


BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    ("wrong type", "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "temperature": "hot"}, 400, "temperature"),
    ("out of range", "/v1/chat/completions", {"model": MODEL, "messages": FRANCE, "temperature": 7}, 400, "temperature"),
    ("no messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": FRANCE}, 404, None),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400, "prompt"),
    ("max_tokens too large", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400, "max_tokens"),
    ("bad n", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("body too large", "/v1/completions", b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}', 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
@needs_openai
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, client, name, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={"content-type": "application/json"}, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    ok = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=1)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_unknown_routes_and_methods_answer_in_openai_shape(server):
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


@needs_openai
def test_api_key_backpressure_and_sigterm_drain():
    srv = start_server("--api-key", "sekret", "--max-in-flight", "2", "--kv-cache-blocks", "256")
    children = srv.child_pids()
    try:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert c.models.list().data[0].id == MODEL

        async def burst():
            ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)

            async def one():
                try:
                    await ac.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=24,
                                                extra_body={"ignore_eos": True})
                    return 200
                except openai.RateLimitError as e:
                    assert e.response.headers["retry-after"] == "1"
                    return 429

            codes = await asyncio.gather(*(one() for _ in range(6)))
            await ac.close()
            return codes

        codes = asyncio.run(burst())
        assert codes.count(200) >= 2 and codes.count(429) >= 1

        # SIGTERM while a stream is running: the stream still finishes, then every process exits
        result: dict[str, object] = {}
        started = threading.Event()

        def consume():
            chunks = []
            for ch in c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=20, stream=True,
                                                extra_body={"ignore_eos": True}):
                chunks.append(ch)
                started.set()
            result["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]

        t = threading.Thread(target=consume)
        t.start()
        assert started.wait(timeout=60)  # the signal arrives mid-stream
        code = srv.stop()
        t.join(timeout=60)
        assert result.get("finish") == "length", result
        assert code == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert not [p for p in children if alive(p)]


def test_serve_refuses_a_busy_port_before_loading_anything():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "flotilla", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "starting the engine" not in r.stderr


def test_a_model_without_tokenizer_files_serves_token_id_prompts_with_skip_tokenizer_init(tmp_path):
    from helpers_tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", "llama")
    srv = start_server(str(model), "--skip-tokenizer-init", "--single-process", "--kv-cache-blocks", "64",
                       "--block-size", "4")
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                                 **{k: v for k, v in body["usage"].items() if k.endswith("details")}}
        tokens = body["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 6 and all(re.fullmatch(r"token_id:\d+", t) for t in tokens), tokens
        for path, payload in (("/v1/chat/completions", {"model": "tiny", "messages": FRANCE}),
                              ("/tokenize", {"model": "tiny", "prompt": "hello"}),
                              ("/v1/completions", {"model": "tiny", "prompt": "a text prompt"})):
            r = httpx.post(srv.url + path, json=payload, timeout=60)
            assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"], (path, r.text)
    finally:
        assert srv.stop() == 0, "".join(srv.log[-30:])
