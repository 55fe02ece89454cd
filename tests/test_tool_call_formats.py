"""The tool-call formats beside Hermes: DeepSeek-V3 (and V3.1), Kimi-K2 and GLM-4.5/4.7/5, whole outputs and streams in
any chunking, one call and several, text around them, arguments arriving piecewise, and malformed output that falls
back to content."""

from __future__ import annotations

import functools
import json
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.server.protocol_types import ToolDefinition
from flotilla.server.tool_parsers import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    Glm45ToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    parse_tool_calls,
)

DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                    "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
K_SECTION, K_CALL, K_ARGS, K_END, K_SECTION_END = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                   "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                                   "<|tool_calls_section_end|>")


def ds_call(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_END}"


def ds31_call(name: str, args: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_END}"


def kimi_call(name: str, index: int, args: str) -> str:
    return f"{K_CALL}functions.{name}:{index}{K_ARGS}{args}{K_END}"


def glm_call(name: str, pairs: list[tuple[str, str]], newlines: bool = True) -> str:
    sep = "\n" if newlines else ""
    body = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in pairs)
    return f"<tool_call>{name}{sep}{body}</tool_call>"


def stream(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str, str]], int]:
    """Feed ``text`` split at ``cuts``; (content, [(id, name, arguments)], number of argument fragments)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    content, deltas = [], []
    for a, b in zip(bounds, bounds[1:]):
        c, d = parser.feed(text[a:b])
        content.append(c)
        deltas.extend(d)
    c, d = parser.finish()
    content.append(c)
    deltas.extend(d)
    calls: dict[int, list[str]] = {}
    fragments = 0
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.index == len(calls), "one header per call, indices from 0"
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.index in calls, "argument text never comes before its header"
        calls[d.index][2] += d.arguments
        fragments += bool(d.arguments)
    return "".join(content), [tuple(calls[i]) for i in range(len(calls))], fragments


def whole(parser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, parser)
    return content, [(c.name, c.arguments) for c in calls]


def test_the_registry_names_are_vllms():
    assert TOOL_PARSERS["hermes"] is HermesToolParser and TOOL_PARSERS["deepseek_v3"] is DeepSeekV3ToolParser
    assert TOOL_PARSERS["kimi_k2"] is KimiK2ToolParser and TOOL_PARSERS["glm45"] is TOOL_PARSERS["glm47"]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3


def test_deepseek_v3_one_and_several_calls_with_text_before():
    text = DS_CALLS + ds_call("get_weather", '{"city": "Paris"}') + DS_CALLS_END
    assert whole(DeepSeekV3ToolParser, text) == (None, [("get_weather", '{"city": "Paris"}')])
    text = ("Let me look.\n\n" + DS_CALLS + ds_call("a", '{"x": [1, {"y": "}"}]}') + "\n"
            + ds_call("b", "{}") + DS_CALLS_END)
    content, calls = whole(DeepSeekV3ToolParser, text)
    assert content == "Let me look." and calls == [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")]
    assert json.loads(calls[0][1]) == {"x": [1, {"y": "}"}]}


def test_deepseek_v3_streams_the_header_then_argument_pieces():
    p = DeepSeekV3ToolParser()
    assert p.feed("Sure. <｜tool▁calls") == ("Sure.", [])
    assert p.feed("▁begin｜>" + DS_CALL + "function" + DS_SEP + "get_weather\n```js") == ("", [])
    content, deltas = p.feed('on\n{"city": "Pa')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_weather", '{"city": "Pa')]
    assert deltas[0].id.startswith("call_")
    assert p.feed('ris"}\n``')[1][0].arguments == 'ris"}'
    assert p.feed("`" + DS_END + DS_CALLS_END) == ("", [])
    assert p.finish() == ("", [])
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_deepseek_v3_malformed_and_truncated_output():
    # no tool-call markup: the text is content, untouched
    for text in ["plain\n", "a <｜tool▁call that is not one", "fence ```json\n{}\n```"]:
        assert whole(DeepSeekV3ToolParser, text) == (text, [])
    # a call whose header cannot be read goes out as content; a later good call is still found
    bad = DS_CALL + "no separator here" + DS_END
    content, calls = whole(DeepSeekV3ToolParser, "x\n" + DS_CALLS + bad + ds_call("f", '{"a": 1}') + DS_CALLS_END)
    assert content == "x\n" + bad and calls == [("f", '{"a": 1}')]  # (its whitespace given back)
    # out of tokens inside the arguments: the call keeps what the model wrote
    assert whole(DeepSeekV3ToolParser, DS_CALLS + DS_CALL + "function" + DS_SEP + 'f\n```json\n{"a": [1') == \
        (None, [("f", '{"a": [1')])
    # out of tokens inside the header: content
    assert whole(DeepSeekV3ToolParser, DS_CALLS + DS_CALL + "function" + DS_SEP + "f") == \
        (DS_CALL + "function" + DS_SEP + "f", [])
    # text after the section is content too
    assert whole(DeepSeekV3ToolParser, DS_CALLS + ds_call("f", "{}") + DS_CALLS_END + "\n done") == \
        ("done", [("f", "{}")])


def test_deepseek_v31_calls():
    text = "ok" + DS_CALLS + ds31_call("f", '{"a": 1}') + ds31_call("g", '{"b": "2"}') + DS_CALLS_END
    assert whole(DeepSeekV31ToolParser, text) == ("ok", [("f", '{"a": 1}'), ("g", '{"b": "2"}')])


# ---------------------------------------------------------------------------------------------
# Kimi-K2


def test_kimi_k2_calls_keep_the_models_ids():
    text = ("I'll check both." + K_SECTION + kimi_call("get_weather", 0, '{"city": "Paris"}')
            + kimi_call("get_time", 1, '{"tz": "CET"}') + K_SECTION_END)
    content, calls = parse_tool_calls(text, KimiK2ToolParser)
    assert content == "I'll check both."
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris"}'), ("functions.get_time:1", "get_time",
                                                                         '{"tz": "CET"}')]


def test_kimi_k2_streams_and_falls_back():
    p = KimiK2ToolParser()
    assert p.feed(K_SECTION + K_CALL + "functions.f:0") == ("", [])
    content, deltas = p.feed(K_ARGS + '{"q": "a')
    assert [(d.id, d.name, d.arguments) for d in deltas] == [("functions.f:0", "f", '{"q": "a')]
    assert p.feed('b"}' + K_END)[1][0].arguments == 'b"}'
    assert p.feed(K_SECTION_END) == ("", []) and p.finish() == ("", [])
    # a call without its section's opening marker is read all the same; an unreadable header is content
    assert whole(KimiK2ToolParser, kimi_call("f", 0, "{}")) == (None, [("f", "{}")])
    bad = K_CALL + "nonsense" + K_END
    assert whole(KimiK2ToolParser, K_SECTION + bad + K_SECTION_END) == (bad, [])


# ---------------------------------------------------------------------------------------------
# GLM-4.5 / 4.7 / 5

GLM_TOOLS = msgspec.convert([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}], list[ToolDefinition])


def test_glm_arguments_become_a_json_object_with_types():
    glm = functools.partial(Glm45ToolParser, GLM_TOOLS)
    text = "Checking.\n" + glm_call("get_weather", [("city", "Paris"), ("days", "3"), ("zip", "75001")])
    content, calls = whole(glm, text)
    assert content == "Checking."
    assert calls == [("get_weather", '{"city": "Paris", "days": 3, "zip": "75001"}')]  # zip typed string stays one
    # without a schema: JSON values keep their type, anything else is a string
    text = glm_call("f", [("n", "75001"), ("flag", "true"), ("obj", '{"a": [1]}'), ("s", "two words"),
                          ("nl", "line1\nline2")])
    assert json.loads(whole(Glm45ToolParser, text)[1][0][1]) == {
        "n": 75001, "flag": True, "obj": {"a": [1]}, "s": "two words", "nl": "line1\nline2"}


def test_glm47_layout_several_calls_and_no_arguments():
    text = (glm_call("a", [("x", "1")], newlines=False) + "\n" + glm_call("b", [], newlines=False)
            + glm_call("c", [("y", "<b>bold</b>")], newlines=False) + "\nDone.")
    assert whole(Glm45ToolParser, text) == ("Done.", [("a", '{"x": 1}'), ("b", "{}"), ("c", '{"y": "<b>bold</b>"}')])


def test_glm_streams_a_pair_at_a_time():
    p = Glm45ToolParser()
    assert p.feed("Hi <tool_") == ("Hi", [])
    assert p.feed("call>get_weather\n<arg_k") == ("", [])
    content, deltas = p.feed("ey>city</arg_key>\n<arg_value>Par")
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_weather", "")]
    assert p.feed("is</arg_value>\n")[1][0].arguments == '{"city": "Paris"'
    assert p.feed("<arg_key>days</arg_key><arg_value>2</arg_value>")[1][0].arguments == ', "days": 2'
    assert p.feed("</tool_call>")[1][0].arguments == "}"
    assert p.finish() == ("", [])


def test_glm_malformed_and_truncated_output():
    for text in ["plain", "<tool_call>{\"name\": \"hermes style\"}</tool_call>", "<tool_call>two words</tool_call>"]:
        assert whole(Glm45ToolParser, text) == (text, [])
    # a bad call does not hide the next one
    bad = "<tool_call>bad call</tool_call>"
    assert whole(Glm45ToolParser, "a " + bad + glm_call("f", [("k", "v")])) == ("a " + bad, [("f", '{"k": "v"}')])
    # text that is no argument inside a call is skipped; the arguments stay a JSON object
    assert whole(Glm45ToolParser, "<tool_call>f\n<arg_key>a</arg_key>junk<arg_key>b</arg_key><arg_value>2"
                                  "</arg_value></tool_call>") == (None, [("f", '{"b": 2}')])
    # out of tokens: mid-value the call closes with the pairs it has; before the name is done it is content
    assert whole(Glm45ToolParser, glm_call("f", [("a", "1")])[:-len("</tool_call>")] + "<arg_key>b</arg_key>"
                 "<arg_value>unfini") == (None, [("f", '{"a": 1}')])
    assert whole(Glm45ToolParser, "x <tool_call>get_wea") == ("x <tool_call>get_wea", [])


# ---------------------------------------------------------------------------------------------
# every format: a stream in any chunking says what the whole text says

FORMATS = {
    "deepseek_v3": (DeepSeekV3ToolParser, [
        DS_CALLS + ds_call("get_weather", '{"city": "Paris", "u": ["c"]}') + "\n" + ds_call("b", '{"s": "a}b\\""}')
        + DS_CALLS_END,
        DS_CALLS + DS_CALL + "junk" + DS_END + DS_CALLS_END,
        DS_CALLS + ds_call("t", '{"x": 1'),
        DS_CALL + "function" + DS_SEP + "w",
    ]),
    "deepseek_v31": (DeepSeekV31ToolParser, [DS_CALLS + ds31_call("f", '{"a": "```"}') + DS_CALLS_END]),
    "kimi_k2": (KimiK2ToolParser, [
        K_SECTION + kimi_call("f", 0, '{"a": {"b": "}"}}') + kimi_call("g", 1, "[1]") + K_SECTION_END,
        K_SECTION + K_CALL + "oops" + K_END + K_SECTION_END,
        K_SECTION + kimi_call("f", 2, '{"a": 1')[: -len(K_END)],
    ]),
    "glm45": (Glm45ToolParser, [
        glm_call("get_weather", [("city", "Paris"), ("n", "2")]),
        glm_call("f", [("s", "a</arg_key>b"), ("o", '{"x": 1}')], newlines=False),
        "<tool_call>oops</tool_call>",
        "<tool_call>f<arg_key>a</arg_key><arg_value>1",
    ]),
}
TEXT = ["Sure.", "\n", "  ", "a < b", "<", "émoji 🙂", "x", "```"]


@pytest.mark.parametrize("name", list(FORMATS))
def test_streaming_equals_whole_text_in_any_chunking(name):
    parser, calls = FORMATS[name]

    @settings(max_examples=150, deadline=None)
    @given(parts=st.lists(st.sampled_from(calls) | st.sampled_from(TEXT), max_size=5),
           cuts=st.lists(st.integers(0, 300), max_size=30))
    def check(parts, cuts):
        text = "".join(parts)
        content, expected = whole(parser, text)
        got_content, got, _ = stream(parser(), text, cuts)
        assert (got_content or None) == content
        assert [(n, a) for _, n, a in got] == expected

    check()


@pytest.mark.parametrize("name", list(FORMATS))
def test_one_character_at_a_time_streams_arguments_in_pieces_and_leaks_no_markup(name):
    parser, calls = FORMATS[name]
    text = "Before. " + calls[0] + "\nAfter."
    content, expected = whole(parser, text)
    got_content, got, fragments = stream(parser(), text, list(range(len(text))))
    assert got_content == content == "Before.After."  # (the whitespace around calls only separates)
    assert [(n, a) for _, n, a in got] == expected and len(expected) >= 1
    assert fragments > len(expected), "arguments arrive in more than one piece per call"
    for cut in range(len(text) + 1):  # no prefix of any markup reaches the content
        head, _ = parser().feed(text[:cut])
        assert "<" not in head and "｜" not in head, (cut, head)


def test_random_long_arguments_stream_intact():
    rng = random.Random(0)
    args = json.dumps({"text": "".join(rng.choice('ab{}[]"\\ <>/\n`') for _ in range(2000))})
    for parser, text in ((DeepSeekV3ToolParser, DS_CALLS + ds_call("big", args) + DS_CALLS_END),
                         (KimiK2ToolParser, K_SECTION + kimi_call("big", 0, args) + K_SECTION_END)):
        cuts = sorted(rng.sample(range(len(text)), 300))
        _, calls, _ = stream(parser(), text, cuts)
        assert [(n, a) for _, n, a in calls] == [("big", args)]


def test_glm_a_key_that_cannot_be_one_does_not_stall_the_stream():
    p = Glm45ToolParser()
    p.feed("<tool_call>f<arg_key>a<b</arg_key><arg_value>1</arg_value>")
    content, deltas = p.feed("</tool_call>after")
    assert content == "after" and [d.arguments for d in deltas] == ["{}"]
