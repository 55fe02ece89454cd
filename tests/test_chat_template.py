"""--chat-template: a file or an inline template replaces the model's, wherever prompts are rendered (the engine's
tokenizer and /tokenize agree), and the server warns at start when the template ignores `tools` (the default model's
does: tests/test_api_routes.py) but not when it renders them. The same server runs --reasoning-parser, whose flag is
checked to reach the chat route (the parsers themselves: tests/test_reasoning_parser.py, test_reasoning_output.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from flotilla.models.model_folder import chat_template_text
from helpers_optional import require
from helpers_server import start_server

openai = require("openai", "the chat completion goes through the real openai client")

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | map(attribute='name') "
            "| join(', ') }}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_chat_template_text_reads_a_file_or_takes_a_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_text(str(path)) == TEMPLATE
    assert chat_template_text(TEMPLATE) == TEMPLATE
    assert chat_template_text("{{ 'a' }}\\n{{ 'é🙂' }}") == "{{ 'a' }}\n{{ 'é🙂' }}"  # escapes read, as vLLM does
    with pytest.raises(ValueError, match="cannot read it"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_a_chat_template_that_is_neither_file_nor_template_stops_serve_before_loading():
    proc = subprocess.run([sys.executable, "-m", "flotilla", "serve", "--chat-template", "no/such/template.jinja"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--chat-template" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TEMPLATE)
    srv = start_server("--chat-template", str(path), "--reasoning-parser", "deepseek_r1", "--tool-call-parser",
                       "kimi_k2", timeout=300)
    try:
        yield srv
    finally:
        srv.stop()


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + path, json.dumps({"model": MODEL, **body}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_the_template_renders_every_prompt_and_rendering_tools_silences_the_warning(server):
    out = _post(server, "/tokenize", {"messages": MESSAGES, "tools": TOOLS, "return_token_strs": True})
    text = "".join(out["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    assert text.startswith("<|im_start|>system\nTools: get_weather<|im_end|>\n<|im_start|>user\nWeather"), text
    assert "SmolLM" not in text  # (the model's own template opens with its system prompt)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    usage = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=1).usage
    assert usage.prompt_tokens == out["count"]  # the engine rendered the same prompt
    assert _post(server, "/tokenize", {"messages": MESSAGES})["count"] < out["count"]
    assert not any("ignores `tools`" in line for line in server.log), "".join(server.log)


def test_the_reasoning_parser_flag_reaches_the_chat_route(server):
    """deepseek_r1 reads an output without </think> as all reasoning (the model here never writes one); a request
    whose chat_template_kwargs turn thinking off gets its text as content; completions are untouched."""
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    doc = _post(server, "/v1/chat/completions", body)
    msg, usage = doc["choices"][0]["message"], doc["usage"]
    assert msg["content"] is None and msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 4
    off = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"thinking": False}})
    assert off["choices"][0]["message"]["content"].strip() == msg["reasoning_content"]  # (reasoning is trimmed)
    assert off["choices"][0]["message"].get("reasoning_content") is None
    assert "completion_tokens_details" not in off["usage"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                       if c.choices)
    assert streamed == msg["reasoning_content"] and not any(c.choices and c.choices[0].delta.content
                                                            for c in chunks)
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert completion.choices[0].text and not completion.choices[0].model_extra.get("reasoning_content")


def test_a_grammar_holds_only_the_answer_after_the_reasoning(server):
    """The model here never writes </think>: under deepseek_r1 its whole output is reasoning, which a JSON grammar
    leaves free (the same greedy text as unconstrained); with thinking off the grammar holds the output at once."""
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    free = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    gated = _post(server, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}})
    assert gated["choices"][0]["message"]["reasoning_content"] == free["reasoning_content"]
    assert not free["reasoning_content"].lstrip().startswith("{")
    held = _post(server, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"},
                                                  "chat_template_kwargs": {"thinking": False}})
    assert held["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_llm_chat_renders_with_the_chat_template_option(tmp_path):
    from flotilla import LLM, SamplingParams
    from flotilla.models.model_folder import load_tokenizer
    from helpers_engine import write_tiny_engine_model

    model = write_tiny_engine_model(tmp_path / "tiny")
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    counts = {}
    for name, tok in (("ours", load_tokenizer(model, template)), ("model's", load_tokenizer(model))):
        prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        counts[name] = len(tok.encode(prompt, add_special_tokens=False))
        assert (prompt == "[user] Weather in Paris?\n") == (name == "ours")
    with LLM(str(model), kv_cache_blocks=64, block_size=4, chat_template=template) as llm:
        out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.num_prompt_tokens == counts["ours"] != counts["model's"]
