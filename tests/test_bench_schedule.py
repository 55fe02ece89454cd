"""scripts/dev/bench_schedule.py: bench_offline's workloads through the batching policy alone."""

from __future__ import annotations

import json

import pytest

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


def test_the_roofline_costs_each_prompt_token_and_each_decode_row_once(capsys):
    """--roofline: with no preemption the prompts' causal attention is P(P + 1) / 2 query-key pairs each however
    they were chunked, and each decode row reads its cached tokens and its own; Qwen3-8B's numbers are its known
    6.95 G layer parameters and 144 KiB of KV a token."""
    roof = bench_schedule.Roofline.for_shape("qwen3-8b")
    assert roof.gemm_flops_per_token == 2 * 6_945_767_424 and roof.kv_bytes_per_token == 144 * 1024
    assert bench_schedule.main(["--workload", "long16", "--kv-tokens", "600000", "--roofline", "qwen3-8b",
                                "--attention-tflops", "500", "--kv-read-tbps", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["preemptions"] == 0 and result["roofline_model"] == "qwen3-8b"
    pairs = 16 * 32_000 * 32_001 / 2
    assert result["prompt_attention_s"] == round(pairs * roof.attention_flops / 500e12, 2)
    reads = 16 * sum(c + 1 for c in range(32_000, 32_000 + 255))  # 255 decodes after the prefill's token
    assert result["decode_attention_s"] == round(reads * roof.kv_bytes_per_token / 4e12, 2)
    parts = result["gemm_s"] + result["prompt_attention_s"] + result["decode_attention_s"]
    assert abs(result["roofline_s"] - parts) <= 0.011
    # an FP8 cache: the same plan, its decode rows reading half the bytes
    assert bench_schedule.main(["--workload", "long16", "--kv-tokens", "600000", "--roofline", "qwen3-8b",
                                "--attention-tflops", "500", "--kv-read-tbps", "4", "--kv-cache-dtype", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["steps"] == result["steps"]
    assert fp8["decode_attention_s"] == round(reads * roof.kv_bytes_per_token / 2 / 4e12, 2)
    assert (fp8["gemm_s"], fp8["prompt_attention_s"]) == (result["gemm_s"], result["prompt_attention_s"])


def test_a_roofline_step_is_bound_by_its_weights_or_its_flops_whichever_takes_longer():
    roof = bench_schedule.Roofline.for_shape("qwen3-8b", gemm_tflops=700, weights_tbps=4, kv_read_tbps=4)
    gemm, prompt, decode = roof.step([], [1000] * 8)  # a small decode batch: the weights' read
    assert gemm == roof.weight_bytes / 4e12 and prompt == 0 and decode == 8 * 1001 * roof.kv_bytes_per_token / 4e12
    gemm, prompt, _ = roof.step([(8192, 0)], [])  # a prompt chunk: its FLOPs
    assert gemm == (8192 * roof.gemm_flops_per_token + roof.lm_head_flops) / 700e12 > roof.weight_bytes / 4e12
    assert prompt == 8192 * 8193 / 2 * roof.attention_flops / 466e12
    with pytest.raises(ValueError, match="dense GQA models only"):
        bench_schedule.Roofline.for_shape("qwen3-30b-a3b")
