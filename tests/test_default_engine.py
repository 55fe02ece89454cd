"""The embedded default model through the whole engine, and `flotilla generate` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from flotilla import LLM, SamplingParams

from helpers_engine import write_tiny_engine_model


def test_smollm2_knows_the_capital_of_france():
    with LLM(kv_cache_blocks=64) as llm:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_flotilla_generate_prints_completions(tmp_path):
    model = write_tiny_engine_model(tmp_path / "tiny")
    r = subprocess.run([sys.executable, "-m", "flotilla", "generate", "--model", str(model), "--prompt", "The quick",
                        "--prompt", "brown fox", "--max-tokens", "5", "--kv-cache-blocks", "64", "--block-size", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- 'The quick'") == 1 and r.stdout.count("--- 'brown fox'") == 1
    assert r.stdout.count(" tokens, finish_reason=") == 2


README_EXAMPLE = """\
from flotilla import LLM, SamplingParams
llm = LLM(kv_cache_blocks=64)
out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))
print(out[0].outputs[0].text)
"""


def test_the_readme_example_ends_by_itself_without_shutdown():
    r = subprocess.run([sys.executable, "-c", README_EXAMPLE], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout
    assert "Traceback" not in r.stderr and "failed" not in r.stderr, r.stderr[-3000:]
