"""vLLM's routes beside the OpenAI ones, through the real server on the default model: /tokenize (a prompt, or chat
messages rendered as the engine renders them), /detokenize, /v1/models/{id}, /version; their bad input is a 400 or
404 in OpenAI's shape. And what vLLM users' dashboards and logs read: /metrics under vLLM's names, and the
periodic stats line while the engine is busy."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from helpers_optional import require
from helpers_server import start_server

openai = require("openai", "chat completions are compared through the real openai client")

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    srv = start_server("--log-stats-interval", "0.2", timeout=300)
    try:
        yield srv
    finally:
        srv.stop()


def _call(server, path: str, body: dict | None = None) -> tuple[int, dict]:
    base = server.url.removesuffix("/v1")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_tokenize_and_detokenize_round_trip_a_prompt(server):
    status, out = _call(server, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"]
    status, back = _call(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and back["prompt"].endswith("Hello world")


def test_tokenized_messages_are_the_prompt_the_engine_runs(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    status, out = _call(server, "/tokenize", {"model": MODEL, "messages": messages,
                                              "chat_template_kwargs": {"enable_thinking": False}})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert status == 200 and out["count"] == usage.prompt_tokens
    _, bare = _call(server, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert bare["count"] < out["count"]  # without the assistant turn's opener


def test_the_default_models_template_is_reported_to_ignore_tools(server):
    """SmolLM2's chat template drops `tools`: the server says so once at start, and what to do about it."""
    warnings = [line for line in server.log if "ignores `tools`" in line]
    assert len(warnings) == 1 and "--chat-template" in warnings[0], "".join(server.log[-40:])


def test_model_version_and_errors(server):
    assert _call(server, f"/v1/models/{MODEL}") == (200, {**_call(server, "/v1/models")[1]["data"][0]})
    assert _call(server, "/version")[1]["version"]
    status, body = _call(server, "/v1/models/nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, "messages"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens")):
        status, body = _call(server, path, bad)
        assert status == 400 and body["error"]["param"] == param, (path, bad, body)
    status, body = _call(server, "/tokenize", {"model": "nope", "prompt": "a"})
    assert status == 404


def test_vllm_metric_names_and_the_stats_line(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = "Once upon a time, in a land of rivers and hills, " * 4  # (two full KV blocks and more)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    values = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
              if line.startswith("vllm:")}
    label = f'{{model_name="{MODEL}"}}'
    assert values[f"vllm:request_success_total{{finished_reason=\"length\",model_name=\"{MODEL}\"}}"] >= 2
    assert values[f"vllm:generation_tokens_total{label}"] >= 16
    assert values[f"vllm:prompt_tokens_total{label}"] == values[f"vllm:request_prompt_tokens_sum{label}"] > 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_generation_tokens"):
        assert values[f"vllm:{name}_count{label}"] >= 2, name
    assert values[f"vllm:prefix_cache_hits_total{label}"] > 0  # the second prompt hit the first one's blocks
    assert f"vllm:kv_cache_usage_perc{label}" in values and f"vllm:num_requests_running{label}" in values
    deadline = time.monotonic() + 30
    while not any("Avg generation throughput" in line for line in server.log):
        assert time.monotonic() < deadline, "no stats line while the engine was busy"
        time.sleep(0.05)
