"""Tensor-parallel layers (models/parallel.py) on 2 real gloo processes against the unsharded computation.

Each rank (tests/helpers_tp_rank.py) slices the same whole tensors to its part and saves its outputs:
column-parallel q/k/v must give each rank its own heads (kv heads split, and replicated when there are
fewer kv heads than ranks), a column -> row-parallel MLP and a vocab-parallel embedding / LM head must give
every rank the whole unsharded result.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from flotilla.models.parallel import QKVParallelLinear, tp_group
from flotilla.transport.endpoints import free_tcp_port

HIDDEN, HEAD_DIM, HEADS, INTER, VOCAB = 32, 8, 4, 48, 37  # 37: the last rank's vocab range is padded


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    w = {"x": rand(5, HIDDEN), "head_dim": torch.tensor(HEAD_DIM), "ids": torch.tensor([0, 36, 18, 19, 5, 36])}
    for name, kv_heads in (("qkv_split", 2), ("qkv_replicated", 1)):
        w[f"{name}.q"], w[f"{name}.q_bias"] = rand(HEADS * HEAD_DIM, HIDDEN), rand(HEADS * HEAD_DIM)
        for part in "kv":
            w[f"{name}.{part}"], w[f"{name}.{part}_bias"] = rand(kv_heads * HEAD_DIM, HIDDEN), rand(kv_heads * HEAD_DIM)
    w.update(gate=rand(INTER, HIDDEN), up=rand(INTER, HIDDEN), down=rand(HIDDEN, INTER), down_bias=rand(HIDDEN),
             embed=rand(VOCAB, HIDDEN))
    return w


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("tp")
    w = _weights()
    save_file(w, str(folder / "weights.safetensors"))
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    script = Path(__file__).with_name("helpers_tp_rank.py")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", init, str(folder)], stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    return w, [load_file(str(folder / f"rank{r}.safetensors")) for r in range(2)]


def test_qkv_column_parallel_gives_each_rank_its_heads(ranks) -> None:
    w, outs = ranks
    q_per_rank = HEADS // 2 * HEAD_DIM
    for name, kv_heads in (("qkv_split", 2), ("qkv_replicated", 1)):
        q, k, v = (F.linear(w["x"], w[f"{name}.{p}"], w[f"{name}.{p}_bias"]) for p in "qkv")
        for rank, out in enumerate(outs):
            kv_head = rank if kv_heads == 2 else 0  # replicated: both ranks' query heads use kv head 0
            kv = slice(kv_head * HEAD_DIM, (kv_head + 1) * HEAD_DIM)
            want = torch.cat([q[:, rank * q_per_rank:(rank + 1) * q_per_rank], k[:, kv], v[:, kv]], dim=-1)
            torch.testing.assert_close(out[name], want, rtol=1e-5, atol=1e-5)


def test_column_then_row_parallel_mlp_equals_unsharded(ranks) -> None:
    w, outs = ranks
    x = w["x"]
    want = F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"], w["down_bias"])
    for out in outs:
        torch.testing.assert_close(out["mlp"], want, rtol=1e-5, atol=1e-4)
    assert torch.equal(outs[0]["mlp"], outs[1]["mlp"])  # the all-reduce leaves every rank the same bits


def test_vocab_parallel_embedding_and_logits_equal_unsharded(ranks) -> None:
    w, outs = ranks
    want_logits = F.linear(w["x"], w["embed"])
    for out in outs:
        assert torch.equal(out["embedded"], F.embedding(w["ids"], w["embed"]))  # exact: one rank holds each row
        assert out["logits"].shape == (5, VOCAB) and out["logits"].dtype == torch.float32
        torch.testing.assert_close(out["logits"], want_logits, rtol=1e-5, atol=1e-5)


def test_one_rank_runs_no_collective_and_bad_head_splits_are_refused(monkeypatch) -> None:
    assert tp_group().size == 1 and tp_group().group is None
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, 2, bias=False)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.weight.shape[0]) == (HEADS, 2, (HEADS + 4) * HEAD_DIM)
    monkeypatch.setattr("flotilla.models.parallel._TP", type(tp_group())(rank=0, size=3))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by the tensor-parallel size 3"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2, bias=False)
    with pytest.raises(ValueError, match=r"neither a divisor nor a multiple of num_key_value_heads \(2\)"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, 6, 2, bias=False)
