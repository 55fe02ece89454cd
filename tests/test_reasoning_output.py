"""Reasoning through the chat response builders the server uses (server/protocol_output.py), fed SeqText deltas as
the engine sends them: reasoning_content deltas before the content, the message's reasoning_content, tool calls
parsed from the content after the reasoning, the reasoning token count, and when a request gets no parsing."""

from __future__ import annotations

import json
import random

import pytest

from flotilla.server.protocol import parse_chat_request, reads_model_markup, reasoning_parser_for, tool_parser_for
from flotilla.server.protocol_output import SSE_DONE, ChatCompletionBuilder, ChatStreamState
from flotilla.server.reasoning_parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from flotilla.server.tool_parsers import DeepSeekV3ToolParser, Glm45ToolParser
from flotilla.transport.messages import SeqText
from helpers_optional import require

require("openai", "the bodies and chunks are validated against the openai package's types")
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402  (after the skip above)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
OUTPUT = "<think>\nThe user greets me.\n</think>\n\nHello there!"


def chat(**fields):
    return parse_chat_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}))


def deltas(text: str, cuts: list[int]) -> list[SeqText]:
    """The output as the engine sends it: one delta per piece, one token each, the last one finishing."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return [SeqText(rid="r", text=p, token_ids=[i], num_prompt_tokens=3,
                    finish_reason="stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]


def stream_events(req, seq: list[SeqText], **kw) -> list[dict]:
    state = ChatStreamState(req, request_id="c", model="m", **kw)
    out = b"".join(state.on_delta(0, d) for d in seq) + state.finish()
    assert out.endswith(SSE_DONE)
    evs = [json.loads(f[6:]) for f in out[: -len(SSE_DONE)].split(b"\n\n") if f]
    for ev in evs:
        ChatCompletionChunk.model_validate(ev)
    return evs


def body(req, seq: list[SeqText], **kw) -> dict:
    builder = ChatCompletionBuilder(req, request_id="c", model="m", **kw)
    for d in seq:
        builder.on_delta(0, d)
    doc = json.loads(builder.body())
    ChatCompletion.model_validate(doc)
    return doc


def test_stream_sends_reasoning_deltas_before_the_content_and_never_the_tags():
    req = chat(stream=True, stream_options={"include_usage": True})
    evs = stream_events(req, deltas(OUTPUT, list(range(len(OUTPUT)))), reasoning_parser=Qwen3ReasoningParser)
    kinds, reasoning, content = [], "", ""
    for ev in evs[:-1]:
        d = ev["choices"][0]["delta"]
        assert d.get("reasoning_content") == d.get("reasoning")  # vLLM's newer name carries the same text
        if d.get("reasoning_content"):
            kinds.append("r")
            reasoning += d["reasoning_content"]
        if d.get("content"):
            kinds.append("c")
            content += d["content"]
    assert reasoning == "The user greets me." and content == "Hello there!"
    assert kinds == sorted(kinds, reverse=True) and kinds.count("r") > 5  # all reasoning first, streamed piecewise
    assert "think>" not in json.dumps(evs)
    usage = evs[-1]["usage"]
    assert usage["completion_tokens"] == len(OUTPUT)
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < len(OUTPUT) - len("Hello there!") + 1


def test_body_has_reasoning_content_and_the_same_split_as_a_stream():
    req = chat()
    doc = body(req, deltas(OUTPUT, [3, 9, 20, 31, 40]), reasoning_parser=Qwen3ReasoningParser)
    msg = doc["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("The user greets me.",) * 2 + \
        ("Hello there!",)
    assert doc["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5  # the pieces before the content's
    # no thinking in the output: null reasoning, the content untouched
    msg = body(req, deltas(" Hi", [1]), reasoning_parser=Qwen3ReasoningParser)["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] == " Hi"
    # without a reasoning parser nothing changes: the tags are content, no reasoning keys, no details in usage
    doc = body(req, deltas(OUTPUT, [5]))
    assert doc["choices"][0]["message"]["content"] == OUTPUT and "reasoning_content" not in doc["choices"][0]["message"]
    assert "completion_tokens_details" not in doc["usage"]


@pytest.mark.parametrize("seed", range(4))
def test_reasoning_then_tool_calls_stream_and_body_agree(seed):
    calls = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
             '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    text = "I should call the tool.\n</think>\n\nChecking." + calls  # deepseek_r1: <think> opened by the template
    req = chat(stream=True, tools=TOOLS)
    kw = {"reasoning_parser": reasoning_parser_for(req, DeepSeekR1ReasoningParser),
          "tool_parser": tool_parser_for(req, DeepSeekV3ToolParser)}
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(text)), 25)
    reasoning, content, args, finish = "", "", "", None
    for ev in stream_events(req, deltas(text, cuts), **kw):
        choice = ev["choices"][0]
        reasoning += choice["delta"].get("reasoning_content") or ""
        content += choice["delta"].get("content") or ""
        for tc in choice["delta"].get("tool_calls") or []:
            args += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    assert (reasoning, content, json.loads(args), finish) == ("I should call the tool.", "Checking.",
                                                             {"city": "Paris"}, "tool_calls")
    doc = body(chat(tools=TOOLS), deltas(text, cuts), **kw)
    msg = doc["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')] and doc["choices"][0]["finish_reason"] == "tool_calls"


def test_a_tool_call_the_model_writes_inside_its_reasoning_is_not_a_call():
    text = "<think><tool_call>get_weather<arg_key>city</arg_key><arg_value>X</arg_value></tool_call></think>Done."
    req = chat(tools=TOOLS)
    doc = body(req, deltas(text, [7, 30]), reasoning_parser=Qwen3ReasoningParser,
               tool_parser=tool_parser_for(req, Glm45ToolParser))
    msg = doc["choices"][0]["message"]
    assert msg["content"] == "Done." and "tool_calls" not in msg and msg["reasoning_content"].startswith("<tool_call>")


def test_which_requests_get_reasoning_parsing():
    assert reasoning_parser_for(chat(), Qwen3ReasoningParser) is Qwen3ReasoningParser
    assert reasoning_parser_for(chat(), None) is None
    assert reasoning_parser_for(chat(chat_template_kwargs={"enable_thinking": False}), Qwen3ReasoningParser) is None
    assert reasoning_parser_for(chat(chat_template_kwargs={"thinking": False}), DeepSeekR1ReasoningParser) is None
    # a grammar holds only the answer after the reasoning (as in vLLM): the reasoning is still parsed
    assert reasoning_parser_for(chat(response_format={"type": "json_object"}), DeepSeekR1ReasoningParser) \
        is DeepSeekR1ReasoningParser
    assert reasoning_parser_for(chat(tools=TOOLS, tool_choice="required"), DeepSeekR1ReasoningParser) \
        is DeepSeekR1ReasoningParser
    # which requests read the model's own markup (and so need its special tokens kept)
    assert reads_model_markup(chat(), Qwen3ReasoningParser) and reads_model_markup(chat(tools=TOOLS), None)
    assert not reads_model_markup(chat(), None) and not reads_model_markup(chat(tools=TOOLS, tool_choice="none"), None)
    assert not reads_model_markup(chat(tools=TOOLS, tool_choice="required"), None)


def test_reasoning_only_output_has_null_content():
    doc = body(chat(), deltas("thinking, then out of tokens", [4]), reasoning_parser=DeepSeekR1ReasoningParser)
    msg = doc["choices"][0]["message"]
    assert msg["reasoning_content"] == "thinking, then out of tokens" and msg["content"] is None
