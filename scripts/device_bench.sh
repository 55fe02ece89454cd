#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, then the offline benchmarks at real shapes; results in $OUT.
#   device run, carry [".gpu-bundle"]:  bash scripts/device_bench.sh
# MODELS (default "qwen3-0.6b qwen3-8b") and BENCH_ARGS (extra bench_offline flags) adjust it.
set -uo pipefail
source .gpu-bundle/setup.sh
OUT=${OUT:-/tmp/flotilla-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -m gpu tests/test_kernels_flashinfer.py tests/test_kernels_triton.py tests/test_engine.py tests/test_sampling.py \
  -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  python3 -m flotilla.scripts.bench_offline --model "$m" --workload both ${BENCH_ARGS:-} \
    --json "$OUT/flotilla-$m.json" > "$OUT/bench-$m.log" 2>&1
  tail -3 "$OUT/bench-$m.log"
done
tar -cf "$OUT/flashinfer-cache.tar" -C ~/.cache flashinfer 2>/dev/null || true
