"""Online serving benchmark: streamed completions over HTTP against any OpenAI-compatible server.

Sends random token-id prompts to POST /v1/completions (``prompt`` as a list of token ids, ignore_eos,
a fixed max_tokens per request, stream with usage) at Poisson arrival rates, reads the SSE stream by
hand and reports, per rate, throughput and TTFT / TPOT / ITL / E2E latency (mean, p50, p90, p99) and
goodput under an SLO. flotilla and vLLM both accept this request, so one command measures either:

    flotilla serve /models/Qwen3-8B --port 8000            # or: vllm serve /models/Qwen3-8B --port 8000
    python -m flotilla.scripts.dev.bench_serving --base-url http://127.0.0.1:8000 \\
        --num-prompts 1000 --input-len 1024 --output-len 256 --request-rate 1,2,4,8,inf --json qwen3.json

    # nano-vllm's workload (256 prompts, lengths uniform in [100, 1024], seed 0), all at once
    flotilla bench serving --dataset nano --num-prompts 256 --request-rate inf

    # at most 64 requests in flight, with an SLO: goodput = req/s that met TTFT <= 500 ms and TPOT <= 50 ms
    flotilla bench serving --request-rate inf --max-concurrency 64 --slo-ttft-ms 500 --slo-tpot-ms 50

    # a long/short mix: 32 prompts of 16,000 tokens (128 out) among 288 of 200 (256 out), spread by the seed;
    # each row also gives the long and the short requests' TTFT / TPOT apart
    flotilla bench serving --dataset mixed --num-prompts 288 --long-prompts 32 --input-len 200 --output-len 256 \\
        --request-rate 4,inf

Every rate replays the same requests with the same seeded arrival times, so rows compare across rates,
runs and engines. The model is the server's first in GET /v1/models unless --model names one; the
answer is recorded in the JSON with the command line, date and every row. Each request has a timeout,
so a run always ends. The client ignores proxy environment variables: it measures the server, not a
proxy. Run it on a machine (or cores) apart from the server's when the client's CPU could be the limit.

Exit status: 0 when every request completed, 3 when some failed (the rows still say how many and
why), 1 when nothing could be measured (server unreachable, warm-up failed, a request too long).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import math
import shlex
import sys
import time
from typing import Any

import httpx
import msgspec

from flotilla import envs
from flotilla.scripts.dev.bench_metrics import RequestResult, format_classes, format_report, summarize
from flotilla.scripts.dev.bench_workload import (Workload, arrival_offsets, mixed_workload, nano_workload,
                                                random_workload)
from flotilla.server.cli import HelpFormatter

_decode = msgspec.json.decode


class BenchmarkError(Exception):
    """The benchmark cannot run (server unreachable, unknown model, a request too long); nothing was measured."""


def parse_rates(text: str) -> list[float]:
    """'1,2.5,inf' -> [1.0, 2.5, inf]: request rates in req/s, each positive."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rates are numbers or 'inf', comma-separated (got {text!r})") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive (got {text!r})")
    return rates


def rate_label(rate: float) -> str | float:
    """JSON has no infinity: an unbounded rate is written as the string 'inf'."""
    return "inf" if math.isinf(rate) else rate


def build_workload(args: argparse.Namespace) -> Workload:
    """The requests the flags describe; the same flags always give the same requests."""
    if args.dataset == "nano":
        return nano_workload(args.num_prompts, vocab_size=args.vocab_size, seed=args.seed)
    if args.dataset == "mixed":
        return mixed_workload(args.num_prompts, args.input_len, args.output_len, long_prompts(args),
                              args.long_input_len, args.long_output_len, vocab_size=args.vocab_size, seed=args.seed)
    return random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                           vocab_size=args.vocab_size, seed=args.seed)


def long_prompts(args: argparse.Namespace) -> int:
    """The mixed dataset's long requests: --long-prompts, else one in nine (long_ctx.py's 32 among 288)."""
    return min(args.num_prompts, args.long_prompts if args.long_prompts is not None else args.num_prompts // 9)


def length_classes(args: argparse.Namespace, workload: Workload, results: list[RequestResult], duration: float
                   ) -> dict[str, Any]:  # fmt: skip
    """The mixed dataset's long and short requests summarized apart (what long prefills cost the short ones);
    empty for the other datasets."""
    if args.dataset != "mixed":
        return {}
    slo = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    is_long = [len(p) == args.long_input_len for p in workload.prompts]
    return {name: summarize([r for r, long in zip(results, is_long) if long == want], duration, **slo)
            for name, want in (("short", False), ("long", True))}


def request_body(model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict[str, Any]:
    """The completions request: exact output length (ignore_eos), streamed, usage in the last chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                            timeout_s: float) -> None:
    """Send one request and fill ``result`` from its SSE stream; never raises for a failed request.

    The arrival time of a line is taken as soon as it is read, before it is decoded, so the client's
    JSON cost does not count against the server.
    """
    usage_seen = done = False
    result.send_time = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:200]}"
                    return
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments and event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        result.end_time, done = now, True
                        continue  # read to the end of the body so the connection goes back to the pool
                    event = _decode(data)
                    if event.get("error"):
                        result.error = f"error event: {str(event['error'])[:200]}"
                        return
                    # a chunk with text, or with none before the choice's end (a token id-only server, a token
                    # inside a UTF-8 character), brought tokens; the end's empty chunk brought none
                    if any(c.get("text") or c.get("finish_reason") is None for c in event.get("choices") or ()):
                        result.chunk_times.append(now)
                    if event.get("usage"):
                        result.output_tokens, usage_seen = int(event["usage"]["completion_tokens"]), True
    except TimeoutError:
        result.error = f"timeout after {timeout_s:g} s"
        return
    except (httpx.HTTPError, msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        result.error = f"{type(e).__name__}: {str(e)[:200]}"
        return
    if not done:
        result.error = "stream ended before data: [DONE]"
        return
    if not usage_seen:
        result.output_tokens = len(result.chunk_times)
    result.success = True


async def run_rate(client: httpx.AsyncClient, url: str, model: str, workload: Workload, rate: float,
                   args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """Replay the workload at ``rate`` req/s (Poisson, seeded), at most --max-concurrency in flight.

    Returns every request's result and the wall time from the first send to the last byte, s.
    Each request waits for its arrival time, then for a concurrency slot, so the arrival schedule is
    the same whatever the limit; its send time is taken when it actually leaves.
    """
    offsets = arrival_offsets(len(workload), rate, seed=args.seed, burstiness=args.burstiness)
    results = [RequestResult(len(p), m) for p, m in zip(workload.prompts, workload.output_lens)]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(i: int) -> None:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            body = request_body(model, workload.prompts[i], workload.output_lens[i], args.temperature)
            await stream_completion(client, url, body, results[i], args.request_timeout)

    await asyncio.gather(*(one(i) for i in range(len(workload))))
    return results, time.perf_counter() - start


async def server_models(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """GET /v1/models, or a BenchmarkError that says why the server cannot be benchmarked."""
    try:
        response = await client.get(base_url + "/v1/models", timeout=30.0)
    except httpx.HTTPError as e:
        raise BenchmarkError(f"cannot reach {base_url}/v1/models: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        raise BenchmarkError(f"{base_url}/v1/models answered {response.status_code}: {response.text[:200]}")
    try:
        return msgspec.json.decode(response.content, type=dict[str, Any])
    except msgspec.DecodeError as e:
        raise BenchmarkError(f"{base_url}/v1/models is not an OpenAI model list: {e}") from e


def pick_model(models: dict[str, Any], requested: str | None, workload: Workload) -> str:
    """The model to benchmark; fails early when a request would exceed the model's max_model_len."""
    entries = {m.get("id"): m for m in models.get("data") or []}
    if requested is None:
        if not entries:
            raise BenchmarkError("the server lists no model; pass --model")
        requested = next(iter(entries))
    limit = entries.get(requested, {}).get("max_model_len")
    if limit:
        longest = max(len(p) + m for p, m in zip(workload.prompts, workload.output_lens))
        if longest > limit:
            raise BenchmarkError(f"a request needs {longest} tokens but {requested} has max_model_len {limit}; "
                                 "lower --input-len / --output-len")
    return requested


async def benchmark(args: argparse.Namespace, rates: list[float]) -> dict[str, Any]:
    """Warm up, then run every rate in turn; returns the whole report (what --json writes)."""
    base_url = args.base_url.rstrip("/")
    url = base_url + args.endpoint
    workload = build_workload(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connections = max(args.max_concurrency or len(workload), 1)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(args.request_timeout),
                                 trust_env=False) as client:
        models = await server_models(client, base_url)
        model = pick_model(models, args.model, workload)
        shortest = min(workload.prompts, key=len)
        for _ in range(args.warmup):
            probe = RequestResult(len(shortest), 4)
            body = request_body(model, shortest, probe.max_tokens, args.temperature)
            await stream_completion(client, url, body, probe, args.request_timeout)
            if not probe.success:
                raise BenchmarkError(f"the warm-up request failed: {probe.error}")
        rows = []
        for rate in rates:
            print(f"rate {rate:g} req/s: {len(workload)} requests ...", file=sys.stderr, flush=True)
            results, duration = await run_rate(client, url, model, workload, rate, args)
            row = {"request_rate": rate_label(rate), "max_concurrency": args.max_concurrency,
                   **summarize(results, duration, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms),
                   **length_classes(args, workload, results, duration)}
            if args.save_detailed:
                row["requests"] = [r.detail() for r in results]
            rows.append(row)
    return {
        "command": shlex.join(sys.orig_argv), "arguments": args.argv,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": base_url, "endpoint": args.endpoint, "model": model, "server_models": models,
        "workload": {"dataset": args.dataset, "num_prompts": len(workload),
                     **({"input_len": args.input_len, "output_len": args.output_len} if args.dataset != "nano" else {}),
                     **({"range_ratio": args.range_ratio} if args.dataset == "random" else {}),
                     **({"long_prompts": long_prompts(args), "long_input_len": args.long_input_len,
                         "long_output_len": args.long_output_len} if args.dataset == "mixed" else {}),
                     "vocab_size": args.vocab_size,
                     "seed": args.seed, "temperature": args.temperature, "input_tokens": workload.input_tokens,
                     "output_tokens": workload.output_tokens},
        "settings": {"burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                     "request_timeout_s": args.request_timeout, "warmup": args.warmup,
                     "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms},
        "results": rows,
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {text})")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of the benchmark (also used by `flotilla bench serving`)."""
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    server.add_argument("--endpoint", default="/v1/completions", help="the completions route under --base-url")
    server.add_argument("--model", default=None, help="model name to send; default: the first in GET /v1/models")
    server.add_argument("--api-key", default=None,
                        help="sent as `Authorization: Bearer KEY`; default: $FLOTILLA_API_KEY, then $OPENAI_API_KEY, "
                             "then no key")
    work = p.add_argument_group("workload")
    work.add_argument("--dataset", choices=["random", "nano", "mixed"], default="random",
                      help="random: lengths from --input-len / --output-len / --range-ratio; nano: nano-vllm's "
                           "bench (lengths uniform in [100, 1024]; --input-len etc. are ignored); mixed: "
                           "--long-prompts of --long-input-len / --long-output-len among the others' --input-len / "
                           "--output-len, shuffled by --seed, with the long and the short requests' latencies apart "
                           "too")
    work.add_argument("--num-prompts", type=_positive_int, default=1000, help="requests per rate")
    work.add_argument("--input-len", type=_positive_int, default=1024, help="random, mixed: prompt length, tokens")
    work.add_argument("--output-len", type=_positive_int, default=128,
                      help="random, mixed: output length (max_tokens with ignore_eos), tokens")
    work.add_argument("--range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    work.add_argument("--long-prompts", type=int, default=None,
                      help="mixed: how many of --num-prompts are long; default: one in nine (long_ctx.py's 32 of 288)")
    work.add_argument("--long-input-len", type=_positive_int, default=16000,
                      help="mixed: the long prompts' length, tokens (above --input-len)")
    work.add_argument("--long-output-len", type=_positive_int, default=128,
                      help="mixed: the long requests' output length, tokens")
    work.add_argument("--vocab-size", type=_positive_int, default=10000,
                      help="prompt token ids are drawn below this (10000 suits any real model)")
    work.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    work.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=parse_rates, default="inf",
                      help="request rates in req/s, comma-separated, one result row each; inf = all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the Gamma inter-arrival times: 1 = Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="most requests in flight at once (others wait for a slot); default: no limit")
    load.add_argument("--request-timeout", type=float, default=600.0,
                      help="a request still running after this many seconds fails as a timeout, s")
    load.add_argument("--warmup", type=int, default=1,
                      help="short requests sent one by one before measuring (they also check the server works)")
    out = p.add_argument_group("metrics and output")
    out.add_argument("--slo-ttft-ms", type=float, default=None,
                     help="goodput SLO: time to first token at most, ms; default: none")
    out.add_argument("--slo-tpot-ms", type=float, default=None,
                     help="goodput SLO: time per output token at most, ms; default: none")
    out.add_argument("--json", default=None, help="write the command, server answer and every row to this file")
    out.add_argument("--save-detailed", action="store_true",
                     help="also write each request's TTFT, TPOT, ITLs and E2E (ms) to the JSON")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="bench_serving", description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would cost client CPU
    args.api_key = args.api_key or envs.FLOTILLA_API_KEY or envs.OPENAI_API_KEY
    if not 0.0 <= args.range_ratio < 1.0 or args.burstiness <= 0 or args.request_timeout <= 0 or args.warmup < 0:
        p.error("need 0 <= --range-ratio < 1, --burstiness > 0, --request-timeout > 0, --warmup >= 0")
    if args.dataset == "mixed" and (args.long_input_len <= args.input_len or (args.long_prompts or 0) < 0):
        p.error("--dataset mixed needs --long-input-len above --input-len and --long-prompts >= 0")
    try:
        report = asyncio.run(benchmark(args, args.request_rate))
    except BenchmarkError as e:
        print(f"bench_serving: {e}", file=sys.stderr)
        return 1
    w = report["workload"]
    print(f"model {report['model']} at {report['base_url']}: {w['num_prompts']} prompts ({w['dataset']}), "
          f"{w['input_tokens']} input / {w['output_tokens']} output tokens per rate, temperature {w['temperature']:g}")
    print(format_report(report["results"]))
    if args.dataset == "mixed":
        print(format_classes(report["results"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(row["failed"] == 0 for row in report["results"]) else 3


if __name__ == "__main__":
    sys.exit(main())
