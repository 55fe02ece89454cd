"""The serving benchmark: its pure parts on fixed seeds and synthetic timings, then one toy run against a
real `flotilla serve` process on a tiny random model."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics

import httpx
import pytest

from flotilla.scripts.dev import bench_serving
from flotilla.scripts.dev.bench_metrics import (RequestResult, format_classes, format_report, latency_stats, meets_slo,
                                               summarize)
from flotilla.scripts.dev.bench_workload import (Workload, arrival_offsets, length_bounds, mixed_workload,
                                                nano_workload, random_workload)
from helpers_engine import write_tiny_engine_model
from helpers_server import start_server


def test_nano_workload_is_nano_vllms_recipe():
    # nano-vllm's bench.py, verbatim but on a private Random (the same stream as random.seed(0))
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(8)]
    outputs = [rng.randint(100, 1024) for _ in range(8)]
    w = nano_workload(8, vocab_size=10001)
    assert w.prompts == prompts and w.output_lens == outputs
    capped = nano_workload(8)  # default vocabulary: same lengths, ids below 10000
    assert [len(p) for p in capped.prompts] == [len(p) for p in prompts] and capped.output_lens == outputs
    assert max(max(p) for p in capped.prompts) < 10000


def test_random_workload_is_deterministic_and_within_bounds():
    a = random_workload(200, 64, 32, range_ratio=0.5, vocab_size=300, seed=3)
    assert a == random_workload(200, 64, 32, range_ratio=0.5, vocab_size=300, seed=3)
    assert a != random_workload(200, 64, 32, range_ratio=0.5, vocab_size=300, seed=4)
    assert {len(p) for p in a.prompts} <= set(range(32, 97)) and set(a.output_lens) <= set(range(16, 49))
    assert len({len(p) for p in a.prompts}) > 20, "lengths should spread over the range"
    assert all(0 <= t < 300 for p in a.prompts for t in p)
    fixed = random_workload(5, 16, 8, vocab_size=300)
    assert [len(p) for p in fixed.prompts] == [16] * 5 and fixed.output_lens == [8] * 5
    assert fixed.input_tokens == 80 and fixed.output_tokens == 40
    assert length_bounds(1, 0.9) == (1, 1)
    with pytest.raises(ValueError):
        length_bounds(10, 1.0)


def test_mixed_workload_spreads_its_long_prompts_among_the_short():
    w = mixed_workload(90, 20, 8, num_long=10, long_input_len=300, long_output_len=4, vocab_size=300, seed=3)
    assert w == mixed_workload(90, 20, 8, num_long=10, long_input_len=300, long_output_len=4, vocab_size=300, seed=3)
    assert w != mixed_workload(90, 20, 8, num_long=10, long_input_len=300, long_output_len=4, vocab_size=300, seed=4)
    long = [i for i, p in enumerate(w.prompts) if len(p) == 300]
    assert len(long) == 10 and all(w.output_lens[i] == 4 for i in long)
    assert sorted(len(p) for p in w.prompts) == [20] * 80 + [300] * 10 and w.output_tokens == 80 * 8 + 10 * 4
    assert long != list(range(10)) and max(long) - min(long) > 30, "the long ones arrive spread out"
    assert all(0 <= t < 300 for p in w.prompts for t in p)
    with pytest.raises(ValueError):
        mixed_workload(5, 20, 8, num_long=6, long_input_len=300, long_output_len=4)


def test_a_mixed_rows_long_and_short_requests_are_summarized_apart():
    args = argparse.Namespace(dataset="mixed", long_input_len=3, slo_ttft_ms=None, slo_tpot_ms=None)
    workload = Workload([[1] * 3, [1], [1, 1, 1], [1]], [2, 2, 2, 2])
    results = [synthetic(0.0, [0.5, 0.6], 0.7, tokens=2), synthetic(0.0, [0.1, 0.15], 0.2, tokens=2),
               synthetic(0.0, [0.7, 0.9], 1.1, tokens=2), synthetic(0.0, [0.3, 0.4], 0.5, tokens=2)]
    classes = bench_serving.length_classes(args, workload, results, duration=2.0)
    assert classes["long"]["completed"] == classes["short"]["completed"] == 2
    long, short = classes["long"], classes["short"]
    assert long["mean_ttft_ms"] == pytest.approx(600.0) and short["mean_ttft_ms"] == pytest.approx(200.0)
    assert long["mean_tpot_ms"] == pytest.approx(300.0) and short["p50_tpot_ms"] == pytest.approx(150.0)
    assert bench_serving.length_classes(argparse.Namespace(dataset="random"), workload, results, 2.0) == {}
    table = format_classes([{"request_rate": "inf", **classes}])
    assert table.count("TTFT") == 2 and "short" in table and "long" in table and "600.00" in table


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    offsets = arrival_offsets(20001, 4.0, seed=0)
    assert offsets == arrival_offsets(20001, 4.0, seed=0) and offsets != arrival_offsets(20001, 4.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    # P(gap > mean) = 1/e for an exponential distribution
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    bursty = [b - a for a, b in itertools.pairwise(arrival_offsets(20001, 4.0, seed=0, burstiness=0.25))]
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(k)
    assert arrival_offsets(5, math.inf) == [0.0] * 5


def test_rates_parse():
    assert bench_serving.parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0", "-1", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.parse_rates(bad)


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def completion(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": None}


USAGE = {"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}


def stream_one(handler) -> RequestResult:
    """stream_completion against an in-memory transport answering with ``handler``."""
    async def go() -> RequestResult:
        result = RequestResult(prompt_len=4, max_tokens=3)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            body = bench_serving.request_body("m", [1, 2, 3, 4], 3, 0.0)
            await bench_serving.stream_completion(client, "http://test/v1/completions", body, result, timeout_s=0.5)
        return result
    return asyncio.run(go())


def test_sse_stream_parsing_counts_token_chunks_and_trusts_usage():
    """Every chunk before a choice's end brought tokens (with text, or none yet: a token id-only server, a token
    inside a UTF-8 character); the end's empty chunk brought none."""
    sent = []

    def ok(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=sse(completion(""), completion("a"), completion(""), completion("bc"),
                                               completion("", "length"), USAGE, b"[DONE]"))

    r = stream_one(ok)
    assert r.success and r.error == "" and r.output_tokens == 3 and len(r.chunk_times) == 4
    assert r.send_time <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
    assert sent[0]["prompt"] == [1, 2, 3, 4] and sent[0]["ignore_eos"] and sent[0]["stream"]
    assert sent[0]["stream_options"] == {"include_usage": True} and sent[0]["max_tokens"] == 3

    no_usage = stream_one(lambda _: httpx.Response(200, content=sse(completion("a"), completion("b"), b"[DONE]")))
    assert no_usage.success and no_usage.output_tokens == 2


async def slow_body():
    yield sse(completion("a"))
    await asyncio.sleep(5)
    yield sse(b"[DONE]")


@pytest.mark.parametrize("handler, error", [
    (lambda _: httpx.Response(429, json={"error": {"message": "busy"}}), "HTTP 429"),
    (lambda _: httpx.Response(200, content=sse(completion("a"), {"error": {"message": "engine died"}}, b"[DONE]")),
     "engine died"),
    (lambda _: httpx.Response(200, content=sse(completion("a"), USAGE)), "before data: [DONE]"),
    (lambda _: httpx.Response(200, content=sse(b"{not json")), "DecodeError"),
    (lambda _: httpx.Response(200, content=slow_body()), "timeout after 0.5 s"),
])
def test_sse_stream_failures_are_recorded_not_raised(handler, error):
    r = stream_one(handler)
    assert not r.success and error in r.error


def synthetic(send: float, chunks: list[float], end: float, tokens: int, max_tokens: int | None = None) -> RequestResult:
    return RequestResult(prompt_len=10, max_tokens=max_tokens or tokens, send_time=send, chunk_times=chunks,
                         end_time=end, output_tokens=tokens, success=True)


def test_request_timings_percentiles_and_goodput():
    a = synthetic(0.0, [0.1, 0.2, 0.4], 0.5, tokens=5)      # TTFT 100, TPOT (500-100)/4 = 100, ITL 100 200
    b = synthetic(1.0, [1.3, 1.35], 1.4, tokens=3)          # TTFT 300, TPOT 50, ITL 50
    c = synthetic(2.0, [2.05], 2.05, tokens=1)              # one token: no TPOT, no ITL
    failed = RequestResult(prompt_len=10, max_tokens=4, send_time=3.0, error="HTTP 500: boom")
    assert a.ttft == pytest.approx(0.1) and a.tpot == pytest.approx(0.1) and a.e2e == pytest.approx(0.5)
    assert c.tpot is None and c.itls == [] and b.itls == pytest.approx([0.05])

    stats = latency_stats([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}

    row = summarize([a, b, c, failed], duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=120)
    assert row["completed"] == 3 and row["failed"] == 1 and row["errors"] == {"HTTP 500: boom": 1}
    assert row["total_input_tokens"] == 30 and row["total_output_tokens"] == 9
    assert row["request_throughput"] == 1.5 and row["output_throughput"] == 4.5 and row["total_token_throughput"] == 19.5
    assert row["mean_ttft_ms"] == pytest.approx(150.0) and row["p50_ttft_ms"] == pytest.approx(100.0)
    assert row["mean_tpot_ms"] == pytest.approx(75.0) and row["p90_tpot_ms"] == pytest.approx(95.0)
    assert row["mean_itl_ms"] == pytest.approx(350 / 3) and row["p50_itl_ms"] == pytest.approx(100.0)
    assert row["mean_e2e_ms"] == pytest.approx((500 + 400 + 50) / 3)
    # a: TTFT 100 <= 200, TPOT 100 <= 120; b: TTFT 300 > 200; c: TTFT 50, TPOT counts as 0
    assert row["good_requests"] == 2 and row["goodput"] == 1.0
    assert meets_slo(b, None, 60) and not meets_slo(a, None, 60) and not meets_slo(failed, None, None)
    assert summarize([a], 1.0)["goodput"] is None
    assert summarize([synthetic(0, [0.1], 0.2, tokens=3, max_tokens=4)], 1.0)["output_len_mismatch"] == 1

    report = format_report([{**row, "request_rate": "inf", "max_concurrency": None}])
    assert "TTFT" in report and "ITL" in report and "1 x HTTP 500: boom" in report


@pytest.mark.slow
def test_benchmark_against_a_real_server(tmp_path, capsys):
    model = write_tiny_engine_model(tmp_path / "tiny")
    server = start_server(str(model), "--kv-cache-blocks", "256", "--block-size", "4")
    out, mixed = tmp_path / "bench.json", tmp_path / "mixed.json"
    try:
        rc = bench_serving.main(["--base-url", server.url, "--num-prompts", "12", "--input-len", "16",
                                 "--output-len", "8", "--vocab-size", "300", "--request-rate", "inf,20",
                                 "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--request-timeout", "60",
                                 "--json", str(out), "--save-detailed"])
        table = capsys.readouterr().out
        # a long/short mix: 3 prompts of 120 tokens among 12, the latencies of each kind apart too
        mixed_rc = bench_serving.main(["--base-url", server.url, "--dataset", "mixed", "--num-prompts", "12",
                                       "--long-prompts", "3", "--long-input-len", "120", "--long-output-len", "4",
                                       "--input-len", "8", "--output-len", "6", "--vocab-size", "300",
                                       "--request-timeout", "60", "--json", str(mixed)])
        mixed_table = capsys.readouterr().out
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
    assert mixed_rc == 0, mixed_table
    m = json.loads(mixed.read_text())
    assert m["workload"]["long_prompts"] == 3 and m["workload"]["input_tokens"] == 3 * 120 + 9 * 8
    row = m["results"][0]
    assert row["completed"] == 12 and row["total_output_tokens"] == 3 * 4 + 9 * 6
    assert (row["long"]["completed"], row["short"]["completed"]) == (3, 9)
    assert row["long"]["total_input_tokens"] == 360 and row["short"]["total_output_tokens"] == 54
    assert mixed_table.count("TTFT") == 3 and "short" in mixed_table  # all requests, then the short and the long
    print(table)
    assert rc == 0, table
    report = json.loads(out.read_text())
    assert {"command", "date", "base_url", "model", "server_models", "workload", "settings", "results"} <= set(report)
    assert report["model"] == "tiny" and report["server_models"]["data"][0]["id"] == "tiny"
    assert [row["request_rate"] for row in report["results"]] == ["inf", 20.0]
    for row in report["results"]:
        assert row["completed"] == 12 and row["failed"] == 0 and row["output_len_mismatch"] == 0
        assert row["total_input_tokens"] == 12 * 16 and row["total_output_tokens"] == 12 * 8
        assert row["good_requests"] == 12 and row["output_throughput"] > 0
        for name in ("ttft", "tpot", "itl", "e2e"):
            assert row[f"p50_{name}_ms"] <= row[f"p99_{name}_ms"]
        for r in row["requests"]:
            assert r["success"] and r["output_tokens"] == 8
            assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    # at 20 req/s the 12 requests arrive over about half a second, so the run cannot be shorter
    assert report["results"][1]["duration_s"] > 0.2
    assert "rate req/s" in table and "TPOT" in table
