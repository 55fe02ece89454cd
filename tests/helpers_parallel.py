"""Engine tests across ranks (tensor, data and expert parallelism): prompts, greedy runs that fail instead of
hanging when the ranks' collectives stop pairing up, and the expert loads the workers report."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from flotilla import LLM, SamplingParams


def random_prompts(seed: int, lengths: Sequence[int], vocab: int = 320) -> list[dict]:
    """Token-id prompts of the given lengths (ids from 3 on: clear of the tiny tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]


def generated_tokens(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def generate_within(llm: LLM, prompts: list[dict], params: SamplingParams, timeout_s: float) -> list[list[int]]:
    """generated_tokens, failing (not hanging) if ranks out of step leave a collective waiting."""
    out: list[list[list[int]]] = []
    run = threading.Thread(target=lambda: out.append(generated_tokens(llm, prompts, params)), daemon=True)
    run.start()
    run.join(timeout_s)
    assert out, f"generation did not finish in {timeout_s} s: the ranks' collectives do not pair up"
    return out[0]


def expert_loads_reaching(client, done: Callable[[np.ndarray], bool], timeout_s: float = 10.0) -> np.ndarray:
    """The summed per-expert counts once `done` holds for them (the workers report every half second)."""
    deadline = time.monotonic() + timeout_s
    while (total := client.expert_loads.total()) is None or not done(total):
        assert time.monotonic() < deadline, f"expert loads stayed at {total}"
        time.sleep(0.1)
    return total
