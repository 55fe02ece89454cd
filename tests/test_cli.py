"""The command line's help: `flotilla --help` lists each command once, every flag of every command is explained
and shows its default at most once, and docs/engine-args.md is what the serve parser renders."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from flotilla.__main__ import build_parser
from flotilla.scripts.dev import bench_serving, bench_transport
from flotilla.server.cli import HelpFormatter, add_serve_arguments, engine_args_markdown

ENGINE_ARGS = Path(__file__).resolve().parent.parent / "docs" / "engine-args.md"
COMMANDS = ("serve", "generate", "actor", "launch", "keygen", "bench")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _flag_blocks(help_text: str) -> list[str]:
    """Each argument's entry of a --help page: from its line ("  --flag ...", "  name") to the next one's."""
    blocks: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  \S", line):
            blocks.append(line)
        elif line.startswith("   ") and blocks:
            blocks[-1] += " " + line.strip()
        else:
            blocks.append("")  # a heading or a blank line ends the entry
    return [b for b in blocks if b]


def test_top_level_help_lists_each_command_once():
    parser = build_parser()
    text = parser.format_help()
    assert set(_commands(parser)) == set(COMMANDS)
    for name in COMMANDS:
        assert len(re.findall(rf"^\s+{name}\s", text, re.M)) == 1, text


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_explained_with_its_default_at_most_once(command):
    parser = _commands(build_parser())[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action)
        assert text.strip(), f"{command} {action.option_strings or action.dest}: no help"
        assert text.count("default:") <= 1, f"{command} {action.option_strings}: {text}"
        assert "(default: None)" not in text
    for block in _flag_blocks(parser.format_help()):
        assert block.count("default:") <= 1, block


@pytest.mark.parametrize("main", [bench_transport.main, bench_serving.main], ids=["transport", "serving"])
def test_benchmark_flags_show_their_default_at_most_once(main, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    blocks = _flag_blocks(capsys.readouterr().out)
    assert blocks
    for block in blocks:
        assert block.count("default:") <= 1 and "(default: None)" not in block, block


def test_the_formatter_appends_a_value_default_once():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--host", default=None, help="address; default: every interface")
    p.add_argument("--trace", action="store_true", help="print messages")
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True, help="reuse blocks")
    text = " ".join(p.format_help().split())
    assert "TCP port (default: 8000)" in text
    assert "address; default: every interface" in text and "(default: None)" not in text
    assert "print messages" in text and "(default: False)" not in text
    assert "reuse blocks (default: True)" in text


def test_engine_args_page_is_current():
    assert ENGINE_ARGS.read_text() == engine_args_markdown(), (
        "docs/engine-args.md is stale: run `python3 -m flotilla.server.cli --markdown > docs/engine-args.md`")


def test_engine_args_page_has_every_engine_flag():
    page = engine_args_markdown()
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for action in parser._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in page, flag
