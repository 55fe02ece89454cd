"""Serving-benchmark metrics: per-request timings in, one summary row per request rate out. Pure code.

The definitions are vLLM's benchmark_serving ones, so numbers from both tools mean the same thing:

  TTFT  send -> first chunk that brought tokens (any chunk before the choice's end: with text, or with none yet
        from a token id-only server or a token inside a UTF-8 character)
  E2E   send -> end of the stream
  TPOT  (E2E - TTFT) / (output_tokens - 1), per request with more than one output token: the mean
        decode time per token after the first, from the server's own token count (usage), not from
        chunks, so it stays right when one chunk carries several tokens
  ITL   every gap between consecutive token chunks, pooled over requests (what a reader sees stall)

Percentiles interpolate linearly (numpy's default, as vLLM). Throughputs divide by the wall time
of the whole rate, first send to last byte. Goodput counts only requests that met every SLO given.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
"""Percentiles reported for each latency, besides the mean."""
LATENCIES = ("ttft", "tpot", "itl", "e2e")
"""The latency metrics of a row, in the order they are shown; row keys are e.g. mean_ttft_ms, p99_itl_ms."""


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    prompt_len: int
    """Prompt length, tokens."""
    max_tokens: int
    """Requested output length, tokens (exact with ignore_eos)."""
    send_time: float = 0.0
    """When the request left (after any concurrency limit let it go), s."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried text, s."""
    end_time: float = 0.0
    """When the stream ended (data: [DONE]), s."""
    output_tokens: int = 0
    """Tokens generated: usage.completion_tokens, or the token chunks when the server sent no usage."""
    success: bool = False
    """The stream ended with [DONE] and no error."""
    error: str = ""
    """Why it failed: HTTP status and body, an error event, a timeout, a connection error."""

    @property
    def ttft(self) -> float:
        """Time to first token, s (the whole request when no chunk carried text)."""
        return (self.chunk_times[0] if self.chunk_times else self.end_time) - self.send_time

    @property
    def e2e(self) -> float:
        """End-to-end latency, s."""
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, s; None for a single-token output (nothing to divide)."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token chunks, s."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def detail(self) -> dict[str, Any]:
        """The request as JSON-ready numbers, ms relative to its send time (for --save-detailed)."""
        out: dict[str, Any] = {"prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
                               "output_tokens": self.output_tokens, "success": self.success, "error": self.error}
        if self.success:
            tpot = self.tpot
            out.update(ttft_ms=self.ttft * 1e3, e2e_ms=self.e2e * 1e3, tpot_ms=None if tpot is None else tpot * 1e3,
                       itl_ms=[g * 1e3 for g in self.itls])
        return out


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and PERCENTILES of latencies given in seconds, in ms; None for each when there are none."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a completed request met every SLO given (a single-token output has a TPOT of 0)."""
    if not r.success:
        return False
    if slo_ttft_ms is not None and r.ttft * 1e3 > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or (r.tpot or 0.0) * 1e3 <= slo_tpot_ms


def summarize(results: Sequence[RequestResult], duration_s: float, *, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """One result row: counts, throughputs, mean/p50/p90/p99 of each latency in ms, goodput.

    Latencies and token counts come from completed requests only: a failed one has no meaningful
    timing. ``goodput`` is None when no SLO was given.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive (got {duration_s})")
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    row: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "output_len_mismatch": sum(r.output_tokens != r.max_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.itls],
        "e2e": [r.e2e for r in done],
    }
    for name in LATENCIES:
        for stat, value in latency_stats(samples[name]).items():
            row[f"{stat}_{name}_ms"] = value
    if slo_ttft_ms is None and slo_tpot_ms is None:
        row["good_requests"] = row["goodput"] = None
    else:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done)
        row["good_requests"], row["goodput"] = good, good / duration_s
    row["errors"] = dict(Counter(r.error for r in results if not r.success).most_common(5))
    return row


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned columns, one header line; floats with two decimals, None as '-'."""
    cells = [list(headers)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def _rate(row: dict[str, Any]) -> str:
    rate = row["request_rate"]
    return f"{rate:g}" if isinstance(rate, float) else str(rate)


def format_report(rows: Sequence[dict[str, Any]]) -> str:
    """The human-readable result: a throughput table (one line per rate) and a latency table (ms)."""
    throughput = format_table(
        ["rate req/s", "max conc", "completed", "failed", "duration s", "req/s", "out tok/s", "total tok/s",
         "goodput req/s"],
        [[_rate(r), r["max_concurrency"], r["completed"], r["failed"], r["duration_s"],
          r["request_throughput"], r["output_throughput"], r["total_token_throughput"], r["goodput"]] for r in rows])
    latency = format_table(
        ["rate req/s", "latency ms", "mean", *(f"p{q}" for q in PERCENTILES)],
        [[_rate(r), name.upper(), *(r[f"{stat}_{name}_ms"] for stat in ("mean", *(f"p{q}" for q in PERCENTILES)))]
         for r in rows for name in LATENCIES])
    lines = [throughput, "", latency]
    for r in rows:
        for error, count in r["errors"].items():
            lines.append(f"rate {_rate(r)}: {count} x {error}")
    return "\n".join(lines)


def format_classes(rows: Sequence[dict[str, Any]]) -> str:
    """TTFT and TPOT of the short and the long requests apart (the rows of a long/short mix), ms."""
    stats = ("mean", *(f"p{q}" for q in PERCENTILES))
    return format_table(
        ["rate req/s", "requests", "completed", "latency ms", *stats],
        [[_rate(r), name, r[name]["completed"], metric.upper(), *(r[name][f"{stat}_{metric}_ms"] for stat in stats)]
         for r in rows for name in ("short", "long") if name in r for metric in ("ttft", "tpot")])
