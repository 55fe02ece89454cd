"""scripts/dev/bench_kernels.py's plumbing on CPU (--cpu-smoke: tiny sizes, torch references, DeepGEMM's expert layouts
over their torch GEMM stand-ins): every bench emits well-formed records, stdout and --json agree, --only filters,
and a failing point is an error record while the run goes on."""

from __future__ import annotations

import json
import math

import pytest

from flotilla.scripts.dev import bench_kernels as bk


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_the_cpu_smoke_run_writes_well_formed_records_for_every_bench(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bk.main(["--cpu-smoke", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert records == _lines(capsys)  # the file holds exactly what was printed
    assert records[0]["bench"] == "env" and records[0]["cpu_smoke"] is True and records[0]["device"] == "cpu"
    summary = records[-1]
    assert summary["bench"] == "summary" and summary["errors"] == 0
    body = records[1:-1]
    assert all(r["bench"] in bk.BENCHES and isinstance(r.get("backend"), str) for r in body)
    errors = [r for r in body if "error" in r]
    assert not errors, errors
    measured = [r for r in body if "ms" in r]
    skipped = [r for r in body if "skipped" in r]
    assert len(measured) + len(skipped) == len(body)
    assert summary["measured"] == len(measured) and summary["skipped"] == len(skipped)
    for r in measured:
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["iters"] >= 1 and r["first_ms"] >= 0
    for r in skipped:
        assert isinstance(r["skipped"], str) and r["skipped"]
    assert {r["bench"] for r in measured} == set(bk.BENCHES)  # every bench measured something on CPU
    by = {}
    for r in measured:
        by.setdefault(r["bench"], set()).add(r["backend"])
    assert by["moe"] == by["fp8_moe"] == {"torch", "deep_gemm_layout_ref"}
    assert by["fp8_gemm"] == {"torch", "torch_bf16"} and by["mla"] == {"torch"} and by["routing"] == {"torch"}
    assert by["gemv"] == {"cublas"}  # (F.linear: cuBLAS on a GPU)
    assert by["gdn"] == {"torch"}
    smoke = bk.SMOKE_SIZES
    moe = [r for r in measured if r["bench"] == "moe"]
    assert sorted({r["tokens"] for r in moe}) == sorted(smoke.moe_tokens)
    for r in moe + [r for r in measured if r["bench"] == "fp8_moe"]:
        assert 1 <= r["experts_hit"] <= r["E"] and r["tflops"] >= 0 and r["gbps"] >= 0
    gemm = [r for r in measured if r["bench"] == "fp8_gemm"]
    want = {(n, k, m) for _, n, k in smoke.gemm_shapes for m in smoke.gemm_m}
    assert {(r["N"], r["K"], r["M"]) for r in gemm} == want
    assert {r["batch"] for r in measured if r["bench"] == "mla"} == set(smoke.mla_batch)
    assert all(r["mode"] == "eager" for r in measured if r["bench"] == "routing")  # no CUDA graphs on CPU
    gdn = [r for r in measured if r["bench"] == "gdn"]
    assert sorted(r["batch"] for r in gdn if r["pass"] == "decode") == sorted(smoke.gdn_batch)
    assert sorted(r["batch"] for r in gdn if r["pass"] == "norm") == sorted(smoke.gdn_batch)
    assert {(r["seqs"], r["tokens"]) for r in gdn if r["pass"] == "prefill"} == set(smoke.gdn_prefill)
    hk, hv, dk, dv = smoke.gdn
    one = next(r for r in gdn if r["pass"] == "decode" and r["batch"] == 1)  # the state read and written, in GB/s
    assert one["gbps"] == pytest.approx((2 * hv * dk * dv * 4 + (2 * hk * dk + 2 * hv * dv) * 4) / one["ms"] / 1e6,
                                        rel=0.01, abs=2e-3)
    triton_skips = {r["bench"] for r in skipped if r["backend"] == "triton"}
    assert triton_skips == {"moe", "fp8_moe", "fp8_gemm", "mla", "gemv", "gdn"}


def test_only_filters_and_a_failing_point_is_reported_while_the_run_goes_on(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr("flotilla.kernels.moe.torch_ref.fused_experts", broken)
    assert bk.main(["--cpu-smoke", "--only", "moe,routing"]) == 0
    records = _lines(capsys)
    assert {r["bench"] for r in records} == {"env", "moe", "routing", "summary"}
    failed = [r for r in records if "error" in r]
    assert failed and all(r.get("backend") == "torch" and "kernel exploded" in r["error"] for r in failed)
    assert {r["tokens"] for r in failed} == set(bk.SMOKE_SIZES.moe_tokens)
    assert any(r.get("backend") == "deep_gemm_layout_ref" and "ms" in r for r in records)  # the others still ran
    assert any(r["bench"] == "routing" and "ms" in r for r in records)
    assert records[-1]["errors"] == len(failed)


def test_unknown_benches_are_refused(capsys):
    with pytest.raises(SystemExit):
        bk.main(["--cpu-smoke", "--only", "moe,nope"])
    assert "nope" in capsys.readouterr().err


def test_small_points_are_also_timed_replayed_from_a_graph_of_several_calls(capsys):
    """point_modes: an eager record, then (up to graph_tokens tokens, where graphs exist) a "graph" record timed
    over a capture holding GRAPH_REPS calls, its ms per call; a capture that fails is that record's error. On CPU
    a stand-in capture (the calls themselves) takes the graph's place."""
    import torch

    bench = bk.Bench(torch.device("cpu"), 0.01, 0, smoke=True, graph_tokens=4)
    calls = []
    bench.capture = lambda fn: fn  # what a replay runs: the captured calls
    bench.point_modes({"bench": "moe", "backend": "x"}, 4, lambda: calls.append(1))
    eager, graph = _lines(capsys)
    assert (eager["mode"], graph["mode"], graph["graph_reps"]) == ("eager", "graph", bk.GRAPH_REPS)
    # smoke timing: the first call, then two timed calls, each replay running GRAPH_REPS calls
    assert len(calls) == 3 + 3 * bk.GRAPH_REPS
    bench.point_modes({"bench": "moe", "backend": "x"}, 5, lambda: None)  # over graph_tokens: eager only
    assert [r["mode"] for r in _lines(capsys)] == ["eager"]

    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    bench.capture = refuse
    bench.point_modes({"bench": "moe", "backend": "x"}, 1, lambda: None)
    eager, failed = _lines(capsys)
    assert "ms" in eager and failed["mode"] == "graph" and "not permitted" in failed["error"]
    bench.capture = None  # CPU as it is: no graphs
    bench.point_modes({"bench": "moe", "backend": "x"}, 1, lambda: None)
    assert [r["mode"] for r in _lines(capsys)] == ["eager"]


def test_the_fused_routing_points_lift_the_one_launch_limit_only_while_they_run():
    from flotilla.kernels.moe import routing

    limit = routing.FUSED_ALIGN_MAX_SLOTS
    with bk._align_limit(4 * limit):
        assert routing.FUSED_ALIGN_MAX_SLOTS == 4 * limit
    with bk._align_limit(1):  # never lowered
        assert routing.FUSED_ALIGN_MAX_SLOTS == limit
    with pytest.raises(RuntimeError), bk._align_limit(8 * limit):
        raise RuntimeError("a point failed")
    assert routing.FUSED_ALIGN_MAX_SLOTS == limit
