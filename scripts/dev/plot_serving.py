"""Plot serving latency against request rate from bench_serving's JSON files, one line per engine.

    python -m flotilla.scripts.dev.plot_serving flotilla=serve-flotilla.json vllm=serve-vllm.json serving.png

Each argument LABEL=FILE is one engine's `bench_serving --json` report (every rate of one run); the last argument
is the PNG to write. Panels: TTFT and TPOT (p50 solid, p99 dashed) and output throughput, each against the
request rate; an unlimited rate (inf: every request at once) is drawn at the right end.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("ttft", "time to first token, ms"), ("tpot", "time per output token, ms"),
          ("output_throughput", "output tok/s"))


def rate_value(label: object) -> float:
    """bench_serving writes a rate as a number or the string 'inf'."""
    return math.inf if label in ("inf", math.inf) else float(label)  # type: ignore[arg-type]


def curves(report: dict) -> list[tuple[float, dict]]:
    """(rate, row) of a report, by rate."""
    return sorted(((rate_value(r["request_rate"]), r) for r in report["results"]), key=lambda rr: rr[0])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not all("=" in a for a in args[:-1]):
        print(__doc__, file=sys.stderr)
        return 2
    runs = {label: json.loads(Path(path).read_text()) for label, path in (a.split("=", 1) for a in args[:-1])}
    rates = sorted({rate for report in runs.values() for rate, _ in curves(report)})
    finite = [r for r in rates if math.isfinite(r)]
    at_inf = (max(finite) * 1.5 if finite else 1.0)  # where 'inf' is drawn

    def x(rate: float) -> float:
        return rate if math.isfinite(rate) else at_inf

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for ax, (key, title) in zip(axes, PANELS):
        for i, (label, report) in enumerate(runs.items()):
            rows = curves(report)
            color = f"C{i}"
            if key == "output_throughput":
                ax.plot([x(r) for r, _ in rows], [row[key] for _, row in rows], "o-", color=color, label=label)
                continue
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                ys = [row.get(f"{stat}_{key}_ms") for _, row in rows]
                ax.plot([x(r) for r, _ in rows], [math.nan if y is None else y for y in ys], style, color=color,
                        label=f"{label} {stat}")
        ax.set_title(title)
        ax.set_xlabel("request rate, req/s")
        ax.set_xticks([x(r) for r in rates], [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    model = next(iter(runs.values())).get("model", "")
    fig.suptitle(f"Serving {model}: latency and throughput against request rate")
    fig.tight_layout()
    fig.savefig(args[-1], dpi=100)
    print(f"wrote {args[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
