"""Tensor parallelism end to end: an engine with tensor_parallel_size=2 (two worker processes joined by gloo)
gives the greedy tokens of the one-rank engine, for a dense (Qwen3) and a MoE (Qwen3-MoE) tiny model; and
the options around it fail clearly where they cannot apply."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
from pathlib import Path

import pytest
import torch
import transformers

from flotilla import LLM, SamplingParams
from flotilla.actors.runtime import ActorFailure
from flotilla.server.engine_client import EngineDeadError, RequestFailed
from helpers_engine import write_tiny_engine_model, write_tiny_tokenizer
from helpers_tiny_models import _COMMON, TINY_CONFIGS, write_tiny_moe_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

# chunked prefill (16-token budget) and mixed prefill + decode steps, with pipelined steps (the default)
OPTIONS = dict(kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 23, 9, 14)]


def _generate(llm: LLM) -> tuple[list, list[float], dict]:
    """Greedy tokens of every prompt, then a seeded sampled request's tokens and logprobs (rank 0 samples
    for the group under TP: the tokens must still be the one-rank engine's)."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, prompts[1]]],
                        [greedy] * len(prompts) + [seeded], use_tqdm=False)
    detail = {k: {**d, "pid": llm.client.runtime.ready[k].pid} for k, d in llm.client.ready_detail.items()}
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, [lp.logprob for lp in outs[-1].outputs[0].logprobs], detail


@pytest.fixture(scope="module")
def qwen3_tp2(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3 (4 query heads, 2 kv heads: split) and one TP=2 engine on it (placement: process, by default
    under TP), shared by the tests in file order: the greedy comparison, then the dead rank, which stops it."""
    model_dir = write_tiny_engine_model(tmp_path_factory.mktemp("tp") / "qwen3", "qwen3")
    llm = LLM(str(model_dir), tensor_parallel_size=2, **OPTIONS)
    yield model_dir, llm
    llm.shutdown()  # (nothing left to do when the dead-rank test stopped it)


def _one_kv_head_qwen3(model_dir: Path) -> Path:
    """Tiny Qwen3 with a single kv head: under TP=2 both ranks keep (and cache) that head."""
    config = transformers.Qwen3Config(**{**_COMMON, **TINY_CONFIGS["qwen3"][2], "num_key_value_heads": 1})
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).float().save_pretrained(model_dir, safe_serialization=True)
    write_tiny_tokenizer(model_dir, vocab_size=320)
    return model_dir


@pytest.mark.parametrize("name", ["qwen3", "qwen3_one_kv_head", "qwen3_moe"])
def test_tp2_greedy_tokens_equal_one_rank(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    shared = None
    if name == "qwen3":  # the module's TP=2 engine, left running for the dead-rank test
        model_dir, engine = request.getfixturevalue("qwen3_tp2")
        shared = contextlib.nullcontext(engine)
    elif name == "qwen3_one_kv_head":
        model_dir = _one_kv_head_qwen3(tmp_path / name)
    else:
        model_dir = write_tiny_moe_model(tmp_path / name, name)
        write_tiny_tokenizer(model_dir, vocab_size=320)
    with LLM(str(model_dir), placement="inline", **OPTIONS) as llm:
        want, want_logprobs, _ = _generate(llm)
    with shared or LLM(str(model_dir), placement="process", tensor_parallel_size=2, **OPTIONS) as llm:
        got, got_logprobs, detail = _generate(llm)
    assert [detail[f"worker/{r}"]["tp"] for r in range(2)] == ["0/2", "1/2"]
    assert detail["worker/0"]["pid"] != detail["worker/1"]["pid"]
    assert all(len(t) == 12 for t in got)
    assert got == want
    assert got_logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_tp_needs_a_process_per_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one process per rank: use placement='process'"):
        LLM(str(tmp_path), tensor_parallel_size=2, placement="inline")


def test_forced_moe_backend_on_a_dense_model_fails_the_start(tmp_path: Path) -> None:
    model_dir = write_tiny_engine_model(tmp_path / "dense", "qwen3")
    with pytest.raises(ActorFailure, match=r"Qwen3ForCausalLM\) takes no moe_backend='torch'"):
        LLM(str(model_dir), moe_backend="torch", **OPTIONS)


def test_a_dead_rank_fails_the_engine_instead_of_hanging_it(qwen3_tp2) -> None:
    _, llm = qwen3_tp2
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        os.kill(llm.client.runtime.ready["worker/1"].pid, signal.SIGKILL)  # rank 0 would wait in its collectives
        with pytest.raises(EngineDeadError, match=r"worker/1 failed: process \d+ killed by signal 9"):
            for _ in range(200):  # the supervisor notices within moments
                try:
                    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
                except RequestFailed:  # a step rank 0 failed (its peer gone) before the supervisor's verdict came
                    pass
    finally:
        stopper = threading.Thread(target=llm.shutdown)
        stopper.start()
        stopper.join(timeout=60)
    assert not stopper.is_alive(), "the engine did not stop after losing a rank"
