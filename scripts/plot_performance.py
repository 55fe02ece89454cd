"""Plot flotilla against the vLLM peer from the JSON files the benchmarks wrote (docs/results/DATE/).

    python -m flotilla.scripts.plot_performance docs/results/2026-11-30 docs/performance-2026-11-30.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

METRICS = (("nano_workload_out_tok_per_s", "nano-vllm workload, output tok/s"),
           ("b1_decode_tok_per_s", "batch-1 decode, tok/s"))


def load(folder: Path) -> dict[str, dict[str, dict]]:
    """{model: {engine label: result}} from flotilla-*.json and peer-*.json."""
    out: dict[str, dict[str, dict]] = {}
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        label = "vLLM 0.26.0" if f.name.startswith("peer-") else (
            "flotilla (eager)" if f.stem.endswith("-eager") else "flotilla")
        out.setdefault(r["model"], {})[label] = r
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder, target = Path(argv[0]), Path(argv[1])
    data = load(folder)
    models = sorted(data)
    fig, axes = plt.subplots(len(models), len(METRICS), figsize=(11, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, (key, title) in enumerate(METRICS):
            ax = axes[i][j]
            labels = [k for k in ("flotilla (eager)", "flotilla", "vLLM 0.26.0") if k in data[model]]
            values = [data[model][k].get(key, 0) for k in labels]
            bars = ax.bar(labels, values, color=["#bbbbbb", "#2a7ab9", "#d9822b"][-len(labels):])
            ax.bar_label(bars, fmt="%.0f")
            ax.set_title(f"{model}: {title}", fontsize=10)
            ax.set_ylim(0, max(values) * 1.18)
    fig.suptitle(f"One H200, random bf16 weights ({folder.name})", fontsize=11)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
