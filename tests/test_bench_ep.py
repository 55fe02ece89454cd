"""scripts/dev/bench_ep.py at toy size on CPU (gloo): 2 and 3 real rank processes run dispatch + identity experts +
combine (and the all-gather layer's gather + reduce) for each token count (0 included: empty batches still join every all-to-all), the records say what moved
and how unbalanced it was, hot experts show up as imbalance, and a wrong row, a failing rank or a hung rank makes
the run exit 1 instead of passing or hanging."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import time
import warnings

import pytest
import torch
from flotilla.scripts.dev import bench_ep as be

TOY = ["--device", "cpu", "--experts", "8", "--top-k", "2", "--hidden", "32", "--dtype", "float32",
       "--iters", "2", "--warmup", "1"]
KEYS = {"bench", "world_size", "tokens_per_rank", "experts", "top_k", "hidden", "dtype", "dispatch_ms", "combine_ms",
        "layer_ms", "gbps", "rank_imbalance", "expert_imbalance", "backend", "bytes_per_rank", "per_rank"}


def _run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "ep.json"
    assert be.main([*TOY, "--timeout-s", "60", *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], str]:
    """(records, stdout) of a 2-rank run over 0, 1, 5 and 24 tokens per rank, shared by the tests that read it."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        records = _run(tmp_path_factory.mktemp("two_ranks"), "--world-size", "2", "--tokens", "0,1,5,24")
    return records, out.getvalue()


def test_two_ranks_every_token_count_well_formed(two_ranks):
    records, out = two_ranks
    env, *rows = records
    assert env["bench"] == "env" and env["backend"] == "gloo" and env["world_size"] == 2 and env["command"]
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["bench"] for r in lines] == ["env"] + ["ep_all_to_all"] * 4  # one JSON line each, per_rank left out
    assert [r["tokens_per_rank"] for r in rows] == [0, 1, 5, 24]
    for r in rows:
        assert KEYS <= r.keys() and r["backend"] == "gloo" and r["world_size"] == 2 and r["dtype"] == "float32"
        assert r["layer_ms"] > 0 and r["dispatch_ms"] > 0 and r["combine_ms"] > 0
        assert r["layer_ms"] >= max(r["dispatch_ms"], r["combine_ms"])
        assert r["rank_imbalance"] >= 1 and r["expert_imbalance"] >= 1 and r["slot_rows_ratio"] >= 1
        ranks = r["per_rank"]
        assert [p["rank"] for p in ranks] == [0, 1]
        n = r["tokens_per_rank"]
        # a token goes once to each rank holding one of its 2 experts: 1 or 2 rows; every slot is computed once
        assert all(n <= p["rows_sent"] <= n * 2 for p in ranks)
        assert sum(p["rows_sent"] for p in ranks) == sum(p["rows_received"] for p in ranks)
        assert sum(p["slots_computed"] for p in ranks) == 2 * n * 2
        assert r["bytes_per_rank"] == max((p["rows_sent"] + p["rows_received"]) * 32 * 4 for p in ranks)
        assert r["remote_bytes_per_rank"] <= r["bytes_per_rank"]
        # the rate is the busiest rank's bytes over the layer's time (layer_ms is rounded to 0.1 us)
        assert r["gbps"] == pytest.approx(r["bytes_per_rank"] / r["layer_ms"] / 1e6, rel=5e-3)
        assert (r["gbps"] > 0) == (n > 0)
    assert rows[0]["bytes_per_rank"] == 0 and rows[0]["rank_imbalance"] == rows[0]["expert_imbalance"] == 1.0


def test_three_ranks_uneven_splits_and_an_idle_rank(tmp_path):
    rows = _run(tmp_path, "--world-size", "3", "--experts", "6", "--tokens", "7", "--idle-ranks", "1")[1:]
    (r,) = rows
    assert r["world_size"] == 3 and [p["tokens"] for p in r["per_rank"]] == [7, 7, 0]
    assert r["per_rank"][2]["rows_sent"] == 0 and sum(p["slots_computed"] for p in r["per_rank"]) == 2 * 7 * 2
    assert r["rank_imbalance"] >= 1 and r["expert_imbalance"] >= 1 and r["layer_ms"] > 0


def test_hot_experts_show_as_imbalance(tmp_path, two_ranks):
    # the two-rank run's routing at 24 tokens (seeded by rank and token count, so the same as in a run of 24 alone),
    # against the same with the first 2 experts (rank 0's) favoured
    flat = two_ranks[0][-1]
    assert flat["tokens_per_rank"] == 24
    hot = _run(tmp_path, "--world-size", "2", "--tokens", "24", "--skew", "4")[1]
    assert hot["expert_imbalance"] > flat["expert_imbalance"]
    assert hot["rank_imbalance"] > flat["rank_imbalance"]
    assert hot["per_rank"][0]["slots_computed"] > hot["per_rank"][1]["slots_computed"]


def test_a_wrong_row_fails_the_run(monkeypatch, capsys):
    monkeypatch.setenv(be.FAULT_ENV, "1:corrupt")
    assert be.main([*TOY, "--timeout-s", "60", "--world-size", "2", "--tokens", "5"]) == 1
    captured = capsys.readouterr()
    assert "with identity experts is not x" in captured.err and "ep_all_to_all" not in captured.out


def test_a_hung_rank_is_killed_at_the_timeout(monkeypatch, capsys):
    monkeypatch.setenv(be.FAULT_ENV, "0:hang")
    t0 = time.monotonic()
    assert be.main([*TOY, "--timeout-s", "3", "--world-size", "2", "--tokens", "1"]) == 1
    assert time.monotonic() - t0 < 30
    assert "did not finish within --timeout-s 3" in capsys.readouterr().err


def test_check_identity_tolerance_follows_the_dtype():
    x = torch.randn(4, 16).to(torch.bfloat16)
    be.check_identity(x.float().mul(1.001).to(torch.bfloat16), x, 0, 4)  # within bf16 rounding
    with pytest.raises(be.BenchError, match="rows"):
        be.check_identity(x.float().mul(1.001), x.float(), 0, 4)  # the same error is too much for float32
    with pytest.raises(be.BenchError, match="expected"):
        be.check_identity(x[:3], x, 0, 4)


def test_help_and_argument_checks(monkeypatch, capsys):
    # `python -m flotilla.scripts.dev.bench_ep --help`, run in this process (runpy: the module as __main__)
    monkeypatch.setattr(sys, "argv", ["bench_ep", "--help"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("ignore", RuntimeWarning)  # (the module is imported already: runpy says so)
        runpy.run_module("flotilla.scripts.dev.bench_ep", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--world-size", "--experts", "--top-k", "--hidden", "--dtype", "--tokens", "--skew",
                 "--seed", "--iters", "--timeout-s", "--json"):
        assert flag in out
    with pytest.raises(SystemExit):
        be.parse_args(["--device", "cpu", "--world-size", "3", "--experts", "8"])  # experts not divisible


def test_the_gathering_backend_with_an_idle_rank_moves_every_rank_s_rows(tmp_path):
    gather = ("--all2all-backend", "allgather_reducescatter")
    rows = _run(tmp_path, "--world-size", "3", "--experts", "6", "--tokens", "0,7", "--idle-ranks", "1", *gather)[1:]
    empty, r = rows
    assert empty["bytes_per_rank"] == 0 and empty["all2all_backend"] == "allgather_reducescatter"
    assert [p["tokens"] for p in r["per_rank"]] == [7, 7, 0]
    # every rank gathers 3 x 7 rows (the idle one's zeros too) and reduces as many partial sums
    assert all(p["rows_sent"] == 3 * 7 for p in r["per_rank"])
    assert r["bytes_per_rank"] == 2 * 3 * 7 * 32 * 4 and r["remote_bytes_per_rank"] == 2 * 2 * 7 * 32 * 4
    # the experts of all ranks computed every busy rank's slots, once each
    assert sum(p["slots_computed"] for p in r["per_rank"]) == 2 * 7 * 2
    assert r["layer_ms"] >= max(r["dispatch_ms"], r["combine_ms"]) > 0


def test_a_wrong_partial_sum_fails_the_gathering_run(monkeypatch, capsys):
    monkeypatch.setenv(be.FAULT_ENV, "1:corrupt")
    assert be.main([*TOY, "--world-size", "2", "--tokens", "3", "--timeout-s", "60",
                    "--all2all-backend", "allgather_reducescatter"]) == 1
    assert "with identity experts is not x" in capsys.readouterr().err
