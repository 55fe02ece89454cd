"""Plot flotilla against the vLLM peer from the JSON files the benchmarks wrote (device_compare.sh's compare/).

    python -m flotilla.scripts.dev.plot_performance RESULTS_DIR performance.png

Files: peer-MODEL.json (vLLM), flotilla-MODEL.json (the default engine) and flotilla-MODEL-VARIANT.json
(a variant, labelled "flotilla (VARIANT)"). Several folders may be given joined by ':'; a label found
in a later folder replaces the earlier one, and the bars show the variants as found, then flotilla, then vLLM.
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


def load(folders: list[Path]) -> dict[str, dict[str, dict]]:
    """{model: {engine label: result}} from flotilla-*.json and peer-*.json."""
    out: dict[str, dict[str, dict]] = {}
    for folder in folders:
        for f in sorted([*folder.glob("flotilla-*.json"), *folder.glob("peer-*.json")]):  # not the other records
            r = json.loads(f.read_text())
            if f.name.startswith("peer-"):
                label = "vLLM 0.26.0"
            else:
                variant = f.stem.removeprefix(f"flotilla-{r['model']}").strip("-")
                label = f"flotilla ({variant})" if variant else "flotilla"
            out.setdefault(r["model"], {})[label] = r
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folders, target = [Path(f) for f in argv[0].split(":")], Path(argv[1])
    data = load(folders)
    models = sorted(data)
    fig, axes = plt.subplots(len(models), len(METRICS), figsize=(11, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, (key, title) in enumerate(METRICS):
            ax = axes[i][j]
            found = [k for k, r in data[model].items() if key in r]  # variants, then flotilla, then vLLM
            labels = sorted(found, key=lambda k: (k.startswith("vLLM"), k == "flotilla", found.index(k)))
            values = [data[model][k][key] for k in labels]
            colors = ["#d9822b" if k.startswith("vLLM") else "#2a7ab9" if k == "flotilla" else "#bbbbbb" for k in labels]
            bars = ax.bar(labels, values, color=colors)
            ax.tick_params(axis="x", labelsize=7)
            ax.bar_label(bars, fmt="%.0f")
            ax.set_title(f"{model}: {title}", fontsize=10)
            ax.set_ylim(0, max(values) * 1.18)
    fig.suptitle(f"One H200, random bf16 weights ({', '.join(f.name for f in folders)})", fontsize=11)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
