"""Tensor parallelism end to end: an engine with tensor_parallel_size=2 (two worker processes joined by gloo)
gives the greedy tokens of the one-rank engine, for a dense (Qwen3) and a MoE (Qwen3-MoE) tiny model; and
the options around it fail clearly where they cannot apply."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flotilla import LLM, SamplingParams
from flotilla.actors.runtime import ActorFailure
from helpers_engine import write_tiny_engine_model, write_tiny_tokenizer
from helpers_tiny_models import write_tiny_moe_model

# chunked prefill (16-token budget) and mixed prefill + decode steps, with pipelined steps (the default 2)
OPTIONS = dict(kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 23, 9, 14)]


def _greedy(model_dir: Path, placement: str = "inline", **options: object) -> tuple[list[list[int]], dict]:
    with LLM(str(model_dir), placement=placement, **OPTIONS, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
        detail = {k: {**d, "pid": llm.client.runtime.ready[k].pid} for k, d in llm.client.ready_detail.items()}
    return [o.outputs[0].token_ids for o in outs], detail


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_tp2_greedy_tokens_equal_one_rank(name: str, tmp_path: Path) -> None:
    if name == "qwen3":
        model_dir = write_tiny_engine_model(tmp_path / name, "qwen3")
    else:
        model_dir = write_tiny_moe_model(tmp_path / name, name)
        write_tiny_tokenizer(model_dir, vocab_size=320)
    want, _ = _greedy(model_dir)
    got, detail = _greedy(model_dir, placement="process", tensor_parallel_size=2)
    assert [detail[f"worker/{r}"]["tp"] for r in range(2)] == ["0/2", "1/2"]
    assert detail["worker/0"]["pid"] != detail["worker/1"]["pid"]
    assert all(len(t) == 12 for t in got)
    assert got == want


def test_tp_needs_a_process_per_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one process per rank: use placement='process'"):
        LLM(str(tmp_path), tensor_parallel_size=2)


def test_forced_moe_backend_on_a_dense_model_fails_the_start(tmp_path: Path) -> None:
    model_dir = write_tiny_engine_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ActorFailure, match=r"Qwen3ForCausalLM\) takes no moe_backend='torch'"):
        LLM(str(model_dir), moe_backend="torch", **OPTIONS)
