"""scripts/dev/bench_schedule.py: bench_offline's workloads through the batching policy alone."""

from __future__ import annotations

import json

from flotilla.scripts.dev import bench_schedule


def test_the_16_x_32k_row_in_an_h100s_cache_computes_each_prompt_token_once(tmp_path):
    """The row's requests against the 363,824-token cache an H100 gives Qwen3-8B at 0.85 with 256 sequences and
    steps of 8,192 tokens (11 of its 16 prompts): no prompt is let in by a chunk that its second chunk cannot follow,
    so none is preempted and computed again."""
    out = tmp_path / "schedule.json"
    assert bench_schedule.main(["--workload", "long16", "--kv-tokens", "363824", "--max-num-seqs", "256",
                                "--max-num-batched-tokens", "8192", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 16 and result["output_tokens"] == 16 * 256
    assert result["preemptions"] == 0 and result["prompt_tokens_computed"] == result["prompt_tokens"] == 512_000
    assert result["prompt_steps"] == 63  # (16 prompts of 32,000 tokens in steps of 8,192: 62.5)


def test_a_cache_too_small_for_two_prompts_at_once_runs_them_one_after_the_other(tmp_path, capsys):
    assert bench_schedule.main(["--workload", "long16", "--kv-tokens", "48000"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["preemptions"] == 0 and result["prompt_tokens_computed"] == 512_000
