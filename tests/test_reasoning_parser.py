"""Reasoning parsing (qwen3, deepseek_r1): whole outputs, streams one character at a time and in any chunking, tags
split across deltas, outputs without thinking, and the reasoning token count."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.server.reasoning_parser import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    split_reasoning,
    thinking_disabled,
)


def stream(parser_cls, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    p = parser_cls()
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    outs = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs), outs


def test_names_are_vllms():
    assert REASONING_PARSERS == {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("\n<think>a<b</think>c", "a<b", "c"),
    ("Paris.", None, "Paris."),  # no thinking: all content, untouched
    (" Paris <think>x</think>", None, " Paris <think>x</think>"),  # a tag not at the start is the answer's text
    ("<think>cut off mid-thou", "cut off mid-thou", ""),
    ("<think></think>\n\nHi", None, "Hi"),
    ("", None, ""),
])
def test_qwen3_whole_outputs(text, reasoning, content):
    assert split_reasoning(text, Qwen3ReasoningParser) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),  # the template opened <think>
    ("<think>\nhmm\n</think>Paris.", "hmm", "Paris."),
    ("no end tag: all reasoning", "no end tag: all reasoning", ""),
    ("a</think>b</think>c", "a", "b</think>c"),  # only the first end tag ends it
    ("", None, ""),
])
def test_deepseek_r1_whole_outputs(text, reasoning, content):
    assert split_reasoning(text, DeepSeekR1ReasoningParser) == (reasoning, content)


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_one_character_at_a_time_matches_the_whole_and_never_shows_a_tag(parser):
    text = "<think>\nStep 1: a < b.\nStep 2: </thin is not a tag\n</think>\n\nThe answer is <b>42</b>."
    reasoning, content, outs = stream(parser, text, list(range(len(text))))
    assert (reasoning, content) == ("Step 1: a < b.\nStep 2: </thin is not a tag", "The answer is <b>42</b>.")
    assert split_reasoning(text, parser) == (reasoning, content)
    for r, c in outs:  # no tag in any delta (its prefixes are held back: test_tags_split_across_deltas)
        assert "think>" not in r + c
    assert outs[-1] == ("", "") and sum(bool(r) for r, _ in outs) > 10  # reasoning streams as it comes


def test_tags_split_across_deltas():
    p = Qwen3ReasoningParser()
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>Hmm") == ("Hmm", "")
    assert p.feed(", ok. </th") == (", ok.", "")
    assert p.feed("ink>\n") == ("", "")
    assert p.feed("\nDone") == ("", "Done")
    assert p.finish() == ("", "")
    p = Qwen3ReasoningParser()
    assert p.feed("<") == ("", "")
    assert p.feed("b>bold") == ("", "<b>bold")  # not the opening tag after all: content, nothing lost


PIECES = ["<think>", "</think>", "<thi", "</th", "nk>", "\n", " ", "x", "a < b", "émoji 🙂", "<"]


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_streaming_equals_whole_in_any_chunking(parser):
    @settings(max_examples=200, deadline=None)
    @given(parts=st.lists(st.sampled_from(PIECES), max_size=10), cuts=st.lists(st.integers(0, 80), max_size=20))
    def check(parts, cuts):
        text = "".join(parts)
        reasoning, content, _ = stream(parser, text, cuts)
        assert ((reasoning or None), content) == split_reasoning(text, parser)

    check()


def test_reasoning_tokens_count_the_deltas_of_the_reasoning():
    p = Qwen3ReasoningParser()
    for text in ["<", "think>", "a", " b", "</think>", "\n\n", "c", "d"]:
        p.feed(text, 1)
    p.finish()
    assert p.reasoning_tokens == 5  # the tag's two pieces, a, b and the end tag
    p = Qwen3ReasoningParser()
    for text in ["<", "b>", "x"]:
        p.feed(text, 1)
    p.finish()
    assert p.reasoning_tokens == 0
    p = DeepSeekR1ReasoningParser()
    for text in ["a", "b", "</think>", "c"]:
        p.feed(text, 2)
    assert p.reasoning_tokens == 6
    p = DeepSeekR1ReasoningParser()
    p.feed(" ", 1)
    p.finish()
    assert p.reasoning_tokens == 1


def test_thinking_disabled_by_the_template_variables():
    assert thinking_disabled({"enable_thinking": False}) and thinking_disabled({"thinking": False})
    assert not thinking_disabled(None) and not thinking_disabled({"enable_thinking": True})
    assert not thinking_disabled({"enable_thinking": 0})  # only an explicit false, as the templates test it
