"""Which steps a runner replays as decode graphs, and with what (CPU, through a stand-in for DecodeGraphs that runs
the same forward eagerly): only steps whose every row is one token that samples, so a prompt's one-token chunk short
of its end (a budget's last token beside decodes) stays eager; a hybrid model's rows carry their recurrent-state
slots into the replay, and its snapshots are saved after one. The tokens equal a runner's without graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_spec import VOCAB, make_runner, requests, run
from helpers_tiny_models import write_tiny_model, write_tiny_qwen35_model

from flotilla.actors.cuda_graphs import decodes_only
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.sampling_params import SamplingParams
from flotilla.transport.messages import StepPlan, TokenizedRequest


class EagerDecodeGraphs:
    """DecodeGraphs.run's interface over the runner's model, eager: records every step it is given."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps: list[tuple[list[int], list[int] | None]] = []

    def fits(self, batch: int) -> bool:
        return batch <= 8

    def padded_size(self, batch: int) -> int:
        return 8

    def run(self, input_ids, positions, slots, seq_lens, tables, patch=None, size=None, state_slots=None):
        r = self.runner
        ids = torch.from_numpy(np.array(input_ids, dtype=np.int64))
        if patch is not None:
            patch(ids)
        lens = seq_lens.tolist()
        pages = [t[:-(-n // r.block_size)].tolist() for t, n in zip(tables, lens)]
        meta = AttentionMetadata.from_lists([n - 1 for n in lens], [1] * len(lens), pages, r.block_size,
                                            device=r.device)
        assert meta.slot_mapping.tolist() == slots.tolist()
        if state_slots is not None:
            meta.state_slots = torch.from_numpy(state_slots)
        self.steps.append((lens, None if state_slots is None else state_slots.tolist()))
        logits = r.model.compute_logits(r.model(ids, torch.from_numpy(positions), r.kv_caches, meta))
        return logits, logits.argmax(-1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode-graph-steps")
    return {"qwen3": write_tiny_model(root / "qwen3", "qwen3"), "qwen3_5_moe": write_tiny_qwen35_model(root / "q35")}


def decodes_beside_a_long_prompt() -> list[TokenizedRequest]:
    """Five short prompts that decode long, then a long prompt: with a budget of 6 tokens over 6 sequences its
    chunks are one token beside five decodes; then requests()' mix."""
    rng = np.random.default_rng(5)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [TokenizedRequest(rid=f"d{i}", prompt_ids=rng.integers(4, VOCAB, n).astype(np.int32), eos_token_ids=[2],
                             sampling=greedy) for i, n in enumerate([3, 2, 4, 3, 2, 20])]
    return reqs + requests()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_moe"])
def test_decode_steps_replay_and_one_token_prompt_chunks_stay_eager(model_dirs, name):
    reqs = decodes_beside_a_long_prompt()
    want = run(make_runner(model_dirs[name], None), budget=6, reqs=reqs)[0]
    runner = make_runner(model_dirs[name], None)
    runner.graphs = graphs = EagerDecodeGraphs(runner)
    plans: list[StepPlan] = []
    execute = runner.execute

    def recorded(plan: StepPlan):
        plans.append(plan)
        return execute(plan)

    runner.execute = recorded
    got = run(runner, budget=6, reqs=reqs)[0]
    assert got == want
    one_token = [p for p in plans if p.rids and int(p.num_new_tokens.sum()) == len(p.rids)]
    assert sum(not p.every_row_samples for p in one_token) >= 10  # (the long prompt's chunks beside decodes)
    assert len(graphs.steps) == sum(decodes_only(p) for p in plans) > 0
    hybrid = name == "qwen3_5_moe"
    assert all((slots is not None) == hybrid for _, slots in graphs.steps)
    if hybrid:  # every replayed row's slot is its own: distinct within the step, within the pool
        assert all(len(set(s)) == len(s) and 0 <= min(s) and max(s) < runner.num_state_slots
                   for _, s in graphs.steps)
