"""plot_serving draws bench_serving reports (rates as numbers and 'inf') into one PNG."""

from __future__ import annotations

import json

from flotilla.scripts.dev import plot_serving


def _report(scale: float) -> dict:
    rows = []
    for rate in (1.0, 4.0, "inf"):
        r = 8.0 if rate == "inf" else rate
        rows.append({"request_rate": rate, "output_throughput": 100 * r * scale, "p50_ttft_ms": 20 * r * scale,
                     "p99_ttft_ms": 40 * r * scale, "p50_tpot_ms": 5 * scale, "p99_tpot_ms": None})
    return {"model": "tiny", "results": rows}


def test_two_engines_curves_land_in_one_png(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report(1.0)))
    b.write_text(json.dumps(_report(1.3)))
    out = tmp_path / "serving.png"
    assert plot_serving.main([f"flotilla={a}", f"vllm={b}", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [rate for rate, _ in plot_serving.curves(_report(1.0))] == [1.0, 4.0, float("inf")]


def test_a_missing_label_prints_the_usage():
    assert plot_serving.main(["only.json", "out.png"]) == 2
