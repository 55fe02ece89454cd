"""CUDA-graph decode under data parallelism x expert parallelism when the experts gather tokens (all2all_backend
allgather_reducescatter; opt-in, ep_cuda_graphs): each rank captures
its decode forwards with the MoE layers' NCCL all-gathers and reduce-scatters inside, the ranks agree on each
step's rows (actors/data_parallel_worker.py step_rows), and a busy rank replays the agreed size while an idle one
runs its empty steps eager. On two GPUs the engine must give the greedy tokens of the same engine eager, with
batches that shrink step by step (several captured sizes replay) and with one rank idle; on CPU, the rule that
picks graphs or not is checked on its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flotilla.actors import data_parallel_worker as dp
from flotilla.config import EngineConfig
from flotilla.transport.messages import StepPlan
from helpers_engine import greedy_on_cuda
from helpers_tiny_models import write_tiny_moe_model

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
GATHER = dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="allgather_reducescatter")


def _run(model: str, prompts: int, **options) -> tuple[list[list[int]], dict]:
    return greedy_on_cuda(model, prompts, **GATHER, **options)


@pytest.mark.gpu
@needs_two_gpus
def test_dp2_ep2_decode_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    model = str(write_tiny_moe_model(tmp_path / "moe", "qwen3_moe_hd64"))
    for prompts in (10, 1):  # both ranks busy; then one request: the other rank idle, stepping empty
        eager, detail = _run(model, prompts, enforce_eager=True)
        assert detail["worker/0"]["cuda_graphs"] == "off"
        graphs, detail = _run(model, prompts, ep_cuda_graphs=True)
        assert [detail[f"worker/{r}"]["cuda_graphs"] for r in (0, 1)] == ["on", "on"]
        assert graphs == eager


class _Graphs:
    """The two things step_rows asks of DecodeGraphs: captured sizes 1, 2, 4, 8."""

    sizes = [1, 2, 4, 8]

    def fits(self, batch: int) -> bool:
        return batch <= 8

    def padded_size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)


def _plan(*new_tokens: int) -> StepPlan:
    return StepPlan(step=1, rids=[f"r{i}" for i in range(len(new_tokens))],
                    num_new_tokens=np.array(new_tokens, dtype=np.int32))


@pytest.mark.parametrize(("mine", "theirs", "graphs", "want"), [
    ((1, 1, 1), (1,) * 5, True, (8, 8)),      # both decode: the size holding the larger batch, replayed
    ((), (1, 1, 1), True, (4, 4)),            # idle (empty steps eager) beside a decode batch of 3
    ((1, 1, 1), (7, 1), True, (8, 0)),        # the other rank prefills: eager, the most tokens exchanged
    ((1,) * 9, (1,), True, (9, 0)),           # a batch no graph holds: eager
    ((1, 1), (1, 1, 1), False, (3, 0)),       # no graphs (enforce_eager, CPU): eager
])  # fmt: skip
def test_the_ranks_agree_on_rows_and_on_graphs(monkeypatch, mine, theirs, graphs, want) -> None:
    # the other rank's half of the agreement, as its step_rows would send it: (its rows, whether it runs eager)
    other = (sum(theirs), not (graphs and (len(theirs) == sum(theirs) and sum(theirs) <= 8)))

    def agree(rows: int, eager: bool = False) -> tuple[int, bool]:
        return max(rows, other[0]), eager or other[1]

    monkeypatch.setattr(dp, "ep_gathers_tokens", lambda: True)
    monkeypatch.setattr(dp, "agree_on_rows", agree)
    plan = _plan(*mine) if mine else StepPlan(step=-1)
    with dp.step_rows(plan, _Graphs() if graphs else None) as graph_size:
        from flotilla.kernels.moe.ep_allgather import current_ep_tokens

        assert (current_ep_tokens(), graph_size) == want


def test_graphs_under_expert_parallelism_only_without_the_all_to_all_and_when_asked_for() -> None:
    gather = EngineConfig.from_options(**GATHER, ep_cuda_graphs=True)
    assert dp.ep_graphs_enabled(gather) and not dp.rank_config(gather, 0).worker.enforce_eager
    a2a = EngineConfig.from_options(data_parallel_size=2, enable_expert_parallel=True, ep_cuda_graphs=True)
    assert not dp.ep_graphs_enabled(a2a) and dp.rank_config(a2a, 0).worker.enforce_eager
    gather = EngineConfig.from_options(**GATHER)
    assert not dp.ep_graphs_enabled(gather) and dp.rank_config(gather, 0).worker.enforce_eager
    # TP x EP: masked routing over the shared tokens, graphs with the TP ones; DP x TP x EP dispatches: eager
    tp_ep = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    assert not dp.ep_graphs_enabled(EngineConfig.from_options(**tp_ep))
    tp_ep_graphs = EngineConfig.from_options(**tp_ep, tp_cuda_graphs=True)
    assert dp.ep_graphs_enabled(tp_ep_graphs) and not dp.rank_config(tp_ep_graphs, 0).worker.enforce_eager
    dp_tp_ep = EngineConfig.from_options(data_parallel_size=2, **tp_ep, tp_cuda_graphs=True, ep_cuda_graphs=True)
    assert not dp.ep_graphs_enabled(dp_tp_ep) and dp.rank_config(dp_tp_ep, 0).worker.enforce_eager
