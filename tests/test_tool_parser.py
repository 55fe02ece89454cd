"""Hermes / Qwen tool-call parsing: whole outputs, malformed calls, and streams in any chunking."""

from __future__ import annotations

import json
import random
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.server.tool_parsers import HermesToolParser, ToolCall, ToolCallDelta, parse_tool_calls


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str | None, str | None, str]], list[ToolCallDelta]]:
    """Feed ``text`` split at ``cuts``; return (content, [(id, name, arguments)] per index, all deltas)."""
    parser = HermesToolParser()
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    content, deltas = [], []
    for a, b in zip(bounds, bounds[1:]):
        c, d = parser.feed(text[a:b])
        content.append(c)
        deltas.extend(d)
    c, d = parser.finish()
    content.append(c)
    deltas.extend(d)
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls, "a call's header is sent once"
            assert d.index == len(calls), "indices count up from 0"
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.index in calls, "argument text never comes before its header"
        calls[d.index][2] += d.arguments
    return "".join(content), [tuple(calls[i]) for i in range(len(calls))], deltas


def _calls(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_single_call_arguments_are_a_json_string():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None
    assert _calls(calls) == [("get_weather", '{"city": "Paris"}')]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_multiple_calls_with_surrounding_text():
    text = ('I will look both up.\n\n<tool_call>\n{"name": "a", "arguments": {"q": "x}y", "n": [1, {"k": "\\"}"}]}}\n'
            '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n')
    content, calls = parse_tool_calls(text)
    assert content == "I will look both up."
    assert _calls(calls) == [("a", '{"q": "x}y", "n": [1, {"k": "\\"}"}]}'), ("b", "{}")]
    assert json.loads(calls[0].arguments) == {"q": "x}y", "n": [1, {"k": '"}'}]}
    assert len({c.id for c in calls}) == 2


def test_text_after_calls_is_kept():
    content, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\nDone.')
    assert content == "Done." and _calls(calls) == [("a", "{}")]


def test_no_calls_leaves_text_unchanged():
    for text in ["plain answer\n", "a < b and <tool is not a tag", "partial tag at the end <tool_ca", "x </tool_call>"]:
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("") == (None, [])


def test_malformed_body_becomes_content():
    text = "Sure: <tool_call>\n{not json}\n</tool_call> ok"
    assert parse_tool_calls(text) == (text, [])
    # JSON, but not a call
    for body in ['[1, 2]', '{"arguments": {}}', '{"name": 3, "arguments": {}}', '{"name": "", "arguments": {}}']:
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text) == (text, [])


def test_malformed_call_does_not_hide_later_calls():
    text = '<tool_call>oops</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>oops</tool_call>"
    assert _calls(calls) == [("b", '{"x": 1}')]


def _one(body: str) -> list[tuple[str, str]]:
    content, calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert content is None
    return _calls(calls)


def test_other_key_orders_and_string_arguments():
    assert _one('{"arguments": {"a": 1}, "name": "f"}') == [("f", '{"a": 1}')]
    assert _one('{"name": "f", "arguments": "{\\"a\\": 1}"}') == [("f", '{"a": 1}')]
    assert _one('{"name": "f"}') == [("f", "{}")]
    assert _one('{"name": "f", "parameters": {"a": 1}}') == [("f", '{"a": 1}')]
    assert _one('{"name": "caf\\u00e9", "arguments": {}}') == [("café", "{}")]


def test_truncated_call_keeps_what_the_model_wrote():
    # out of tokens inside the arguments: the call stays a call (finish_reason "length" tells the client)
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": [1, 2')
    assert content is None and _calls(calls) == [("f", '{"a": [1, 2')]
    # out of tokens before the call is recognisable: the text is content
    assert parse_tool_calls('ok <tool_call>{"na') == ('ok <tool_call>{"na', [])
    # missing outer brace / missing end tag: the arguments object is complete, so is the call
    assert _one('{"name": "f", "arguments": {"a": 1}') == [("f", '{"a": 1}')]
    assert _calls(parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1]) == [("f", '{"a": 1}')]


def test_streaming_header_then_argument_fragments():
    parser = HermesToolParser()
    assert parser.feed("Let me check. <tool") == ("Let me check.", [])
    assert parser.feed('_call>\n{"name": "get_weather", "argu') == ("", [])
    content, deltas = parser.feed('ments": {"city": "Par')
    assert content == ""
    assert len(deltas) == 1 and deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert deltas[0].arguments == '{"city": "Par'
    assert deltas[0].to_openai()["type"] == "function"
    content, deltas = parser.feed('is"}}\n</tool_c')
    assert content == "" and [(d.index, d.id, d.arguments) for d in deltas] == [(0, None, 'is"}')]
    assert deltas[0].to_openai() == {"index": 0, "function": {"arguments": 'is"}'}}
    assert parser.feed("all>\n") == ("", [])
    assert parser.finish() == ("", [])
    assert _calls(parser.tool_calls) == [("get_weather", '{"city": "Paris"}')]


def test_no_tag_fragment_ever_leaks_into_content():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": "<"}}</tool_call> bye'
    for cut in range(len(text) + 1):
        parser = HermesToolParser()
        first, _ = parser.feed(text[:cut])
        assert "<" not in first, (cut, first)


_CALLS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": ["c", "f"]}}\n</tool_call>',
    '<tool_call>{"name":"f","arguments":{"s":"a}b]c\\"d\\\\","e":{}}}</tool_call>',
    '<tool_call>{"arguments": {"a": 1}, "name": "late_name"}</tool_call>',
    '<tool_call>\n{"name": "s", "arguments": "{\\"x\\": 2}"}\n</tool_call>',
    '<tool_call>not json at all</tool_call>',
    '<tool_call>{"name": "t", "arguments": {"x": "</tool_call>"}}</tool_call>',
    '<tool_call>{"name": "u", "arguments": {"x": 1}',
    '<tool_call>{"name": "v", "arguments": {"y": [1, 2',
    '<tool_call>{"name": "w"',
]
_TEXT = ["Sure.", "\n", "  ", "a < b", "<tool", "</tool_call>", "<tool_cal", "{\"name\": 1}", "émoji 🙂", "x"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(_CALLS) | st.sampled_from(_TEXT), max_size=6),
       cuts=st.lists(st.integers(0, 400), max_size=40))
def test_streaming_equals_whole_text_in_any_chunking(parts, cuts):
    text = "".join(parts)
    content, calls = parse_tool_calls(text)
    streamed_content, streamed_calls, _ = _stream(text, cuts)
    assert (streamed_content or None) == content
    assert [(name, args) for _, name, args in streamed_calls] == _calls(calls)


def test_streaming_one_character_at_a_time_merges_deltas_per_feed():
    text = "".join(_CALLS[:2]) + "tail"
    content, calls, _ = _stream(text, list(range(len(text))))
    assert content == "tail"
    assert [(n, a) for _, n, a in calls] == _calls(parse_tool_calls(text)[1])
    big = HermesToolParser()
    _, merged = big.feed(text)
    assert len(merged) == 2, "one delta per call per feed"


def test_random_long_arguments_stream_intact():
    rng = random.Random(0)
    args = json.dumps({"text": "".join(rng.choice('ab{}[]"\\ <>/\n') for _ in range(2000))})
    text = f'<tool_call>{{"name": "big", "arguments": {args}}}</tool_call>'
    cuts = sorted(rng.sample(range(len(text)), 300))
    _, calls, _ = _stream(text, cuts)
    assert calls[0][1:] == ("big", args) and json.loads(calls[0][2]) == json.loads(args)
